"""The self-made demo data and tokenizer: deterministic, local, loadable, lossless, correct offsets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import demo


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PIPELINES_CACHE", str(tmp_path))
    return tmp_path / demo.DEMO_VERSION


def test_resolve_passthrough_and_unknown(cache):
    assert demo.resolve_demo_path("data/x.jsonl") == "data/x.jsonl"
    assert demo.resolve_demo_path("s3://b/k") == "s3://b/k"
    with pytest.raises(ValueError, match="demo://nope"):
        demo.resolve_demo_path("demo://nope")
    assert not cache.exists()  # nothing generated for a passthrough


def test_files_are_generated_once_and_deterministic(cache):
    sft = Path(demo.resolve_demo_path("demo://sft"))
    text = Path(demo.resolve_demo_path("demo://text"))
    assert sft.parent == cache and sft.name == "sft.jsonl"
    records = [json.loads(line) for line in sft.read_text().splitlines()]
    assert len(records) == demo.SFT_RECORDS
    assert set(records[0]) == {"instruction", "input", "output"}
    assert records == demo.demo_sft_records()  # same content every time, on every node
    by_task = {r["instruction"]: r for r in records}
    assert set(by_task) == {"Name the capital of the country.", "Give the opposite of the word."}
    assert all(r["output"] == "Paris" for r in records if r["input"] == "France")
    assert all(r["output"] == "cold" for r in records if r["input"] == "hot")
    assert {r["input"] for r in records} == set(demo._CAPITALS) | set(demo._OPPOSITES)  # every entry trains
    docs = [json.loads(line) for line in text.read_text().splitlines()]
    assert len(docs) == demo.TEXT_DOCS and all(set(d) == {"text"} for d in docs)
    mtime = sft.stat().st_mtime_ns
    demo.resolve_demo_path("demo://sft")
    assert sft.stat().st_mtime_ns == mtime  # not rewritten


def test_tokenizer_roundtrip_offsets_and_chat_template(cache):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(demo.resolve_demo_path("demo://tokenizer"))
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 260
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (demo.PAD, demo.BOS, demo.EOS)
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3

    text = "Reverse the word.\n  tomila -> alimot, naïve café ✓" + demo.EOS
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    assert tok.decode(enc["input_ids"]) == text  # lossless, multi-byte characters included
    assert enc["input_ids"][-1] == tok.eos_token_id  # special tokens stay single tokens
    for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        piece = text[start:end]
        if tid == tok.eos_token_id:
            assert piece == demo.EOS
        elif piece.isascii():
            assert tok.decode([tid]) == piece  # ASCII: exactly one character per token
    assert [text[s:e] for s, e in enc["offset_mapping"][:7]] == list("Reverse")

    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "HI"}], tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHI<|im_end|>\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
