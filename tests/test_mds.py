"""MDS on local disk: shards through build_dataset, our datasink through mosaic's StreamingDataset,
pre-tokenized sets (llm-foundry's layout and convert.py --tokenize), and bad input.

The input sets are written with our shard writer, which writes the bytes mosaic's ``MDSWriter`` writes
(tests/test_mds_codec.py compares them with shards mosaic wrote); mosaic's own ``StreamingDataset`` runs
in a venv of its own (tests/mosaic_venv.py).

Proves: every sample of a set (str, int64, json, ndarray:int32 columns; zstd and no compression;
sha1+xxh64 hashes; dozens of shards) comes out of build_dataset exactly once with the same values; a
nested index reads the same; rows written by MDSDatasink are exactly what StreamingDataset returns;
token columns skip the tokenizer and come out unchanged; a tokenized set is refused under another
tokenizer; each kind of broken set fails with an error naming the dataset and the shard.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from conftest import ALPACA, C4, GPT2, SMOLLM2, load_ray_job, make_config, needs_shared, read_op
from mds_sets import mds_write as write_set
from mds_sets import merge_index, plain_sample, read_ours
from mosaic_venv import mosaic_read

from pipelines.mds.index import MDSError
from pipelines.mds.writer import MDSDatasink
from pipelines.sources.listing import resolve_sources, split_sample_id
from pipelines.sources.read import ReadOptions, read_all_records
from pipelines.stats import StatsSink
from pipelines.storage import StorageOptions
from pipelines.stream.dataset import build_dataset, data_report
from pipelines.stream.stages import all_pretokenized, iter_packed_local
from pipelines.tokenize.stage import IGNORE_INDEX
from pipelines.tokenize.tokenizer import tokenizer_sha256

pytestmark = needs_shared

COLUMNS = {"instruction": "str", "input": "str", "output": "str", "idx": "int64", "meta": "json",
           "ids": "ndarray:int32"}


def _samples(records: list[dict]) -> list[dict]:
    """ALPACA records plus an int64, a json and an ndarray:int32 column derived from the index."""
    return [{**r, "idx": i, "meta": {"n": i, "tags": ["x", i % 3]},
             "ids": (np.arange(i % 5 + 1, dtype=np.int32) + i)} for i, r in enumerate(records)]


def _as_json(sample: dict) -> dict:
    return {**sample, "ids": sample["ids"].tolist()}


def mds_write(out: Path, samples: list[dict], compression: str | None, hashes=("sha1", "xxh64"),
              size_limit: int = 1 << 15, columns: dict = COLUMNS) -> Path:
    return write_set(out, samples, columns, compression, hashes, size_limit)


def _global_index(cfg) -> dict[int, int]:
    """source index -> global sample index of the shard's first sample (shards in index order)."""
    table = resolve_sources(cfg)
    starts, total = {}, 0
    for f in table.files:
        starts[f.source_index] = total
        total += json.loads(f.meta)["shard"]["samples"]
    return starts


def _pieces(row: dict) -> list[tuple[int, list[int], list[int]]]:
    pos = np.asarray(row["position_ids"])
    starts = [*np.flatnonzero(pos == 0).tolist(), len(pos)]
    assert len(starts) - 1 == len(row["sample_ids"])
    return [(sid, row["input_ids"][a:b], row["labels"][a:b])
            for sid, a, b in zip(row["sample_ids"], starts[:-1], starts[1:], strict=True)]


def _read_opts(cfg) -> ReadOptions:
    return ReadOptions(storage=StorageOptions(), on_bad_record="raise", text_fields=("text",) * len(cfg.data.datasets))


@pytest.fixture(scope="module")
def alpaca() -> list[dict]:
    return json.loads(ALPACA.read_text())


@pytest.fixture(scope="module")
def gpt2():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GPT2))


# ----------------------------------------------------------------------------- mosaic -> build_dataset


@pytest.mark.parametrize("compression", ["zstd", None])
def test_mosaic_written_shards_through_build_dataset(ray_local, tmp_path, alpaca, gpt2, compression):
    samples = _samples(alpaca)
    root = mds_write(tmp_path / "mds", samples, compression)
    index = json.loads((root / "index.json").read_text())
    assert len(index["shards"]) >= 24 and index["shards"][0]["hashes"] == ["sha1", "xxh64"]
    cfg = make_config([{"path": str(root), "type": "alpaca"}], sequence_len=2048, read_tasks=2)  # auto: index.json
    starts = _global_index(cfg)

    # The decoded records: every column of every sample, exactly as written (ndarray -> list).
    decoded = {}
    for sid, rec in read_all_records(resolve_sources(cfg), _read_opts(cfg)):
        source, row = split_sample_id(sid)
        decoded[starts[source] + row] = json.loads(rec)
    assert decoded == {i: _as_json(s) for i, s in enumerate(samples)}

    # Through Ray: each sample once, its trained tokens decode to its output.
    ds = build_dataset(cfg)
    seen = Counter()
    for row in ds.take_all():
        for sid, _, labels in _pieces(row):
            source, r = split_sample_id(sid)
            i = starts[source] + r
            seen[i] += 1
            trained = gpt2.decode([t for t in labels[:-1] if t != IGNORE_INDEX], clean_up_tokenization_spaces=False)
            assert trained == alpaca[i]["output"]
    assert sorted(seen) == list(range(len(alpaca))) and set(seen.values()) == {1}
    counters = data_report(ds)["counters"]
    assert counters["records_read"] == counters["samples_tokenized"] == len(alpaca)


def test_nested_index_from_merge_index_and_sample_locations(tmp_path, alpaca):
    samples = _samples(alpaca[:300])
    mds_write(tmp_path / "root" / "a", samples[:120], "zstd", size_limit=1 << 14)
    mds_write(tmp_path / "root" / "b", samples[120:], None, hashes=(), size_limit=1 << 14)
    merge_index(tmp_path / "root")
    index = json.loads((tmp_path / "root" / "index.json").read_text())
    assert {s["raw_data"]["basename"].split("/")[0] for s in index["shards"]} == {"a", "b"}

    cfg = make_config([{"path": str(tmp_path / "root"), "type": "alpaca"}])
    table = resolve_sources(cfg)
    assert all(f.format == "mds" for f in table.files) and len(table.files) == len(index["shards"])
    records = [(sid, json.loads(rec)) for sid, rec in read_all_records(table, _read_opts(cfg))]
    assert [r for _, r in records] == [_as_json(s) for s in samples]  # index order: a's shards, then b's
    sid = records[130][0]  # a has 120 samples: sample 130 is in one of b's shards
    url, row = table.locate(sid)
    assert url.startswith(str(tmp_path / "root" / "b" / "shard.")) and row == 130 - _global_index(cfg)[split_sample_id(sid)[0]]


# ----------------------------------------------------------------------------- datasink -> mosaic


@pytest.mark.slow  # runs mosaic's own reader in its venv (tests/mosaic_venv.py)
def test_datasink_rows_read_back_by_mosaic_streaming_dataset(ray_local, tmp_path, alpaca, mosaic_python):
    rows = [{"idx": i, "text": r["output"], "ids": list(range(i % 9 + 1)), "score": i / 7}
            for i, r in enumerate(alpaca)]
    schema = pa.schema([("idx", pa.int64()), ("text", pa.string()), ("ids", pa.list_(pa.int32())), ("score", pa.float64())])
    ds = ray_local.data.from_arrow(pa.Table.from_pylist(rows, schema=schema)).repartition(3)
    out = tmp_path / "sink"
    sink = MDSDatasink(str(out), hashes=["sha1", "xxh64"], size_limit=1 << 15)
    ds.write_datasink(sink)
    index = json.loads((out / "index.json").read_text())
    assert sink.written == {"rows": len(rows), "shards": len(index["shards"]), "parts": 3}
    first = index["shards"][0]
    assert dict(zip(first["column_names"], first["column_encodings"], strict=True)) == {
        "idx": "int64", "ids": "ndarray:int32", "score": "float64", "text": "str"}
    assert index["shards"][0]["compression"] == "zstd" and len(index["shards"]) > 10

    (got,) = mosaic_read(mosaic_python, [str(out)], validate_hash="sha1").values()
    want = [plain_sample({"idx": np.int64(r["idx"]), "text": r["text"], "ids": np.array(r["ids"], np.int32),
                          "score": np.float64(r["score"])}) for r in rows]
    assert sorted(got, key=lambda g: g["idx"][2]) == want  # the parts hold the rows in another order


# ----------------------------------------------------------------------------- pre-tokenized sets


def _concat_chunks(tok, texts: list[str], length: int) -> list[np.ndarray]:
    """llm-foundry's ConcatTokensDataset: texts + EOS concatenated, cut into ``length``-token samples."""
    backend = tok.backend_tokenizer
    backend.no_truncation()
    buf = [t for e in backend.encode_batch(texts) for t in (*e.ids, tok.eos_token_id)]
    return [np.asarray(buf[k : k + length], dtype=np.int32) for k in range(0, len(buf) - length + 1, length)]


@pytest.mark.parametrize("layout", ["ndarray:int32", "bytes"])
def test_llm_foundry_concat_tokens_skip_the_tokenizer(tmp_path, gpt2, layout):
    texts = [json.loads(line)["text"] for line in C4.read_text().splitlines()[:60]]
    chunks = _concat_chunks(gpt2, texts, 256)
    # ndarray: today's ConcatTokensDataset; bytes: the legacy layout (int64 ids, np.asarray(ids).tobytes()).
    value = (lambda c: c) if layout != "bytes" else (lambda c: c.astype(np.int64).tobytes())
    root = mds_write(tmp_path / "concat", [{"tokens": value(c)} for c in chunks], "zstd",
                        size_limit=1 << 13, columns={"tokens": layout})
    cfg = make_config([{"path": str(root), "type": "completion"}], sequence_len=256, packing="none")
    starts = _global_index(cfg)
    sink = StatsSink()
    got = {}
    for table in iter_packed_local(cfg, sink=sink):
        for row in table.to_pylist():
            source, r = split_sample_id(row["sample_ids"][0])
            got[starts[source] + r] = row
    assert len(got) == len(chunks) > 20
    assert all(got[i]["input_ids"] == c.tolist() == got[i]["labels"] for i, c in enumerate(chunks))
    assert sink.local.counters["samples_pretokenized"] == len(chunks) == sink.local.counters["samples_tokenized"]


def test_pretokenized_sets_pack_inside_the_read_tasks(ray_local, tmp_path, gpt2, monkeypatch):
    """A set that is all token ids needs no tokenizer: the check-and-pack stage runs inside the read
    tasks (no actor pool) and gives exactly the rows of the in-process path; a mixed set does not.
    Its read tasks: no more than run at once (one per CPU), nor than one per ``ID_BYTES_PER_READ_TASK``
    of uncompressed shards."""
    texts = [json.loads(line)["text"] for line in C4.read_text().splitlines()[:80]]
    chunks = _concat_chunks(gpt2, texts, 200)  # 200-token samples: concat packing makes 512-token rows
    root = mds_write(tmp_path / "concat", [{"tokens": c} for c in chunks], "zstd", size_limit=1 << 13,
                        columns={"tokens": "ndarray:int32"})
    import ray

    from pipelines.stream import dataset
    from pipelines.stream.dataset import id_read_tasks
    from pipelines.stream.stages import CheckAndPack

    index = json.loads((root / "index.json").read_text())
    raw = sum(shard["raw_data"]["bytes"] for shard in index["shards"])  # the shards' bytes, uncompressed
    assert raw > 4 * sum(len(c) for c in chunks)  # int32 ids and more: not the zstd files' sizes
    cpus = int(ray.cluster_resources()["CPU"])
    # read_tasks (8: the default), bytes per task -> read tasks
    cases = [(8, dataset.ID_BYTES_PER_READ_TASK, 1),  # ~100 kB of ids: one task, the CPUs notwithstanding
             (2, (raw + 2) // 3, 2),  # 3 tasks' worth of bytes, 2 CPUs (the fixture's): one round of 2
             (8, (raw + 2) // 3, 2)]
    for read_tasks, per_task, n_tasks in cases:
        monkeypatch.setattr(dataset, "ID_BYTES_PER_READ_TASK", per_task)
        cfg = make_config([{"path": str(root), "type": "completion"}], sequence_len=512, packing="concat",
                          read_tasks=read_tasks, deterministic=True)
        table = resolve_sources(cfg)
        files = list(range(len(table.files)))
        assert len(table.files) > 4 and all_pretokenized(table, files)
        assert id_read_tasks(table, files) == (1 if per_task > raw else 3)
        assert id_read_tasks(table, files[:1]) == 1  # only the files given count (a resumed stream's rest)
        want = pa.concat_tables(iter_packed_local(cfg)).select(["input_ids", "labels", "position_ids", "sample_ids"])
        ds = build_dataset(cfg)
        op = read_op(ds)
        assert op.compute.size == cpus == 2 and op.parallelism == n_tasks
        got = pa.concat_tables(ds.iter_batches(batch_size=None, batch_format="pyarrow")).select(want.column_names)
        assert got.num_rows > 20 and got.to_pylist() == want.to_pylist()
        assert sum(len(r) for r in got.column("input_ids").to_pylist()) == sum(len(c) for c in chunks)
        assert op.datasource.stage.stage is CheckAndPack  # checked and packed inside the read tasks
        assert "MapBatches" not in ds.stats()  # one operator, tasks only

    mixed = make_config([{"path": str(root), "type": "completion"}, {"path": str(ALPACA), "type": "alpaca"}])
    mixed_table = resolve_sources(mixed)
    assert not all_pretokenized(mixed_table, list(range(len(mixed_table.files))))


def _labelled_samples(tok, texts: list[str]) -> list[dict]:
    """One sample per text: GPT-2 ids + EOS, the first 8 labels -100 (a prompt), plus one of each bad kind
    (MDS cannot hold an empty ndarray, so no empty sample)."""
    backend = tok.backend_tokenizer
    backend.no_truncation()
    out = []
    for e in backend.encode_batch(texts):
        ids = np.asarray([*e.ids, tok.eos_token_id], np.int32)
        labels = ids.copy()
        labels[:8] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    ids = out[0]["input_ids"]
    out[3] = {"input_ids": np.append(ids, np.int32(60000)), "labels": np.append(ids, np.int32(60000))}  # outside GPT-2
    out[7] = {"input_ids": ids, "labels": ids[:-1]}  # labels one short
    out[11] = {"input_ids": ids, "labels": np.full(len(ids), IGNORE_INDEX, np.int32)}  # nothing trained
    out[19] = {"input_ids": ids, "labels": np.where(ids % 2, ids, -5).astype(np.int32)}  # a negative label
    return out


@pytest.mark.parametrize("packing", ["bfd", "concat"])
def test_id_columns_give_exactly_the_rows_and_counts_of_json_records(tmp_path, gpt2, monkeypatch, packing):
    """A pre-tokenized set is read as Arrow id columns and checked in one vectorised pass; the JSON-record
    path it replaced (still used for mixed sets) must give the same rows, the same counters and the same
    messages for every bad sample, on real text tokenized with GPT-2."""
    import pipelines.stream.stages as stages_mod

    texts = [json.loads(line)["text"] for line in C4.read_text().splitlines()[:120]]
    root = mds_write(tmp_path / "labelled", _labelled_samples(gpt2, texts), "zstd", size_limit=1 << 14,
                        columns={"input_ids": "ndarray:int32", "labels": "ndarray:int32"})
    cfg = make_config([{"path": str(root)}], sequence_len=512, packing=packing, on_bad_record="skip",
                      pack_buffer_size=40)

    def run() -> tuple[list[dict], dict]:
        sink = StatsSink()
        rows = pa.concat_tables(iter_packed_local(cfg, sink=sink)).to_pylist()
        return rows, sink.local

    from pipelines.tokenize.pretokenized import IdChecker

    checked = []
    check = IdChecker.__call__
    monkeypatch.setattr(IdChecker, "__call__", lambda self, batch: checked.append(
        len(pa.compute.list_flatten(batch.column("sample_id")))) or check(self, batch))
    rows, counts = run()
    assert sum(checked) == len(texts)  # every sample went through the id path
    with monkeypatch.context() as m:  # force the JSON-record path
        m.setattr(stages_mod, "all_pretokenized", lambda table, files: False)
        want_rows, want_counts = run()
    assert len(rows) > 20 and rows == want_rows
    assert counts.counters == want_counts.counters and counts.examples == want_counts.examples
    c = counts.counters
    assert c["skipped_bad_record"] == 3 and c["skipped_no_trained_tokens"] == 1
    assert c["samples_pretokenized"] == c["samples_tokenized"] == len(texts) - 4
    assert (packing == "concat") == ("truncated_samples" not in c)  # long C4 documents: bfd truncates at 512
    messages = " | ".join(counts.examples["skipped_bad_record"])
    for bad in (": token id 60000 is outside the vocabulary", ": labels has", ": token id -5 is outside the vocabulary"):
        assert bad in messages and ".mds.zstd row " in messages, messages
    trained = [t for r in rows for t in r["labels"] if t != IGNORE_INDEX]
    assert 0 < len(trained) < sum(len(r["input_ids"]) for r in rows)  # the -100 prompts survived


def test_a_resumed_stream_reads_as_its_epoch_did(tmp_path, gpt2, monkeypatch):
    """Id-column units count id bytes, JSON units record text, so which way a stream is read must come
    from its whole epoch: resumed past its last JSONL file, a mixed stream still cuts its MDS units as
    JSON records, and gives exactly the rows the unbroken stream gave from there on."""
    import pipelines.sources.read as read_mod
    from pipelines.stream.units import ResumePoint, file_positions, ordered_files

    texts = [json.loads(line)["text"] for line in C4.read_text().splitlines()[:80]]
    root = mds_write(tmp_path / "concat", [{"tokens": c} for c in _concat_chunks(gpt2, texts, 200)], "zstd",
                        size_limit=1 << 14, columns={"tokens": "ndarray:int32"})
    monkeypatch.setattr(read_mod, "MAX_UNIT_BYTES", 8000)  # units cut by size: 8 JSON records or 5 id records
    for seed in range(50):  # a read order with the JSONL file early, so a resume can start past it
        cfg = make_config([{"path": str(ALPACA), "type": "alpaca"}, {"path": str(root)}], sequence_len=512,
                          shuffle_seed=seed)
        table = resolve_sources(cfg)
        order = ordered_files(table, cfg.data.shuffle_seed, 0)
        k = 1 + max(pos for pos, i in enumerate(order) if table.files[i].format != "mds")
        if k < len(order) - 2:
            break
    assert not all_pretokenized(table, order) and all_pretokenized(table, order[k:])
    pos_of = file_positions(table, cfg.data.shuffle_seed, 0)
    keys = ["input_ids", "labels", "sample_ids", "unit_id", "unit_row", "unit_rows"]
    full = pa.concat_tables(iter_packed_local(cfg)).select(keys).to_pylist()
    want = [r for r in full if pos_of[split_sample_id(r["unit_id"])[0]] >= k]
    got = pa.concat_tables(iter_packed_local(cfg, start=ResumePoint(0, k, 0, -1, 0))).select(keys).to_pylist()
    assert len(want) > 10 and got == want


def test_ids_that_are_not_token_ids_are_reported_by_the_id_reader(tmp_path):
    """Float ids or ids beyond int32 are not cast quietly: the sample is named, skipped and counted."""
    root = mds_write(tmp_path / "odd", [{"input_ids": np.array([1.0, 2.5])}, {"input_ids": np.array([5, 2**40])},
                                           {"input_ids": np.array([7, 8])}], None,
                        columns={"input_ids": "ndarray"})
    cfg = make_config([{"path": str(root)}], sequence_len=64, on_bad_record="skip", packing="none")
    sink = StatsSink()
    rows = pa.concat_tables(iter_packed_local(cfg, sink=sink)).to_pylist()
    assert [r["input_ids"] for r in rows] == [[7, 8]]
    assert sink.local.counters["skipped_bad_bytes"] == 2
    first, second = sink.local.examples["skipped_bad_bytes"]
    assert "shard.00000.mds row 0: cannot decode the sample" in first and "float64" in first
    assert "row 1: cannot decode the sample" in second and "token id 1099511627776" in second
    strict = make_config([{"path": str(root)}], sequence_len=64, packing="none")
    with pytest.raises(Exception, match=r"row 0: cannot decode the sample: column 'input_ids' should be a flat list"):
        list(iter_packed_local(strict))


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    root = mds_write(tmp_path / "bad", [{"input_ids": np.array([1, 2, 60000], np.int32)}], None,
                        columns={"input_ids": "ndarray:int32"})
    cfg = make_config([{"path": str(root)}], sequence_len=64)
    with pytest.raises(Exception, match=r"shard.00000.mds row 0: token id 60000 is outside the vocabulary"):
        list(iter_packed_local(cfg))


def _write_config(path: Path, data_path: Path, tokenizer: Path, **data) -> Path:
    cfg = {"model": {"tokenizer": str(tokenizer)},
           "data": {"datasets": [{"path": str(data_path), "type": "alpaca"}], "sequence_len": 2048,
                    "tokenize": {"num_actors": 1, "num_cpus": 0.5}, **data}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _summary(stdout: str) -> dict:
    """convert.py's JSON summary: its one line of stdout that is a JSON object. Ray's driver log lines
    (e.g. the raylet's "N PYTHON worker processes have been started" warning) can come before it."""
    found = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(found) == 1, stdout
    return json.loads(found[0])


def test_convert_tokenize_once_then_train_from_it(ray_local, tmp_path, alpaca, capsys):
    convert = load_ray_job("convert")
    config = _write_config(tmp_path / "gpt2.yaml", ALPACA, GPT2)
    out = tmp_path / "alpaca-gpt2"
    assert convert.main(["--tokenize", "--config", str(config), "--output", str(out), "--size-limit", "128kb",
                         "--write-tasks", "2"]) == 0
    summary = _summary(capsys.readouterr().out)
    assert summary["rows"] == len(alpaca) and summary["shards"] >= 4
    meta = json.loads((out / "tokenized.json").read_text())
    from transformers import AutoTokenizer

    assert meta["tokenizer"] == {"name": str(GPT2), "sha256": tokenizer_sha256(AutoTokenizer.from_pretrained(str(GPT2))),
                                 "vocab_size": 50257}
    assert meta["sources"] == [str(ALPACA)] and meta["sequence_len"] == 2048
    assert meta["template"]["datasets"][0]["type"] == "alpaca"

    # The converted set trains exactly like the source: same ids and labels per source sample.
    direct = make_config([{"path": str(ALPACA), "type": "alpaca"}], sequence_len=2048, packing="none")
    expected = {r["sample_ids"][0]: (r["input_ids"], r["labels"]) for r in build_dataset(direct).take_all()}
    cfg = make_config([{"path": str(out), "format": "mds"}], sequence_len=2048, packing="none", read_tasks=2)
    source_of = {sid: json.loads(rec)["source_sample_id"] for sid, rec in read_all_records(resolve_sources(cfg), _read_opts(cfg))}
    ds = build_dataset(cfg)
    got = {source_of[r["sample_ids"][0]]: (r["input_ids"], r["labels"]) for r in ds.take_all()}
    assert got == expected and len(got) == len(alpaca)
    counters = data_report(ds)["counters"]
    assert counters["samples_pretokenized"] == len(alpaca)

    # Another tokenizer: refused at build time, naming both.
    other = make_config([{"path": str(out), "format": "mds"}], tokenizer=SMOLLM2)
    with pytest.raises(MDSError, match=r"tokenized with tokenizer '.*gpt2'.*model.tokenizer is '.*smollm2-135m-instruct'"):
        build_dataset(other)


def test_convert_streams_into_parts_of_whole_shards_in_source_order(ray_local, tmp_path, alpaca, capsys, monkeypatch):
    """Blocks of READ_BLOCK_BYTES flow from the tokenizer to the writes as they are made; each write
    task takes at least ``rows_per_part`` rows, and the parts keep the source order."""
    import pipelines.stream.units

    convert = load_ray_job("convert")
    # Small blocks, so the 999 Alpaca records make many (the tokenizer's output is cut at this size).
    monkeypatch.setattr(pipelines.stream.units, "READ_BLOCK_BYTES", 64 << 10)
    config = _write_config(tmp_path / "gpt2.yaml", ALPACA, GPT2)
    out = tmp_path / "parts"
    assert convert.main(["--tokenize", "--config", str(config), "--output", str(out), "--size-limit", "16kb",
                         "--write-tasks", "2"]) == 0
    summary = _summary(capsys.readouterr().out)
    cfg = make_config([{"path": str(ALPACA), "type": "alpaca"}])
    records = [rec for _, rec in read_all_records(resolve_sources(cfg), _read_opts(cfg))]  # what convert samples
    floor = convert.rows_per_part(records, 16 << 10)
    assert 30 < floor < 50  # 2 x 16 kB / ~0.8 kB a record
    shards = json.loads((out / "index.json").read_text())["shards"]
    per_part = Counter(s["raw_data"]["basename"].split("/")[0] for s in shards)
    rows = {part: sum(s["samples"] for s in shards if s["raw_data"]["basename"].startswith(part + "/"))
            for part in per_part}
    parts = sorted(rows)
    assert summary["parts"] == len(parts) >= 5, rows  # not one part per read task: the writes streamed
    assert all(rows[p] >= floor for p in parts[:-1]), rows  # no part of a lone small block
    assert sum(rows.values()) == len(alpaca)
    # In the index order (part by part), the rows are the source records in order.
    ids = [s["source_sample_id"] for s in read_ours(out)]
    assert [split_sample_id(i)[1] for i in ids] == list(range(len(alpaca)))


def test_convert_of_many_files_tokenizes_and_writes_in_each_read_task(ray_local, tmp_path, alpaca, capsys,
                                                                     monkeypatch):
    """At least as many files as tasks: each task reads its group of files, tokenizes it and writes one part
    (mosaic's Pool conversion), and the set holds what the streamed conversion (tokenizer actors) writes."""
    import ray.data

    convert = load_ray_job("convert")
    # Blocks of 16 kB: a write that ran apart from the reads would take them one by one, a part each.
    monkeypatch.setattr(ray.data.DataContext.get_current(), "target_max_block_size", 16 << 10)
    src = tmp_path / "alpaca"
    src.mkdir()
    for i in range(4):  # 250, 250, 250, 249 records
        (src / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca[i * 250:(i + 1) * 250]))
    config = _write_config(tmp_path / "gpt2.yaml", src, GPT2)

    def run(out: Path, *overrides: str) -> tuple[dict, list[dict]]:
        assert convert.main(["--tokenize", "--config", str(config), "--output", str(out), "--size-limit", "64kb",
                             "--write-tasks", "2", *overrides]) == 0
        return _summary(capsys.readouterr().out), read_ours(out)

    summary, rows = run(tmp_path / "in-tasks")
    shards = json.loads((tmp_path / "in-tasks" / "index.json").read_text())["shards"]
    files_of = {}
    for shard, start in zip(shards, np.cumsum([0] + [s["samples"] for s in shards]), strict=False):
        part = shard["raw_data"]["basename"].split("/")[0]
        files_of.setdefault(part, set()).update(split_sample_id(r["source_sample_id"])[0]
                                                for r in rows[start:start + shard["samples"]])
    # one part per task, each of a group of whole files (similar in bytes), in the source order
    assert summary["parts"] == 2 and sorted(files_of) == ["part-00000", "part-00001"], files_of
    first, second = files_of["part-00000"], files_of["part-00001"]
    assert first and second and max(first) < min(second) and first | second == {0, 1, 2, 3}, files_of
    assert [split_sample_id(r["source_sample_id"]) for r in rows] == [(i // 250, i % 250) for i in range(len(alpaca))]

    streamed_summary, streamed = run(tmp_path / "streamed", "data.tokenize.placement=actors")
    assert streamed_summary["rows"] == summary["rows"] == len(alpaca)
    assert [(r["source_sample_id"], r["input_ids"].tolist(), r["labels"].tolist()) for r in rows] == \
        [(r["source_sample_id"], r["input_ids"].tolist(), r["labels"].tolist()) for r in streamed]


@pytest.mark.slow  # runs mosaic's own reader in its venv (tests/mosaic_venv.py)
def test_convert_raw_keeps_columns_and_order(ray_local, tmp_path, alpaca, capsys, mosaic_python):
    convert = load_ray_job("convert")

    out = tmp_path / "raw"
    assert convert.main(["--input", str(ALPACA), "--output", str(out), "--size-limit", "64kb", "--hashes", "sha1"]) == 0
    summary = _summary(capsys.readouterr().out)
    assert summary["columns"] == {"instruction": "str", "input": "str", "output": "str"}
    (got,) = mosaic_read(mosaic_python, [str(out)], validate_hash="sha1").values()
    assert got == [plain_sample(r) for r in alpaca]

    # A column the first records did not have: a clear error naming file and line, nothing half-written.
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "a"}] * 3 + [{"text": "b", "extra": 1}]))
    assert convert.main(["--input", str(jsonl), "--output", str(tmp_path / "mixed"), "--sample-records", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{jsonl} line 4" in err and "--columns extra=json" in err
    assert not (tmp_path / "mixed" / "index.json").exists()


# ----------------------------------------------------------------------------- bad input


@pytest.fixture()
def small_set(tmp_path, alpaca) -> Path:
    return mds_write(tmp_path / "ds", _samples(alpaca[:200]), "zstd", hashes=("xxh64",), size_limit=1 << 14)


def _shard(root: Path, k: int = 1) -> str:
    return json.loads((root / "index.json").read_text())["shards"][k]["zip_data"]["basename"]


def _edit_index(root: Path, fn) -> None:
    index = json.loads((root / "index.json").read_text())
    fn(index)
    (root / "index.json").write_text(json.dumps(index))


def _break(root: Path, case: str) -> str:
    """Damage the set as ``case`` says; returns what the error must name: the damaged shard, or the index."""
    name = _shard(root)
    path = root / name
    if case == "missing_index":
        (root / "index.json").unlink()
        return f"no index.json in {root} "
    if case == "index_not_mds":
        (root / "index.json").write_text(json.dumps({"version": 2, "files": ["shard.00000.mds"]}))
        return f"{root}/index.json"
    if case == "index_not_json":
        (root / "index.json").write_text("<html>not json</html>")
        return f"{root}/index.json"
    if case == "shard_missing":
        path.unlink()
    elif case == "hash_mismatch":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif case == "corrupt_no_hash":
        data = bytearray(path.read_bytes())
        data[8:40] = b"\x00" * 32
        path.write_bytes(bytes(data))
        _edit_index(root, lambda ix: [s["zip_data"].update(hashes={}) for s in ix["shards"]])
    elif case == "unknown_encoding":
        _edit_index(root, lambda ix: ix["shards"][1].update(column_encodings=["bogus:enc", *ix["shards"][1]["column_encodings"][1:]]))
    return name


BAD = {
    "missing_index": "no index.json in",
    "index_not_mds": "is not an MDS index",
    "index_not_json": "is not valid JSON",
    "shard_missing": "listed in index.json but missing",
    "hash_mismatch": "xxh64 hash mismatch",
    "truncated": "bytes but index.json says",
    "corrupt_no_hash": "cannot decompress (zstd)",
    "unknown_encoding": "has unknown MDS encoding 'bogus:enc'",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_broken_set_fails_naming_dataset_and_shard(small_set, case):
    where = _break(small_set, case)
    assert where and (where.startswith("no index.json") or where.endswith(("index.json", ".mds", ".zstd"))), where
    cfg = make_config([{"path": str(small_set), "format": "mds", "type": "alpaca"}], on_bad_record="skip")
    with pytest.raises(MDSError) as err:
        list(iter_packed_local(cfg))
    msg = str(err.value)
    assert BAD[case] in msg and f"MDS dataset {small_set}" in msg
    assert where in msg, f"the error should name {where!r}: {msg}"


def test_intact_set_reads_after_a_failed_copy(small_set, tmp_path):
    """The control for the cases above: the same set, undamaged, reads every sample."""
    copy = tmp_path / "copy"
    shutil.copytree(small_set, copy)
    cfg = make_config([{"path": str(copy), "format": "mds", "type": "alpaca"}])
    sink = StatsSink()
    n = sum(len(r["sample_ids"]) for t in iter_packed_local(cfg, sink=sink) for r in t.to_pylist())
    assert n == 200 == sink.local.counters["records_read"]
