"""The tokenizer loaded through ``tokenizers`` alone encodes exactly as the transformers one does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import ALPACA, GPT2, SMOLLM2, make_config, needs_shared, write_jsonl

from pipelines.config import ModelConfig
from pipelines.tokenize.stage import byte_spans
from pipelines.tokenize.tokenizer import load_backend, load_tokenizer, shared_tokenizer


def _texts() -> list[str]:
    recs = json.loads(ALPACA.read_text())[:200]
    return [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}" for r in recs] + ["", " a", "\n\n x<|endoftext|>"]


@needs_shared
@pytest.mark.parametrize("path", [GPT2, SMOLLM2, "demo://tokenizer"], ids=["gpt2", "smollm2", "demo"])
def test_direct_backend_matches_transformers(path):
    model = ModelConfig.model_validate({"tokenizer": str(path), "init": {}})
    direct = load_backend(model)
    assert direct.direct, "a plain tokenizer.json should load without transformers"
    via_hf = load_backend(model, load_tokenizer(model))
    assert not via_hf.direct
    assert (direct.eos_token_id, direct.vocab_size) == (via_hf.eos_token_id, via_hf.vocab_size)
    assert direct.eos_token_id is not None
    texts = _texts()
    for flag in (True, False):
        a = direct.tokenizer.encode_batch(texts, add_special_tokens=flag)
        b = via_hf.tokenizer.encode_batch(texts, add_special_tokens=flag)
        assert [e.ids for e in a] == [e.ids for e in b]
        assert [e.offsets for e in a] == [e.offsets for e in b]
    assert sum(len(e.ids) for e in a) > 10_000  # real text, not a vacuous comparison


@needs_shared
def test_config_that_transformers_applies_falls_back(tmp_path):
    """A tokenizer_config key that transformers applies to the Rust tokenizer: load through transformers."""
    tok = tmp_path / "tok"
    shutil.copytree(GPT2, tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    model = ModelConfig.model_validate({"tokenizer": str(tok), "init": {}})
    assert not load_backend(model).direct


@needs_shared
def test_stages_share_one_tokenizer_per_process_and_files_loaded_again_when_they_change(tmp_path):
    """Stream after stream in one process (a shared read worker) builds its stage on one loaded tokenizer
    and its ByteSpans; a tokenizer.json rewritten in place, or another EOS token in the config, loads again."""
    tok = tmp_path / "tok"
    shutil.copytree(GPT2, tok)
    model = ModelConfig.model_validate({"tokenizer": str(tok), "init": {}})
    hf, first = shared_tokenizer(model, with_hf=False)
    assert hf is None and first.direct and shared_tokenizer(model, with_hf=False)[1] is first
    assert first.tokenizer.truncation is None and first.tokenizer.padding is None
    spans = byte_spans(first)
    assert spans is not None and byte_spans(first) is spans and not spans.byte_lengths.flags.writeable
    text = "Hello world, said the test."
    assert first.tokenizer.encode(text).ids[:2] == [15496, 995]
    hf, via_hf = shared_tokenizer(model, with_hf=True)  # the chat-template stage's: transformers' and its backend
    assert hf is not None and not via_hf.direct and shared_tokenizer(model, with_hf=True) == (hf, via_hf)
    assert via_hf.tokenizer.encode(text).ids == first.tokenizer.encode(text).ids

    data = json.loads((tok / "tokenizer.json").read_text())  # rewritten: one more token, matched first
    data["added_tokens"].append({"id": 50257, "content": "Hello world", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    (tok / "tokenizer.json").write_text(json.dumps(data))
    second = shared_tokenizer(model, with_hf=False)[1]
    assert second is not first and second.vocab_size == first.vocab_size + 1 == 50258
    assert second.tokenizer.encode(text).ids[0] == 50257
    assert len(byte_spans(second).byte_lengths) == 50258  # its own, not the first backend's
    assert shared_tokenizer(model, with_hf=False)[1] is second
    assert shared_tokenizer(model, with_hf=True)[0].encode(text)[0] == 50257

    cfg = json.loads((tok / "tokenizer_config.json").read_text())  # another EOS token, same tokenizer.json
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "Hello world"}))
    third = shared_tokenizer(model, with_hf=False)[1]
    assert (second.eos_token_id, third.eos_token_id) == (50256, 50257)

    smol = shared_tokenizer(ModelConfig.model_validate({"tokenizer": str(SMOLLM2), "init": {}}), with_hf=False)[1]
    assert len(byte_spans(smol).byte_lengths) == smol.vocab_size != first.vocab_size


@needs_shared
def test_non_chat_tokenizer_stage_does_not_import_transformers():
    """The tokenizer actor for an Alpaca dataset starts without importing transformers (or torch)."""
    code = f"""
import sys
from pipelines.config import config_from_dict
from pipelines.sources.listing import resolve_sources
from pipelines.stats import StatsSink
from pipelines.tokenize.stage import Tokenizer
cfg = config_from_dict({{"model": {{"tokenizer": "{GPT2}", "init": {{}}}},
                         "data": {{"datasets": [{{"path": "{ALPACA}", "type": "alpaca"}}]}}}}, base_dir=".")
Tokenizer(cfg.data, cfg.model, resolve_sources(cfg), StatsSink())
print(sorted(m for m in ("transformers", "torch") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@needs_shared
def test_actor_env_is_set_in_the_constructor_before_anything_loads(tmp_path):
    """The tokenizer actors get their environment as a constructor argument, not a ``runtime_env``: it
    replaces what the process inherited (an idle worker has the driver's environment) and is in place
    before the chat template's transformers tokenizer loads, so ``USE_TORCH=0`` keeps torch out."""
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}])
    code = f"""
import os, sys
os.environ.update(RAYON_NUM_THREADS="7", TOKENIZERS_PARALLELISM="true")
os.environ.pop("USE_TORCH", None)
from pipelines.config import config_from_dict
from pipelines.stream.stages import tokenizer_env
from pipelines.sources.listing import resolve_sources
from pipelines.stats import StatsSink
from pipelines.tokenize.stage import Tokenizer
cfg = config_from_dict({{"model": {{"tokenizer": "{SMOLLM2}", "init": {{}}}},
                         "data": {{"datasets": [{{"path": "{data}", "type": "chat_template"}}]}}}}, base_dir=".")
tok = Tokenizer(cfg.data, cfg.model, resolve_sources(cfg), StatsSink(), 1, tokenizer_env(1))
assert tok.hf is not None
print(os.environ["RAYON_NUM_THREADS"], os.environ["TOKENIZERS_PARALLELISM"], os.environ["USE_TORCH"],
      "transformers" in sys.modules, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1 false 0 True False"


@needs_shared
def test_tokenizer_pool_has_no_runtime_env(ray_local, tmp_path):
    """No ``runtime_env`` on the tokenizer pool (a worker with an environment of its own cannot be an idle,
    already started one; see ``tokenizer_env``); the environment travels in the constructor's arguments.
    (Inside the read tasks: tests/test_tokenizer_placement.py.)"""
    from ray.data._internal.logical.operators.map_operator import MapBatches

    from pipelines.stream.dataset import build_dataset
    from pipelines.stream.stages import tokenizer_env

    path = write_jsonl(tmp_path / "a.jsonl", json.loads(ALPACA.read_text(encoding="utf-8"))[:20])
    cfg = make_config([{"path": str(path), "type": "alpaca"}],
                      tokenize={"num_actors": 1, "threads": 2, "placement": "actors"})
    ops, maps = [build_dataset(cfg)._logical_plan.dag], []
    while ops:
        op = ops.pop()
        maps += [op] if isinstance(op, MapBatches) else []
        ops.extend(op.input_dependencies)
    assert len(maps) == 1
    assert "runtime_env" not in maps[0].ray_remote_args
    assert maps[0].fn_constructor_kwargs["env"] == tokenizer_env(2) == {
        "RAYON_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "true", "USE_TORCH": "0"}


@needs_shared
def test_the_tokenizer_encodes_as_its_tokenizer_json_says_whatever_class_it_declares():
    """SmolLM2 declares ``GPT2Tokenizer``; transformers 5's ``AutoTokenizer`` rebuilds that class and drops the
    file's ``Digits`` pre-tokenizer (huggingface/transformers#45701). The model was trained with the file's
    pipeline, so that is what every stage, the training workers and the export get."""
    from tokenizers import Tokenizer as RustTokenizer

    model = ModelConfig.model_validate({"tokenizer": str(SMOLLM2), "init": {}})
    hf = load_tokenizer(model)
    text = "Give three tips.\n\n1. Eat 2024 apples<|im_end|>"
    from_file = RustTokenizer.from_file(str(SMOLLM2 / "tokenizer.json")).encode(text).ids
    assert hf(text)["input_ids"] == from_file
    assert hf("\n\n1.")["input_ids"] == [1116, 33, 30]  # "\n\n" then one digit per token
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert hf.chat_template.startswith("{% for message in messages %}")
