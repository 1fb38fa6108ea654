"""Labels without offsets (``ByteSpans``) equal labels from offsets (``span_labels``), exactly.

The tokenizer stage encodes byte-level BPE tokenizers with ``encode_batch_fast`` and computes labels
from the ids' byte lengths; every other tokenizer keeps ``encode_batch`` and ``char_to_token``. These
tests run both paths over every corpus and tokenizer in ../shared/data and compare the stage's whole
output, and check the byte arithmetic on generated multi-byte text, including bytes that SmolLM2's
vocabulary has no token for (the model drops them, so the fast path must notice and fall back).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ALPACA, C4, GLAIVE, GPT2, LIMA, SHAKESPEARE, SMOLLM2, make_config, needs_shared
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.sources.listing import resolve_sources
from pipelines.sources.read import ReadOptions, read_files
from pipelines.stats import StatsSink
from pipelines.tokenize.labels import ByteSpans, span_labels
from pipelines.tokenize.stage import IGNORE_INDEX, Tokenizer

pytestmark = needs_shared


def _rust(path):
    from tokenizers import Tokenizer as RustTokenizer

    return RustTokenizer.from_file(str(path / "tokenizer.json"))


def _stage_output(cfg, fast: bool) -> tuple[list, dict, Tokenizer]:
    """The tokenizer stage over every file of ``cfg``: its output blocks as Python lists, and its counters.

    ``tok.with_offsets`` counts the samples labelled from an encoding with offsets: all of them on the
    offsets path, on the fast path only those whose ids did not tile their text."""
    table, sink = resolve_sources(cfg), StatsSink()
    opts = ReadOptions(table.storage, cfg.data.on_bad_record, tuple(d.text_field for d in table.datasets))
    tok = Tokenizer(cfg.data, cfg.model, table, sink)
    if not fast:
        tok.byte_spans = None  # the offsets path, as for a tokenizer that is not byte-level
    tok.with_offsets, one = 0, tok._with_offsets

    def counted(f, enc):
        tok.with_offsets += 1
        return one(f, enc)

    tok._with_offsets = counted
    blocks = [tok(b).select(["sample_id", "input_ids", "labels"]).to_pydict() for b in read_files(list(table.files), opts, sink)]
    return blocks, dict(sink.local.counters), tok


CORPORA = [
    ("alpaca-gpt2", ALPACA, "alpaca", GPT2),
    ("alpaca-smollm2", ALPACA, "alpaca", SMOLLM2),
    ("lima-gpt2", LIMA, "alpaca", GPT2),
    ("c4-gpt2", C4, "completion", GPT2),
    ("c4-smollm2", C4, "completion", SMOLLM2),
    ("shakespeare-smollm2", SHAKESPEARE, "completion", SMOLLM2),
]


@pytest.mark.parametrize(("name", "path", "kind", "tokenizer"), CORPORA, ids=[c[0] for c in CORPORA])
def test_fast_path_gives_the_offsets_path_output_on_real_corpora(name, path, kind, tokenizer):
    cfg = make_config([{"path": str(path), "type": kind}], tokenizer=tokenizer, on_bad_record="skip")
    fast, fast_counts, tok = _stage_output(cfg, fast=True)
    slow, slow_counts, slow_tok = _stage_output(cfg, fast=False)
    assert tok.byte_spans is not None and tok.byte_spans.usable(True) and tok.byte_spans.usable(False)  # the fast path ran
    assert tok.with_offsets == 0 < slow_tok.with_offsets  # every sample's ids tiled its text: no fallback
    assert fast == slow
    assert fast_counts == slow_counts
    trained = sum(lab != IGNORE_INDEX for block in fast for row in block["labels"] for lab in row)
    tokens = sum(len(row) for block in fast for row in block["input_ids"])
    assert tokens > 10_000 and trained > 0
    if kind != "completion":
        assert trained < tokens  # prompts are masked: the spans, not every token, decide
    if name == "lima-gpt2":  # one response whose first token also holds the prompt's last character
        assert fast_counts["label_span_straddles"] == 1


def test_byte_spans_only_for_tokenizers_whose_tokens_tile_the_text():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, normalizers, pre_tokenizers, processors

    assert ByteSpans.for_tokenizer(_rust(GPT2)) is not None
    assert ByteSpans.for_tokenizer(_rust(SMOLLM2)) is not None
    lower = _rust(GPT2)
    lower.normalizer = normalizers.Lowercase()
    prefix = _rust(GPT2)
    prefix.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trimmed = _rust(GPT2)
    trimmed.post_processor = processors.ByteLevel(trim_offsets=True)
    bos = _rust(SMOLLM2)
    bos.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    suffixed = RustTokenizer(models.BPE(vocab={"a": 0, "b": 1, "b</w>": 2, "ab</w>": 3}, merges=[("a", "b</w>")],
                                        end_of_word_suffix="</w>"))  # "ab</w>" is 2 bytes of text
    suffixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    unsuffixed = RustTokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    unsuffixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert ByteSpans.for_tokenizer(unsuffixed) is not None  # the same shape without the suffix is accepted
    for tok in (lower, prefix, trimmed, suffixed):
        assert ByteSpans.for_tokenizer(tok) is None
    with_bos = ByteSpans.for_tokenizer(bos)  # tiles the text only when the post-processor adds nothing
    assert with_bos is not None and not with_bos.usable(True) and with_bos.usable(False)


# Text that exercises byte arithmetic: ASCII, 2-4 byte characters, combining marks, emoji, controls
# (SmolLM2 has no token for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, nor the lead bytes 0xf1, 0xf2).
SMOLLM2_DROPS = ("\x04", "\x1d", "\U00040000")
ALPHABET = list("ab Z\n\t.,0123") + ["é", "ß", "中", "文", "\u0301", "😀", "👍🏽", "\U00040000", "\x04", "\x1d", "\x00"]


@pytest.fixture(scope="module")
def rust_tokenizers():
    toks = {"gpt2": _rust(GPT2), "smollm2": _rust(SMOLLM2)}
    return {name: (tok, ByteSpans.for_tokenizer(tok)) for name, tok in toks.items()}


def test_worked_example_gpt2():
    """The module docstring's example: ``"Hi there"`` is ``[17250, 612]`` = ``b"Hi"``, ``b" there"``."""
    tok = _rust(GPT2)
    spans = ByteSpans.for_tokenizer(tok)
    ids = np.array([17250, 612, 50256], dtype=np.int32)  # EOS after the text
    assert tok.encode_batch_fast(["Hi there"])[0].ids == [17250, 612]
    labels, straddles = spans.labels(ids, 2, "Hi there", [(2, 8)])
    assert labels.tolist() == [IGNORE_INDEX, 612, IGNORE_INDEX] and straddles == 0
    labels, straddles = spans.labels(ids, 2, "Hi there", [(3, 8)])  # starts inside " there": trained, counted
    assert labels.tolist() == [IGNORE_INDEX, 612, IGNORE_INDEX] and straddles == 1
    labels, straddles = spans.labels(ids, 2, "Hi there", [(0, 1), (5, 5)])  # "H" only; an empty span
    assert labels.tolist() == [17250, IGNORE_INDEX, IGNORE_INDEX] and straddles == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.sampled_from(["gpt2", "smollm2"]),
    text=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=40).map("".join),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_byte_spans_equal_offsets_on_multibyte_text(rust_tokenizers, which, text, cuts):
    tok, byte_spans = rust_tokenizers[which]
    spans_at = sorted(min(c, len(text)) for c in cuts)
    spans = list(zip(spans_at[::2], spans_at[1::2], strict=False))  # may be empty or zero-width
    enc = tok.encode(text, add_special_tokens=False)
    fast = tok.encode_batch_fast([text], add_special_tokens=False)[0]
    assert fast.ids == enc.ids
    ids = np.asarray(enc.ids + [0], dtype=np.int32)  # one trailing token with no text, as EOS
    got = byte_spans.labels(ids, len(enc.ids), text, spans)
    if got is None:  # only where the model dropped a byte it has no token for
        assert which == "smollm2" and any(ch in text for ch in SMOLLM2_DROPS)
        return
    want = span_labels(ids, enc, spans)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]


def test_a_text_with_a_dropped_byte_falls_back_to_offsets(tmp_path):
    """SmolLM2 drops ``\\x04``: the stage notices the ids no longer tile the text and uses offsets."""
    records = [{"instruction": "Say\x04 it", "output": "ok\x04 done \U00040000 é"}, {"instruction": "Q", "output": "A"}]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = make_config([{"path": str(path), "type": "alpaca"}], tokenizer=SMOLLM2)
    fast, fast_counts, tok = _stage_output(cfg, fast=True)
    slow, slow_counts, _ = _stage_output(cfg, fast=False)
    assert tok.byte_spans is not None
    assert tok.with_offsets == 1  # only the record with the dropped bytes; "Q"/"A" stays on the fast path
    assert fast == slow and fast_counts == slow_counts
    labels = fast[0]["labels"][0]
    trained = [t for t, lab in zip(fast[0]["input_ids"][0], labels, strict=True) if lab != IGNORE_INDEX]
    assert "ok" in tok.hf.decode(trained) and "Say" not in tok.hf.decode(trained)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.sampled_from(["gpt2", "smollm2"]),
    samples=st.lists(st.tuples(st.lists(st.sampled_from(ALPHABET), max_size=30).map("".join),
                               st.lists(st.integers(0, 30), max_size=4)), min_size=1, max_size=6),
)
def test_a_batch_labels_each_sample_as_the_offsets_do(rust_tokenizers, which, samples):
    """:meth:`ByteSpans.batch_labels` on several samples at once (one cumulative sum over all of them)
    gives each sample what ``span_labels`` gives it alone, and flags exactly the samples that do not tile."""
    tok, byte_spans = rust_tokenizers[which]
    texts = [text for text, _ in samples]
    spans = []
    for text, cuts in samples:
        at = sorted(min(c, len(text)) for c in cuts)
        spans.append(list(zip(at[::2], at[1::2], strict=False)))
    encs = [tok.encode(text, add_special_tokens=False) for text in texts]
    offsets = np.cumsum([0] + [len(e.ids) for e in encs])
    ids = np.array([i for e in encs for i in e.ids], dtype=np.int32)
    labels, straddles, ok = byte_spans.batch_labels(ids, offsets, texts, spans)
    for k, (text, enc) in enumerate(zip(texts, encs, strict=True)):
        alone = byte_spans.labels(np.asarray(enc.ids, dtype=np.int32), len(enc.ids), text, spans[k])
        assert bool(ok[k]) == (alone is not None)
        if alone is None:
            assert which == "smollm2" and any(ch in text for ch in SMOLLM2_DROPS)
            continue
        want, want_straddles = span_labels(np.asarray(enc.ids, dtype=np.int32), enc, spans[k])
        assert labels[offsets[k] : offsets[k + 1]].tolist() == want.tolist()
        assert straddles[k] == want_straddles


def _mixed_records(kind: str) -> list:
    """Real records of ``kind`` with bad, untrainable and pre-tokenized lines among them (JSONL lines)."""
    if kind == "chat_template":
        good = [json.dumps(r) for r in json.loads(GLAIVE.read_text())[:24]]
        odd = ['{"conversations": [',  # malformed JSON
               json.dumps({"conversations": [{"from": "human", "value": "hi"}]}),  # no assistant turn
               json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " "}]}),
               json.dumps({"input_ids": [31, 32, 33], "labels": [-100, 32, 33]})]
    else:
        good = [json.dumps(r) for r in json.loads(ALPACA.read_text())[:24]]
        odd = ['{"instruction": ', '["not", "an", "object"]', json.dumps({"instruction": "x"}),
               json.dumps({"input_ids": [31, 32, 33], "labels": [-100, 32, 33]})]
    lines = list(good)
    for k, line in enumerate(odd):  # spread over the block: some slices hold several, some none
        lines.insert(3 + 5 * k, line)
    return lines


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "offsets"])
@pytest.mark.parametrize(("kind", "tokenizer"), [("chat_template", SMOLLM2), ("alpaca", GPT2)], ids=["chat", "alpaca"])
def test_pipelined_slices_give_the_rows_and_counters_of_one_call(tmp_path, kind, tokenizer, fast):
    """The stage encodes ``data.tokenize.batch_size`` records at a time on its encode thread while it
    formats and labels the neighbouring slices. Whatever the slice size (1: every record encoded alone;
    3 and 7: slices that end inside runs of bad records; 10_000: the whole block in one call), each row
    and every counter, with its examples in order, is the same."""
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(_mixed_records(kind)) + "\n", encoding="utf-8")
    outputs = []
    for size in (1, 3, 7, 10_000):
        cfg = make_config([{"path": str(path), "type": kind}], tokenizer=tokenizer, on_bad_record="skip",
                          sequence_len=4096, tokenize={"num_actors": 1, "num_cpus": 0.5, "batch_size": size})
        table, sink = resolve_sources(cfg), StatsSink()
        opts = ReadOptions(table.storage, cfg.data.on_bad_record, tuple(d.text_field for d in table.datasets))
        tok = Tokenizer(cfg.data, cfg.model, table, sink)
        if not fast:
            tok.byte_spans = None
        blocks = [tok(b).select(["sample_id", "input_ids", "labels"]).to_pydict() for b in read_files(list(table.files), opts, sink)]
        outputs.append((blocks, dict(sink.local.counters), sink.local.examples))
    blocks, counters, examples = outputs[0]
    rows = [ids for block in blocks for ids in block["input_ids"]]
    assert len(rows) == 28 and sum(1 for ids in rows if ids) == 25  # 24 records and the pre-tokenized one
    assert rows[18] == [31, 32, 33]  # the pre-tokenized line, in its place
    assert counters["skipped_bad_record"] == (2 if kind == "chat_template" else 3)
    assert counters.get("skipped_no_trained_tokens", 0) == (1 if kind == "chat_template" else 0)
    assert counters["samples_pretokenized"] == 1 and len(examples["skipped_bad_record"]) == counters["skipped_bad_record"]
    for other in outputs[1:]:
        assert other == outputs[0]


@pytest.mark.parametrize("size", [1, 3, 10_000])
@pytest.mark.parametrize(("kind", "tokenizer"), [("chat_template", SMOLLM2), ("alpaca", GPT2)], ids=["chat", "alpaca"])
def test_a_stream_of_blocks_gives_each_blocks_own_output_in_order(tmp_path, kind, tokenizer, size):
    """``Tokenizer.stream`` (the read tasks' path) keeps encoding across blocks; it must give exactly what one
    call per block gives: the same tables in the same order, and the same counters with their examples in
    order. Blocks: units of 4 records (slices that run past a block's end), an empty block first, one in the
    middle and one last. The stream reads at most one block with records ahead of the one it hands on."""
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(_mixed_records(kind)) + "\n", encoding="utf-8")
    cfg = make_config([{"path": str(path), "type": kind}], tokenizer=tokenizer, on_bad_record="skip",
                      sequence_len=4096, tokenize={"num_actors": 1, "num_cpus": 0.5, "batch_size": size})
    table = resolve_sources(cfg)
    opts = ReadOptions(table.storage, cfg.data.on_bad_record, tuple(d.text_field for d in table.datasets), unit_size=4)
    blocks = list(read_files(list(table.files), opts, StatsSink()))
    empty = blocks[0].slice(0, 0)
    blocks = [empty, *blocks[:3], empty, *blocks[3:], empty]
    assert len(blocks) == 10

    one_sink, stream_sink = StatsSink(), StatsSink()
    want = [Tokenizer(cfg.data, cfg.model, table, one_sink)(b) for b in blocks]
    pulled, ahead = [], []

    def source():
        for b in blocks:
            pulled.append(b)
            yield b

    got = []
    for out in Tokenizer(cfg.data, cfg.model, table, stream_sink).stream(source()):
        ahead.append(sum(1 for b in pulled[len(got) + 1 :] if b.num_rows))  # read, past the one handed on
        got.append(out)
    assert [g.to_pydict() for g in got] == [w.to_pydict() for w in want]
    assert [w.num_rows for w in want] == [0, 4, 4, 4, 0, 4, 4, 4, 4, 0]
    assert sum(1 for w in want for ids in w.column("input_ids").to_pylist() if ids) == 25
    assert dict(stream_sink.local.counters) == dict(one_sink.local.counters)
    assert stream_sink.local.examples == one_sink.local.examples
    assert one_sink.local.counters["skipped_bad_record"] >= 2 and one_sink.local.counters["samples_pretokenized"] == 1
    assert ahead == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]  # the next block's first slice encodes as one is handed on
