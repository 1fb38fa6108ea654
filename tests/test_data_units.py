"""Unit tests of the data stages without Ray: packing, formats, tokenization, ids, config."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from conftest import GPT2, SMOLLM2, make_config, needs_shared, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.config import ConfigError, config_from_dict
from pipelines.sources.datasource import group_files
from pipelines.sources.formats import ALPACA_PROMPT_NO_INPUT, Formatted, make_formatter
from pipelines.sources.listing import SourceFile, make_sample_id, resolve_sources, split_sample_id
from pipelines.sources.read import ReadOptions, in_eval_split, read_files
from pipelines.stats import Counts, StatsSink
from pipelines.stream.packing import PackOptions, Samples, best_fit_decreasing, concat_rows, pack_samples
from pipelines.tokenize.stage import IGNORE_INDEX, Tokenizer

# ----------------------------------------------------------------------------- packing


def test_bfd_worked_example():
    bins = best_fit_decreasing([6, 5, 4, 3, 2], 10)
    assert sorted(sorted(b) for b in bins) == [[0, 2], [1, 3, 4]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=0, max_size=300), st.integers(64, 200))
def test_bfd_places_every_item_once_within_capacity(lengths, capacity):
    bins = best_fit_decreasing(lengths, capacity)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # Best fit never leaves two bins that could be merged: at most one bin is at most half full.
    assert sum(1 for b in bins if sum(lengths[i] for i in b) <= capacity / 2) <= 1


def _samples(lengths: list[int]) -> Samples:
    ids = [np.arange(1, n + 1, dtype=np.int32) + 100 * k for k, n in enumerate(lengths)]
    return Samples(np.arange(len(lengths), dtype=np.int64), ids, [x.copy() for x in ids])


def test_concat_worked_example_positions_and_samples():
    s = Samples(
        np.array([10, 11], dtype=np.int64),
        [np.array([1, 2, 3], np.int32), np.array([4, 5, 6, 7, 8], np.int32)],
        [np.array([1, 2, 3], np.int32), np.array([4, 5, 6, 7, 8], np.int32)],
    )
    counts = Counts()
    rows = concat_rows(s, 4, counts)
    assert [r.tolist() for r in rows.ids] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [p.tolist() for p in rows.positions] == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert [x.tolist() for x in rows.sample_ids] == [[10, 11], [11]]
    assert not counts  # no partial row


def test_concat_keeps_every_token_and_counts_the_remainder():
    s = _samples([7, 3, 9, 1])
    counts = Counts()
    rows = concat_rows(s, 5, counts)
    assert np.concatenate(rows.ids).tolist() == np.concatenate(s.ids).tolist()
    assert [len(r) for r in rows.ids] == [5, 5, 5, 5]
    s2 = _samples([7, 3])
    rows2 = concat_rows(s2, 4, counts)
    assert [len(r) for r in rows2.ids] == [4, 4, 2]
    assert counts.counters["concat_partial_rows"] == 1 and counts.counters["concat_partial_tokens"] == 2


def _concat_by_hand(s: Samples, seq_len: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """concat packing token by token: the definition the vectorised code must match."""
    stream = [(int(t), k, i) for k, doc in enumerate(s.ids) for i, t in enumerate(doc.tolist())]
    ids, pos, sids = [], [], []
    for r0 in range(0, len(stream), seq_len):
        row = stream[r0 : r0 + seq_len]
        ids.append([t for t, _, _ in row])
        # a position counts from the document's first token or from the row's, whichever is later
        pos.append([min(i, j) for j, (_, _, i) in enumerate(row)])
        sids.append([int(s.sample_ids[k]) for k in dict.fromkeys(k for _, k, _ in row)])
    return ids, pos, sids


@pytest.mark.parametrize("seed", range(6))
def test_concat_matches_token_by_token_packing(seed):
    """Random document lengths, empty documents among them, rows cut inside and at document borders."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, size=int(rng.integers(1, 30))).tolist()
    lengths[int(rng.integers(len(lengths)))] = 0
    s = _samples(lengths)
    s = Samples(s.sample_ids * 7 + 3, s.ids, s.labels)
    seq_len = int(rng.choice([1, 4, 16, 33, 64]))
    counts = Counts()
    rows = concat_rows(s, seq_len, counts)
    want_ids, want_pos, want_sids = _concat_by_hand(s, seq_len)
    assert sum(lengths) > 0 and len(want_ids) == len(rows.ids)
    assert [r.tolist() for r in rows.ids] == want_ids
    assert [r.tolist() for r in rows.labels] == want_ids
    assert [p.tolist() for p in rows.positions] == want_pos
    assert [x.tolist() for x in rows.sample_ids] == want_sids
    assert counts.counters.get("concat_partial_tokens", 0) == sum(lengths) % seq_len


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_oversize_policy_is_counted(policy):
    s = _samples([3, 12, 4])
    counts = Counts()
    rows = pack_samples(s, PackOptions("bfd", 8, policy), counts)
    lengths = sorted(len(r) for r in rows.ids)
    if policy == "truncate":
        assert counts.counters["truncated_samples"] == 1 and counts.counters["truncated_tokens"] == 4
        assert sorted(int(i) for r in rows.sample_ids for i in r) == [0, 1, 2]
        assert lengths == [7, 8]
    else:
        assert counts.counters["dropped_oversize"] == 1
        assert sorted(int(i) for r in rows.sample_ids for i in r) == [0, 2]
        assert lengths == [7]


def test_positions_restart_per_sample_in_bfd_rows():
    rows = pack_samples(_samples([2, 3, 4]), PackOptions("bfd", 10), Counts())
    assert len(rows.ids) == 1
    assert rows.positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1]  # longest first: 4, 3, 2


# ----------------------------------------------------------------------------- ids and reads


def test_sample_id_round_trip():
    sid = make_sample_id(1, 7)
    assert sid == (1 << 40) | 7 and split_sample_id(sid) == (1, 7)


def test_group_files_keeps_order_and_balances():
    files = [SourceFile(i, 0, f"f{i}", f"f{i}", "jsonl", size) for i, size in enumerate([5, 1, 1, 1, 4])]
    groups = group_files(files, 2)
    assert [[f.path for f in g] for g in groups] == [["f0", "f1"], ["f2", "f3", "f4"]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.integers(1, 50))
def test_group_files_gives_exactly_the_requested_groups(sizes, parallelism):
    """Fewer read tasks than requested makes Ray split read blocks, which would cut units in two."""
    files = [SourceFile(i, 0, f"f{i}", f"f{i}", "jsonl", size) for i, size in enumerate(sizes)]
    groups = group_files(files, parallelism)
    assert len(groups) == min(parallelism, len(files)) and all(groups)
    assert [f for g in groups for f in g] == files


def test_eval_split_is_deterministic_and_sized():
    ids = np.arange(20000, dtype=np.int64)
    held = in_eval_split(ids, 0.1)
    assert np.array_equal(held, in_eval_split(ids, 0.1))
    assert 0.09 < held.mean() < 0.11


def test_paths_resolve_relative_to_the_config_file(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "data" / "b.jsonl", [{"text": "y"}])
    (tmp_path / "c.yaml").write_text(
        f"model: {{tokenizer: {GPT2}}}\ndata:\n  datasets:\n    - {{path: 'data/*.jsonl', type: completion}}\n"
    )
    from pipelines.config import load_config

    cfg = load_config(tmp_path / "c.yaml")
    table = resolve_sources(cfg)
    assert [f.path.rsplit("/", 1)[1] for f in table.files] == ["a.jsonl", "b.jsonl"]
    assert table.locate(make_sample_id(1, 0)) == (str(tmp_path / "data" / "b.jsonl"), 0)


def test_config_errors_name_key_and_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {tokenizer: x}\ndata:\n  sequence_len: -3\n  datasets: [{path: a.jsonl, typo: 1}]\n")
    from pipelines.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(bad)
    msg = str(err.value)
    assert str(bad) in msg and "data.sequence_len" in msg and "data.datasets.0.typo: unknown key" in msg


def test_overrides_apply_with_yaml_types():
    from pipelines.config import apply_overrides

    raw = {"model": {"tokenizer": "t"}, "data": {"datasets": [{"path": "a"}]}}
    out = apply_overrides(raw, ["data.sequence_len=512", "data.datasets.0.path=b", "data.train_on_inputs=true"])
    cfg = config_from_dict(out)
    assert cfg.data.sequence_len == 512 and cfg.data.datasets[0].path == "b" and cfg.data.train_on_inputs is True


# ----------------------------------------------------------------------------- formats + tokenization


def _tokenize(cfg, records_path=None):
    """Run read + tokenize for a config in-process; returns (tokenizer, tables, sink)."""
    table = resolve_sources(cfg)
    sink = StatsSink()
    opts = ReadOptions(table.storage, cfg.data.on_bad_record, tuple(d.text_field for d in table.datasets))
    tok = Tokenizer(cfg.data, cfg.model, table, sink)
    return tok, [tok(b) for b in read_files(list(table.files), opts, sink)], sink


@needs_shared
def test_alpaca_labels_cover_exactly_the_output(tmp_path):
    recs = [{"instruction": "Add 2 and 3.", "input": "", "output": "The answer is 5."},
            {"instruction": "Translate", "input": "Bonjour", "output": "Hello"}]
    cfg = make_config([{"path": str(write_jsonl(tmp_path / "a.jsonl", recs)), "type": "alpaca"}])
    tok, tables, _ = _tokenize(cfg)
    out = tables[0]
    for rec, ids, labels in zip(recs, out["input_ids"].to_pylist(), out["labels"].to_pylist(), strict=True):
        trained = [t for t in labels if t != IGNORE_INDEX]
        assert trained[-1] == tok.eos and ids[-1] == tok.eos
        assert tok.hf.decode(trained[:-1], clean_up_tokenization_spaces=False) == rec["output"]
        prompt = tok.hf.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])
        assert "### Instruction:" in prompt and "### Response:" in prompt
    assert ALPACA_PROMPT_NO_INPUT.format(instruction="Add 2 and 3.") in tok.hf.decode(out["input_ids"].to_pylist()[0])


@needs_shared
def test_train_on_inputs_trains_everything(tmp_path):
    recs = [{"instruction": "Say hi", "output": "hi"}]
    cfg = make_config([{"path": str(write_jsonl(tmp_path / "a.jsonl", recs)), "type": "alpaca"}], train_on_inputs=True)
    _, tables, _ = _tokenize(cfg)
    assert IGNORE_INDEX not in tables[0]["labels"].to_pylist()[0]


@needs_shared
def test_chatml_masks_only_assistant_turns_openai_and_sharegpt(tmp_path):
    convs = [
        {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello there."},
                      {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a color"},
                           {"from": "gpt", "value": "Blue"}]},
    ]
    cfg = make_config([{"path": str(write_jsonl(tmp_path / "c.jsonl", convs)), "type": "chat_template"}], tokenizer=SMOLLM2)
    tok, tables, _ = _tokenize(cfg)
    labels = tables[0]["labels"].to_pylist()
    dec = [tok.hf.decode([t for t in lab if t != IGNORE_INDEX]) for lab in labels]
    assert dec == ["Hello there.<|im_end|>4<|im_end|>", "Blue<|im_end|>"]
    full = tok.hf.decode(tables[0]["input_ids"].to_pylist()[1])
    assert full.startswith("<|im_start|>system\nBe brief.<|im_end|>")


@needs_shared
def test_which_turns_train_last_only_or_per_message(tmp_path):
    conv = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"},
            {"role": "user", "content": "Q3"}, {"role": "assistant", "content": "A3"}]
    flagged = [dict(conv[0]), {**conv[1], "train": False}, dict(conv[2]), {**conv[3], "weight": 1}]

    def trained(records, **ds):
        path = write_jsonl(tmp_path / f"c{len(list(tmp_path.iterdir()))}.jsonl", records)
        cfg = make_config([{"path": str(path), "type": "chat_template", **ds}], tokenizer=SMOLLM2)
        tok, tables, sink = _tokenize(cfg)
        rows = tables[0]["labels"].to_pylist()
        return [tok.hf.decode([t for t in lab if t != IGNORE_INDEX]) for lab in rows], sink.local.counters

    assert trained([{"messages": conv}])[0] == ["A1<|im_end|>A2<|im_end|>A3<|im_end|>"]
    got, counters = trained([{"messages": conv}], train_turns="last")
    assert got == ["A3<|im_end|>"] and counters["chat_turns_untrained"] == 2 and counters["chat_turns_trained"] == 1
    assert trained([{"messages": flagged}])[0] == ["A2<|im_end|>"]  # the message's own flag wins
    assert trained([{"messages": flagged}], train_turns="last")[0] == ["A2<|im_end|>"]
    with pytest.raises(ConfigError, match=r"train_turns apply to type chat_template only \(this dataset is alpaca\)"):
        make_config([{"path": "x.jsonl", "type": "alpaca", "train_turns": "last"}])
    alpaca = make_config([{"path": "x.jsonl", "type": "alpaca"}])  # a dumped config, every key in it, loads again
    assert config_from_dict(alpaca.model_dump(mode="json")) == alpaca
    with pytest.raises(ConfigError, match="roles_to_train was removed.*train_turns"):
        make_config([{"path": "x.jsonl", "type": "chat_template", "roles_to_train": ["user", "assistant"]}])


@needs_shared
def test_input_output_segments(tmp_path):
    recs = [{"segments": [{"text": "Q: capital of France?\nA:", "label": False}, {"text": " Paris", "label": True}]}]
    cfg = make_config([{"path": str(write_jsonl(tmp_path / "s.jsonl", recs)), "type": "input_output"}])
    tok, tables, _ = _tokenize(cfg)
    labels = tables[0]["labels"].to_pylist()[0]
    assert tok.hf.decode([t for t in labels if t != IGNORE_INDEX]) == " Paris"


@needs_shared
def test_tokenizer_file_truncation_setting_is_ignored(tmp_path):
    """The upstream GPT-2 tokenizer.json truncates at 50 tokens; samples must not be cut silently."""
    tokdir = tmp_path / "tok"
    tokdir.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (tokdir / name).write_bytes((GPT2 / name).read_bytes())
    (tokdir / "tokenizer.json").write_bytes((GPT2 / "tokenizer.upstream-truncation50.json").read_bytes())
    assert json.loads((tokdir / "tokenizer.json").read_text())["truncation"]["max_length"] == 50
    text = " ".join(["word"] * 200)
    cfg = make_config([{"path": str(write_jsonl(tmp_path / "t.jsonl", [{"text": text}])), "type": "completion"}],
                      tokenizer=tokdir)
    _, tables, _ = _tokenize(cfg)
    assert len(tables[0]["input_ids"].to_pylist()[0]) == 201  # 200 words + EOS


@needs_shared
def test_formatter_output_shape():
    cfg = make_config([{"path": "unused.jsonl", "type": "completion"}])
    f = make_formatter(cfg.data.datasets[0], cfg.data, tokenizer=None)({"text": "abc"})
    assert f == Formatted("abc", [(0, 3)], add_eos=True)


def _unit_batch(unit_id: int, rows: list[list[int]], skip: int = 0) -> pa.Table:
    n = len(rows)
    return pa.table({
        "sample_id": pa.array(range(unit_id, unit_id + n), pa.int64()),
        "input_ids": pa.array(rows, pa.list_(pa.int32())),
        "labels": pa.array(rows, pa.list_(pa.int32())),
        "unit_id": pa.array([unit_id] * n, pa.int64()),
        "unit_start_byte": pa.array([0] * n, pa.int64()),
        "unit_end_row": pa.array([unit_id + n] * n, pa.int64()),
        "unit_end_byte": pa.array([-1] * n, pa.int64()),
        "unit_records": pa.array([n] * n, pa.int32()),
        "unit_skip": pa.array([skip] * n, pa.int32()),
    })


def test_packer_packs_each_unit_alone_and_skips_resumed_rows():
    from pipelines.stream.packing import PACKED_SCHEMA, Packer

    sink = StatsSink()
    packer = Packer(PackOptions("bfd", 4), sink)
    # Two units in one batch: samples of different units never share a row.
    batch = pa.concat_tables([_unit_batch(0, [[1, 2], [3]]), _unit_batch(100, [[5], [6, 7, 8]])])
    out = packer(batch)
    assert out.schema == PACKED_SCHEMA and out.num_rows == 2
    rows = out.to_pylist()
    assert sorted(tuple(r["sample_ids"]) for r in rows) == [(0, 1), (101, 100)]
    assert all(r["unit_rows"] == 1 and r["unit_row"] == 0 for r in rows)
    assert sink.local.counters["row_tokens"] == 7 and sink.local.counters["row_capacity"] == 8
    # Resuming a unit drops the rows already trained on; the rest are the same rows as before.
    unit = _unit_batch(0, [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]])
    full = Packer(PackOptions("bfd", 4), StatsSink())(unit).to_pylist()
    resumed = Packer(PackOptions("bfd", 4), StatsSink())(_unit_batch(0, [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]], skip=2)).to_pylist()
    assert len(full) == 3 and resumed == full[2:]
    assert [r["unit_row"] for r in resumed] == [2] and full[0]["unit_rows"] == 3


def test_packer_refuses_a_split_unit():
    from pipelines.stream.packing import Packer

    half = _unit_batch(0, [[1], [2], [3], [4]]).slice(0, 2)
    with pytest.raises(RuntimeError, match="arrived split"):
        Packer(PackOptions("bfd", 4), StatsSink())(half)
