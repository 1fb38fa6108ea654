"""Units leave read tasks one by one, atomically, and the stream is the same rows as the local path.

Before issue 10, Ray Data's read operator buffered a read task's unit blocks up to 128 MB, so a task's
units left it together when the task ended; now each unit is one row of its own block and the
dataset's target block size is 4 MB, so the read operator produces one block per unit of 4 MB or more.
The stream's small first unit has a read task of its own, so its block leaves at once too.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest
from conftest import LIMA, make_config, needs_shared, read_op, write_jsonl

from pipelines.sources.read import read_files
from pipelines.stats import StatsSink
from pipelines.stream.units import FIRST_UNIT_BYTES, explode_units

COPIES, PACK = 5, 2000


def _cfg(tmp_path, placement: str = "auto"):
    # LIMA 5 times over: 5,145 real records of ~2.9 kB. 2,000-record units are ~5.8 MB, over the 4 MB
    # block target; the first unit ends at 256 kB of records (~90), the last holds the rest.
    records = json.loads(LIMA.read_text(encoding="utf-8")) * COPIES
    path = write_jsonl(tmp_path / "lima5.jsonl", records)
    return make_config([{"path": str(path), "type": "alpaca"}], sequence_len=1024, pack_buffer_size=PACK,
                       read_tasks=1, tokenize={"num_actors": 1, "num_cpus": 0.5, "batch_size": 256,
                                               "placement": placement})


@needs_shared
def test_read_blocks_are_one_row_per_unit_and_first_unit_is_small(tmp_path):
    from pipelines.stream.spec import build_spec
    from pipelines.stream.stages import read_options

    cfg = _cfg(tmp_path)
    spec = build_spec(cfg)
    table = spec.table
    blocks = list(read_files(list(table.files), read_options(spec, list(range(len(table.files)))), StatsSink()))
    assert all(b.num_rows == 1 for b in blocks)
    sizes = [b.column("unit_records")[0].as_py() for b in blocks]
    n = 1029 * COPIES
    assert len(sizes) == 4 and sizes[1] == sizes[2] == PACK and sum(sizes) == n
    first = explode_units(blocks[0])
    assert 0 < sizes[0] < PACK and sum(len(r) for r in first.column("record").to_pylist()) >= FIRST_UNIT_BYTES
    # records come out in file order, ids consecutive from row 0, unit columns repeated per record
    ids = pa.concat_tables([explode_units(b) for b in blocks]).column("sample_id").to_pylist()
    assert ids == list(range(n))


@pytest.mark.slow  # end to end through Ray Data on real data: the full suite runs it, the fast tier does not
@needs_shared
@pytest.mark.parametrize("placement", ["actors", "read_tasks"])
def test_read_operator_emits_one_block_per_unit_and_rows_match_local(ray_local, tmp_path, placement):
    from pipelines.stream.dataset import build_dataset
    from pipelines.stream.stages import iter_packed_local

    cfg = _cfg(tmp_path, placement)
    ds = build_dataset(cfg)
    rows = [r for b in ds.iter_batches(batch_size=None, batch_format="pyarrow") for r in b.to_pylist()]
    stats = ds.stats()
    m = re.search(r"ReadShards([^\n]*?): (\d+) tasks executed, (\d+) blocks produced", stats)
    assert m, stats[:2000]
    fused, tasks, blocks = m.group(1), int(m.group(2)), int(m.group(3))
    # read_tasks 1, plus the first unit's own task; blocks: the small first unit, 2 x 2,000 records, the rest
    assert fused == "" and tasks == 2, stats[:2000]
    if placement == "actors":
        assert blocks == 4 and "MapBatches(TokenizeAndPack)" in stats, stats[:2000]
    else:  # the tokenizer in the read tasks: a unit's packed rows (4 MB blocks) leave as it is packed
        assert blocks >= 4 and "MapBatches" not in stats, stats[:2000]
    local = [r for t in iter_packed_local(cfg) for r in t.to_pylist()]
    assert len(rows) == len(local) > 100
    assert [r["sample_ids"] for r in rows] == [r["sample_ids"] for r in local]
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in local]
    assert sorted(s for r in rows for s in r["sample_ids"]) == sorted(set(s for r in rows for s in r["sample_ids"]))


def _split_and_whole(cfg, order: list[int], parallelism: int, start=None):
    """Blocks and counts of ``read_files`` over the whole ``order``, and of the datasource's read tasks;
    ``start`` (a :class:`~pipelines.stream.dataset.ResumePoint`) resumes both as ``build_dataset`` does."""
    from pipelines.sources.datasource import ShardDatasource
    from pipelines.stream.dataset import ResumePoint
    from pipelines.stream.spec import build_spec
    from pipelines.stream.stages import read_options

    spec = build_spec(cfg)
    table = spec.table
    opts = read_options(spec, order)
    start = start or ResumePoint()
    first, cursor, skip = start.file_pos, start.cursor, start.skip_rows
    files = order[first:]
    whole = StatsSink()
    expected = list(read_files([table.files[i] for i in files], opts, whole, cursor, skip))
    split = StatsSink()
    tasks = ShardDatasource(table, files, opts, split, cursor, skip).get_read_tasks(parallelism)
    per_task = [list(task.read_fn()) for task in tasks]  # as Ray Data's read tasks run them
    got = [b for blocks in per_task for b in blocks]
    assert len(got) == len(expected) > 3
    assert all(g.equals(e) for g, e in zip(got, expected, strict=True))
    assert split.local.counters == whole.local.counters
    for key, examples in whole.local.examples.items():
        assert sorted(split.local.examples[key]) == sorted(examples)
    return per_task, whole.local.counters


@needs_shared
def test_first_unit_task_and_the_rest_read_exactly_the_unsplit_stream(tmp_path):
    """The first unit's own read task plus the others yield the unsplit stream's blocks, counted once.

    Lines that are not UTF-8 sit inside the first unit (rows 2 and 40) and after it (150, 700); skip mode
    counts each of them once although two tasks read the first unit.
    """
    records = [json.dumps(r).encode() for r in json.loads(LIMA.read_text(encoding="utf-8"))]
    for row in (2, 40, 150, 700):
        records.insert(row, b'{"instruction": "\xff\xfe"}')  # not UTF-8: the read stage skips and counts it
    a = tmp_path / "a.jsonl"
    a.write_bytes(b"\n".join(records) + b"\n")
    b = write_jsonl(tmp_path / "b.jsonl", json.loads(LIMA.read_text(encoding="utf-8"))[:300])
    cfg = make_config([{"path": str(a), "type": "alpaca"}, {"path": str(b), "type": "alpaca"}],
                      pack_buffer_size=300, read_tasks=2, on_bad_record="skip")
    per_task, counters = _split_and_whole(cfg, [0, 1], 2)  # a.jsonl first: the stream's first unit is its start

    assert len(per_task) == 3 and len(per_task[0]) == 1  # the first unit, then 2 groups of files
    first_end = per_task[0][0].column("unit_end_row")[0].as_py()
    assert 40 < first_end < 150  # the first unit holds two bad lines and the next two come after it
    assert counters["skipped_bad_bytes"] == 4 and counters["records_read"] == 1029 + 300


@needs_shared
def test_first_unit_task_when_the_first_file_has_no_records(tmp_path):
    """The stream's first file holds nothing usable: the first unit comes from the next file, read by
    both the first unit's task and its group's task (which drops it), and nothing else is dropped."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"x": "\xff"}\n{"y": "\xfe"}\n')  # two lines, neither UTF-8
    lima = json.loads(LIMA.read_text(encoding="utf-8"))
    a = write_jsonl(tmp_path / "a.jsonl", lima[:700])
    b = write_jsonl(tmp_path / "b.jsonl", lima[700:])
    cfg = make_config([{"path": str(p), "type": "alpaca"} for p in (bad, a, b)],
                      pack_buffer_size=300, read_tasks=2, on_bad_record="skip")
    per_task, counters = _split_and_whole(cfg, [0, 1, 2], 2)

    assert len(per_task) == 3 and len(per_task[0]) == 1
    assert per_task[0][0].column("unit_records")[0].as_py() == 300  # a.jsonl's first unit, full size
    assert counters["skipped_bad_bytes"] == 2 and counters["records_read"] == 1029


def test_feeder_skips_the_empty_block_of_a_read_task_without_units(ray_local, tmp_path):
    """One file of one unit: the first unit's task yields it and the group's task yields nothing, which
    Ray Data turns into an empty block without columns. The feeder passes over it (it failed on the
    missing ``input_ids`` column) and delivers exactly the local path's rows."""
    import ray

    from pipelines.config import config_from_dict
    from pipelines.stream.blocks import chunks_of as _chunks_of
    from pipelines.stream.dataset import build_dataset
    from pipelines.stream.stages import iter_packed_local

    write_jsonl(tmp_path / "part-0.jsonl", [{"text": f"record {i} " + "word " * (3 + i % 5)} for i in range(16)])
    cfg = config_from_dict({
        "model": {"tokenizer": "demo://tokenizer"},
        "data": {"sequence_len": 64, "packing": "none", "datasets": [{"path": str(tmp_path), "type": "completion"}],
                 "tokenize": {"num_actors": 1, "num_cpus": 0.25}},
    })
    ds = build_dataset(cfg)
    sizes = [e.metadata.num_rows for b in ds.iter_internal_ref_bundles() for e in b.blocks]
    assert sorted(sizes) == [0, 16]  # the case under test: one empty block beside the unit's
    chunks = list(_chunks_of(build_dataset(cfg)))
    got = [ray.get(c.block).slice(c.offset, len(c)).column("sample_ids").to_pylist() for c in chunks]
    local = [t.column("sample_ids").to_pylist() for t in iter_packed_local(cfg)]
    assert got == local and sum(len(x) for x in got) == 16


def test_read_concurrency_follows_the_tokenizer_pool():
    from pipelines.stream.placement import Placement

    def cfg(**data):
        return make_config([{"path": "unused.jsonl", "type": "alpaca"}], **data)

    def read_concurrency(c, token_ids, cpus=None):
        d = c.data
        return Placement.resolve(d.tokenize, d.read_num_cpus, d.read_tasks, d.read_concurrency, cpus).reads_at_once(token_ids)

    # null: Ray's own cap (as many as the CPUs allow)
    assert read_concurrency(cfg(tokenize={"num_actors": 1}, read_concurrency=None), token_ids=False) is None
    # auto, the default: one read task per tokenizer actor of the pool at its largest
    assert read_concurrency(cfg(tokenize={"num_actors": 2}), token_ids=False) == 2
    auto = {"read_concurrency": "auto"}
    assert read_concurrency(cfg(tokenize={"num_actors": 1}, **auto), token_ids=False) == 1
    assert read_concurrency(cfg(tokenize={"num_actors": 3}, **auto), token_ids=False) == 3
    assert read_concurrency(cfg(tokenize={"num_actors": "auto", "num_cpus": 1.0}, **auto), False, cpus=2) == 1
    assert read_concurrency(cfg(tokenize={"num_actors": "auto", "num_cpus": 1.0}, **auto), False, cpus=16) == 15
    # pre-tokenized sets: the reads do the packing, one per CPU (Ray's own cap would be one per read_num_cpus)
    assert read_concurrency(cfg(tokenize={"num_actors": 1}, **auto), token_ids=True, cpus=2) == 2
    assert read_concurrency(cfg(tokenize={"num_actors": 1}, **auto), token_ids=True, cpus=16.5) == 16
    assert read_concurrency(cfg(**auto), token_ids=True, cpus=0.5) == 1
    # set explicitly: as set, either way
    assert read_concurrency(cfg(read_concurrency=4), token_ids=False) == 4
    assert read_concurrency(cfg(read_concurrency=2), token_ids=True) == 2


@pytest.mark.slow  # end to end through Ray Data on real data: the full suite runs it, the fast tier does not
@needs_shared
def test_capped_reads_give_the_same_rows(ray_local, tmp_path):
    from pipelines.stream.dataset import build_dataset
    from pipelines.stream.stages import iter_packed_local

    records = json.loads(LIMA.read_text(encoding="utf-8"))[:600]
    paths = [write_jsonl(tmp_path / f"part{i}.jsonl", records[i::3]) for i in range(3)]
    datasets = [{"path": str(p), "type": "alpaca"} for p in paths]
    local = None
    for setting, cap in (("auto", 2), (1, 1), (None, None)):
        cfg = make_config(datasets, sequence_len=1024, pack_buffer_size=64, read_tasks=3, read_concurrency=setting,
                          tokenize={"num_actors": 2, "num_cpus": 0.5, "batch_size": 64})
        ds = build_dataset(cfg)
        assert read_op(ds).compute.size == cap
        rows = [r for b in ds.iter_batches(batch_size=None, batch_format="pyarrow") for r in b.to_pylist()]
        local = local or [r for t in iter_packed_local(cfg) for r in t.to_pylist()]
        assert len(rows) == len(local) > 50
        assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in local]


@needs_shared
def test_read_tasks_that_tokenize_run_in_one_round(ray_local, tmp_path):
    """Where the tokenizer runs in the read tasks, ``read_concurrency: auto`` makes no more read tasks than
    run at once: one task follows another in the same slot only after a scheduling round, with its tokenizer
    pipeline to fill again. A cap set by hand keeps ``read_tasks``; an actor pool keeps them too. The rows are
    the same every way."""
    from pipelines.stream.dataset import build_dataset
    from pipelines.stream.placement import tokenizer_placement
    from pipelines.stream.stages import iter_packed_local

    records = json.loads(LIMA.read_text(encoding="utf-8"))[:600]
    paths = [write_jsonl(tmp_path / f"part{i}.jsonl", records[i::4]) for i in range(4)]
    datasets = [{"path": str(p), "type": "alpaca"} for p in paths]
    local = None
    # data settings (read_tasks: 3 throughout) -> the tokenizer's placement, read tasks at once, read tasks
    cases = [({}, "read_tasks", 1, 1),  # auto placement on 2 CPUs: one at a time -> one task
             ({"tokenize": {"placement": "read_tasks", "num_actors": 2, "num_cpus": 0.5}}, "read_tasks", 2, 2),
             ({"read_concurrency": 1}, "read_tasks", 1, 3),  # set by hand: read_tasks, one after another
             ({"tokenize": {"num_actors": 2, "num_cpus": 0.5}}, "actors", 2, 3)]  # the read tasks only read
    for data, placement, at_once, n_tasks in cases:
        cfg = make_config(datasets, sequence_len=1024, pack_buffer_size=64, read_tasks=3, **data)
        assert tokenizer_placement(cfg.data.tokenize) == placement
        ds = build_dataset(cfg)
        assert (read_op(ds).compute.size, read_op(ds).parallelism) == (at_once, n_tasks), data
        rows = [r for b in ds.iter_batches(batch_size=None, batch_format="pyarrow") for r in b.to_pylist()]
        local = local or [r["input_ids"] for t in iter_packed_local(cfg) for r in t.to_pylist()]
        assert len(rows) == len(local) > 50 and [r["input_ids"] for r in rows] == local


@needs_shared
def test_a_resumed_stream_has_a_task_for_its_first_unit(tmp_path):
    """A resumed stream's first unit (full size, from the resume point) gets a task of its own too, so its
    rows leave without waiting for the next units' (B7); both tasks together read exactly the unsplit
    resumed stream: same unit blocks, the rows already trained on marked in the first, counted once."""
    from pipelines.sources.listing import make_sample_id
    from pipelines.stream.dataset import ResumePoint

    lima = json.loads(LIMA.read_text(encoding="utf-8"))
    paths = [write_jsonl(tmp_path / f"{k}.jsonl", lima[k * 300:(k + 1) * 300]) for k in range(3)]
    cfg = make_config([{"path": str(p), "type": "alpaca"} for p in paths], pack_buffer_size=100, read_tasks=2)
    # a checkpoint in the second file, in its third unit (rows 200-299), 3 of that unit's packed rows done
    point = ResumePoint(epoch=0, file_pos=1, row=200, byte=-1, skip_rows=3)
    per_task, counters = _split_and_whole(cfg, [0, 1, 2], 1, start=point)

    assert len(per_task) == 2 and len(per_task[0]) == 1  # the resumed unit alone, then the rest
    first = per_task[0][0].to_pylist()[0]
    assert first["unit_id"] == make_sample_id(1, 200) and first["unit_end_row"] == 300
    assert first["unit_records"] == 100 and first["unit_skip"] == 3
    assert counters["records_read"] == 100 + 300  # the rest of the second file and the third, once
