"""The feeder through Ray, without training: determinism, mid-epoch resume, world-size changes.

Ranks are simulated in this process with :class:`FeederClient`; the training tests drive the same
feeder from real Ray Train workers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray
from conftest import GPT2, make_config, write_jsonl
from mds_sets import mds_write

from pipelines.sources.listing import split_sample_id
from pipelines.stream.client import FeederClient
from pipelines.stream.dataset import source_dataset
from pipelines.stream.feeder import start_feeder
from pipelines.stream.ledger import Ledger, sample_counts
from pipelines.stream.spec import build_spec

N_FILES, PER_FILE = 4, 120


def _config(tmp_path, seed=7, **data):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    for f in range(N_FILES):
        recs = [{"text": " ".join(f"w{f}_{i}_{k}" for k in range(3 + (i * 7 + f) % 40))} for i in range(PER_FILE)]
        write_jsonl(d / f"part-{f}.jsonl", recs)
    data.setdefault("pack_buffer_size", 50)
    return make_config([{"path": str(d), "type": "completion"}], sequence_len=128, shuffle_seed=seed, **data)


def drive(feeder, world: int, start: int = 0, max_steps: int | None = None, clients=None):
    """Fetch items like `world` ranks would; returns (per-step rank rows, index of the last item taken)."""
    clients = clients or [FeederClient(feeder, r, start) for r in range(world)]
    steps, last = [], clients[0].index - 1
    while max_steps is None or len(steps) < max_steps:
        items = [c.next() for c in clients]
        if items[0] is None:
            break
        last = items[0].index
        if items[0].kind == "step":
            steps.append([it.sample_ids() for it in items])
    return steps, last


def _rows(steps) -> list[list[int]]:
    return [row for step in steps for rank in step for row in rank]


def _ids(steps) -> list[int]:
    return [s for step in steps for rank in step for row in rank for s in row]


def test_same_seed_same_rows_per_rank_and_other_seed_differs(tmp_path, ray_local):
    cfg = _config(tmp_path)
    a, _ = drive(start_feeder(cfg, 2, 6, None, None), 2)
    b, _ = drive(start_feeder(cfg, 2, 6, None, None), 2)
    assert a == b and len(a) > 20
    c, _ = drive(start_feeder(_config(tmp_path, seed=8), 2, 6, None, None), 2)
    assert sorted(_ids(a)) == sorted(_ids(c)) and _ids(a) != _ids(c)
    assert sorted(_ids(a)) == sorted(set(_ids(a)))  # every sample once
    assert len(_ids(a)) == N_FILES * PER_FILE


def test_resume_starts_reading_before_the_first_request_with_the_same_rows(tmp_path, ray_local):
    """Training resumes the feeder before the engine builds (pipelines.train.feed.EarlyFeeder): from then
    on the stream is read without waiting for a rank's first request, and serves the same rows."""
    import time

    cfg = _config(tmp_path)
    feeder = start_feeder(cfg, 2, 6, None, None)
    assert ray.get(feeder.telemetry.remote(0))["mix_share"] == {}  # not started: nothing read
    ray.get(feeder.resume.remote(None, 0, 0, "fail", "step 0"))
    deadline = time.time() + 60
    while not (share := ray.get(feeder.telemetry.remote(0))["mix_share"]) and time.time() < deadline:
        time.sleep(0.1)
    assert list(share.values()) == [1.0]  # item 0 was produced, with no get
    early, _ = drive(feeder, 2)
    assert early == drive(start_feeder(cfg, 2, 6, None, None), 2)[0] and len(early) > 20


def _resume_run(tmp_path, world_before: int, world_after: int, cut: int):
    cfg = _config(tmp_path)
    ledger_root = str(tmp_path / f"ledger_{world_before}_{world_after}")
    first = start_feeder(cfg, world_before, 6, None, ledger_root)
    head, last = drive(first, world_before, max_steps=cut)
    state = ray.get(first.commit.remote(last))
    ray.kill(first)  # the worker group dies; rows it had prefetched are not counted
    second = start_feeder(cfg, world_after, 6, state, ledger_root)
    tail, last2 = drive(second, world_after)
    ray.get(second.commit.remote(last2))
    return head, tail, ledger_root


def test_resume_with_fewer_and_more_workers_is_exactly_once_and_same_order(tmp_path, ray_local):
    import pyarrow.fs as pafs

    full, _ = drive(start_feeder(_config(tmp_path), 1, 6, None, None), 1)  # uninterrupted, one rank
    for before, after in [(2, 1), (1, 2)]:
        head, tail, root = _resume_run(tmp_path, before, after, len(full) // 3)
        # The global row order does not depend on the world size or the restart.
        assert _rows(head) + _rows(tail) == _rows(full)
        entries = Ledger(pafs.LocalFileSystem(), root).entries(0)
        counts = sample_counts(entries)
        assert len(counts) == N_FILES * PER_FILE and set(counts.values()) == {1}
        assert [e.step for e in entries] == list(range(1, len(entries) + 1))
        assert 0 < len(head) < len(full)  # the cut really was mid-epoch


def test_restore_forgets_uncommitted_steps_in_the_ledger(tmp_path, ray_local):
    import pyarrow.fs as pafs

    cfg = _config(tmp_path)
    root = str(tmp_path / "ledger")
    feeder = start_feeder(cfg, 2, 6, None, root)
    clients = [FeederClient(feeder, r) for r in range(2)]  # one client per rank for the whole run
    steps, last = drive(feeder, 2, max_steps=10, clients=clients)
    state = ray.get(feeder.commit.remote(last))  # checkpoint at step 10
    more, last = drive(feeder, 2, max_steps=5, clients=clients)
    ray.get(feeder.commit.remote(last))  # ledger flushed to step 15, then the checkpoint fails
    ray.kill(feeder)
    assert [e.step for e in Ledger(pafs.LocalFileSystem(), root).entries()][-1] == 15
    restored = start_feeder(cfg, 2, 6, state, root)  # restore from step 10
    ray.get(restored.report.remote())  # returns once the feeder is up (it trims the ledger first)
    assert [e.step for e in Ledger(pafs.LocalFileSystem(), root).entries()] == list(range(1, 11))


def test_pools_short_counts_every_mixed_source_at_its_smallest_pool():
    from pipelines.config import TokenizeConfig
    from pipelines.stream.placement import tokenizer_pools_short

    pinned = TokenizeConfig(num_actors=1, num_cpus=0.25, resources={"cpu_node": 1})
    # two sources, one cpu_node slot: the second pool can never start (tests/test_node_loss.py's old cluster)
    assert tokenizer_pools_short(pinned, 2, {"CPU": 4, "cpu_node": 1}) == ["cpu_node: 2 needed, 1 in the cluster"]
    assert tokenizer_pools_short(pinned, 2, {"CPU": 4, "cpu_node": 2}) == []
    # no node advertises the resource yet (an autoscaler may add one): 0 in the cluster
    assert tokenizer_pools_short(pinned, 1, {"CPU": 4}) == ["cpu_node: 1 needed, 0 in the cluster"]
    # fixed pools of 3 actors x 1 CPU, 2 sources: 6 CPUs; auto pools start at one actor each
    fixed = TokenizeConfig(num_actors=3, num_cpus=1.0)
    assert tokenizer_pools_short(fixed, 2, {"CPU": 4}) == ["CPU: 6 needed, 4 in the cluster"]
    assert tokenizer_pools_short(TokenizeConfig(num_cpus=1.0), 2, {"CPU": 4}) == []


def test_feeder_warns_when_the_cluster_cannot_start_every_mixed_pool(tmp_path, ray_local, caplog):
    from pipelines.stream.feeder import warn_if_pools_short
    from pipelines.stream.spec import build_spec

    paths = [write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name} {i}"} for i in range(5)])
             for name in ("a", "b")]
    datasets = [{"path": str(p), "type": "completion", "weight": 1.0} for p in paths]
    pinned = {"num_actors": 1, "num_cpus": 0.25, "resources": {"cpu_node": 1}}

    def warn(cfg):
        warn_if_pools_short(build_spec(cfg, "train"), ray.cluster_resources())

    with caplog.at_level("WARNING", logger="pipelines.stream.feeder"):
        warn(make_config(datasets, tokenize=pinned))
    assert "2 mixed sources" in caplog.text and "cpu_node: 2 needed, 0 in the cluster" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipelines.stream.feeder"):
        warn(make_config(datasets, tokenize={"num_actors": 1, "num_cpus": 0.25}))  # 0.5 of 2 CPUs
        warn(make_config(datasets[:1], tokenize=pinned))  # one source: placement is Ray's to report
    assert "mixed sources" not in caplog.text


def _block_rows(seed: int, n: int) -> dict[str, list]:
    """``n`` packed rows of random lengths (seeded), as the packing stage's columns."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 50_000, int(rng.integers(3, 9))).tolist() for _ in range(n)]
    return {"input_ids": ids, "labels": [[-100, *r[1:]] for r in ids], "position_ids": [list(range(len(r))) for r in ids],
            "sample_ids": [[seed * 100 + j, seed * 100 + j + 50] for j in range(n)]}


def test_a_rank_fetches_each_block_once_and_gets_exactly_its_rows(ray_local, monkeypatch):
    import pyarrow as pa

    from pipelines.stream import blocks as F
    from pipelines.stream.blocks import BlockColumns, RankItem, RowSlice

    rows = {k: _block_rows(k, 6) for k in range(3)}
    a, b, c = (ray.put(pa.table(rows[k])) for k in range(3))
    gets: list[list] = []
    real_get = ray.get
    monkeypatch.setattr(F.ray, "get", lambda refs, **kw: (gets.append(list(refs)), real_get(refs, **kw))[1])

    first = [RankItem(0, "step", 0, 1, (RowSlice(a, 0, 2),)),
             RankItem(1, "step", 0, 2, (RowSlice(a, 2, 3), RowSlice(b, 0, 2))),
             RankItem(2, "epoch_end", 0, 2)]
    got, have = F.fetch_blocks(first)
    assert gets == [[a, b]]  # one get for the response, each block once
    second = [RankItem(3, "step", 1, 3, (RowSlice(b, 2, 6), RowSlice(c, 1, 2)))]
    got2, have2 = F.fetch_blocks(second, have)
    assert gets == [[a, b], [c]] and set(have2) == {b, c}  # b kept from the response before

    def expect(*cuts):
        return {col: [r for k, s, e in cuts for r in rows[k][col][s:e]] for col in F.ROW_COLUMNS}

    def as_lists(item):
        return {col: [r.tolist() for r in v] for col, v in item.columns().items()}

    assert as_lists(got[0]) == expect((0, 0, 2))
    assert as_lists(got[1]) == expect((0, 2, 3), (1, 0, 2))
    assert as_lists(got2[0]) == expect((1, 2, 6), (2, 1, 2))
    assert got2[0].sample_ids() == expect((1, 2, 6), (2, 1, 2))["sample_ids"]
    assert got[2].columns() == {col: [] for col in F.ROW_COLUMNS}
    assert len(gets) == 2  # the items' rows come from the blocks fetched with them

    # A block that is a slice of a larger table: its list offsets index the whole values buffer.
    sliced = BlockColumns(pa.table(rows[1]).slice(2, 3))
    assert [r.tolist() for r in sliced.rows("input_ids", 1, 3)] == rows[1]["input_ids"][3:5]


class _Recorder:
    """Stands in for the feeder's handle in a client: forwards ``get`` and keeps each request and its answer."""

    def __init__(self, feeder) -> None:
        self.feeder, self.requests = feeder, []  # (first, least, answer ref)
        self.get = self  # the client calls ``self.feeder.get.remote(...)``

    def remote(self, first: int, rank: int, most: int, least: int):
        ref = self.feeder.get.remote(first, rank, most, least)
        self.requests.append((first, least, ref))
        return ref


def test_a_rank_takes_whole_batches_after_a_doubling_start_and_gets_the_same_rows(tmp_path, ray_local):
    cfg = _config(tmp_path)
    first = start_feeder(cfg, 2, 2, None, None)
    one_by_one, _ = drive(first, 2, clients=[FeederClient(first, r, batch=1) for r in range(2)])
    feeder = start_feeder(cfg, 2, 2, None, None)
    recorders = [_Recorder(feeder) for _ in range(2)]
    batched, _ = drive(None, 2, clients=[FeederClient(rec, r, batch=8) for r, rec in enumerate(recorders)])
    assert batched == one_by_one and len(batched) > 60  # the same rows per rank per step

    items = len(batched) + 1  # the steps and the epoch-end item
    for rec in recorders:
        answers = [ray.get(ref) for _, _, ref in rec.requests]
        # a request waits for as many items as the rank has received, up to the batch (at most doubling)
        assert [least for _, least, _ in rec.requests] == [max(1, min(8, first)) for first, _, _ in rec.requests]
        assert max(least for _, least, _ in rec.requests) == 8
        for (first, least, _), got in zip(rec.requests, answers, strict=True):
            assert [it.index for it in got] == list(range(first, first + len(got)))
            # each answer holds at least ``least`` items, unless the data ended first
            assert len(got) >= least or first + len(got) == items
        assert sum(map(len, answers)) == items and answers[-1] == []
        assert len(answers) <= 4 + -(-(items - 8) // 8) + 1  # at least 1+1+2+4 items, then 8 a call, then []


def test_a_step_takes_the_same_rows_at_every_world_size_even_when_they_do_not_divide(tmp_path, ray_local):
    """The global batch is a property of the step: 5 rows per step at 1, 2 and 3 ranks are the same 5 rows
    in the same order, cut 5 / 3+2 / 2+2+1."""
    cfg = _config(tmp_path)
    by_world = {w: drive(start_feeder(cfg, w, 5, None, None), w)[0] for w in (1, 2, 3)}
    assert len(by_world[1]) > 3
    for w, steps in by_world.items():
        assert len(steps) == len(by_world[1])
        assert [[row for rank in step for row in rank] for step in steps] == [step[0] for step in by_world[1]]
        full = [[len(rank) for rank in step] for step in steps[:-1]]  # the epoch's last step may be short
        assert all(sizes == {1: [5], 2: [3, 2], 3: [2, 2, 1]}[w] for sizes in full), (w, full)


def _rows_with_ids(feeder, world: int, max_steps: int | None = None) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Every row the ranks take, in global order, as (sample ids, input ids), and the last item's index."""
    clients = [FeederClient(feeder, r) for r in range(world)]
    rows, last, steps = [], -1, 0
    while max_steps is None or steps < max_steps:
        items = [c.next() for c in clients]
        if items[0] is None:
            break
        last, steps = items[0].index, steps + (items[0].kind == "step")
        for it in items:
            cols = it.columns(("sample_ids", "input_ids"))
            rows += [(s.tolist(), i.tolist()) for s, i in zip(cols["sample_ids"], cols["input_ids"], strict=True)]
    return rows, last


def test_the_feeder_reads_a_pretokenized_source_without_importing_ray_data(tmp_path):
    """Ray Data's import is ~0.65 s of a process's start: the feeder's module, and the stages it runs for a
    pre-tokenized source, do without it, so a feeder of such sources serves its first batch sooner."""
    import subprocess
    import sys

    rng = np.random.default_rng(1)
    samples = [{"tokens": rng.integers(1, 50_000, size=int(n), dtype=np.int32)} for n in rng.integers(10, 128, 40)]
    root = mds_write(tmp_path / "ids", samples, {"tokens": "ndarray:int32"}, "zstd", size_limit=1 << 12)
    script = f"""
import sys
import ray
from pipelines.config import config_from_dict
from pipelines.stream.feeder import Feeder
from pipelines.stream.spec import build_spec
from pipelines.stream.stages import iter_packed_local
cfg = config_from_dict({{"model": {{"tokenizer": "{GPT2}"}},
                        "data": {{"datasets": [{{"path": "{root}"}}], "sequence_len": 128}}}})
spec = build_spec(cfg, cpus=1.0)
assert Feeder(spec, 1, 8, 1).read_here == [True]
tokens = sum(len(ids) for t in iter_packed_local(spec) for ids in t.column("input_ids").to_pylist())
print(tokens, sorted(m for m in sys.modules if m == "ray.data" or m.startswith("ray.data."))[:3])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split(maxsplit=1) == [str(sum(len(x["tokens"]) for x in samples)), "[]\n"], out.stdout


def test_a_pretokenized_source_is_read_in_the_feeder_as_its_dataset_reads_it_and_resumes_exactly_once(
        tmp_path, ray_local):
    """A source of MDS token ids needs no tokenizer: the feeder reads, checks and packs it in its own
    process (no read task to wait for) and serves the rows its Ray Data stream holds, in that order, mixed
    with a text source; a resume mid-epoch at another world size goes on at the next row, and the
    data-quality counters count the id samples."""
    rng = np.random.default_rng(0)
    samples = [{"tokens": rng.integers(1, 50_000, size=int(n), dtype=np.int32)} for n in rng.integers(10, 128, 160)]
    ids_root = mds_write(tmp_path / "ids", samples, {"tokens": "ndarray:int32"}, "zstd", size_limit=1 << 12)
    text = tmp_path / "text.jsonl"
    write_jsonl(text, [{"text": f"t{i} " + "w " * (3 + (i * 7) % 40)} for i in range(300)])
    cfg = make_config([{"path": str(ids_root), "type": "completion", "name": "ids"},
                       {"path": str(text), "type": "completion", "name": "text"}],
                      sequence_len=128, pack_buffer_size=20, shuffle_seed=5, deterministic=True)
    spec = build_spec(cfg)
    id_files = {i for i, f in enumerate(spec.table.files) if f.dataset_index == 0}
    assert len(id_files) > 4  # several shards: the read crosses files

    whole = start_feeder(cfg, 2, 6, None, None)
    full, _ = _rows_with_ids(whole, 2)
    assert ray.get(whole.report.remote())["counters"]["samples_pretokenized"] == len(samples)
    of_ids = [r for r in full if split_sample_id(r[0][0])[0] in id_files]
    stream = pa.concat_tables(source_dataset(spec, 0).iter_batches(batch_size=None, batch_format="pyarrow"))
    want = list(zip(stream.column("sample_ids").to_pylist(), stream.column("input_ids").to_pylist(), strict=True))
    assert of_ids == want and len(want) > 20
    served = [s for r in of_ids for s in r[0]]  # every id sample once, with all its ids
    assert len(served) == len(set(served)) == len(samples)
    assert sum(len(r[1]) for r in of_ids) == sum(len(x["tokens"]) for x in samples)
    assert len(of_ids) < len(full)  # mixed with the text source's rows

    root = str(tmp_path / "ledger")
    first = start_feeder(cfg, 2, 6, None, root)
    head, last = _rows_with_ids(first, 2, max_steps=len(full) // 18)
    state = ray.get(first.commit.remote(last))
    ray.kill(first)
    second = start_feeder(cfg, 1, 6, state, root)
    tail, last = _rows_with_ids(second, 1)
    assert 0 < len(head) < len(full) and head + tail == full
    ray.get(second.commit.remote(last))
    counts = sample_counts(Ledger(pafs.LocalFileSystem(), root).entries(0))
    assert len(counts) == len(samples) + 300 and set(counts.values()) == {1}


def test_a_given_dataset_streams_with_ray_data_progress_bars_as_run_progress_bars_says(tmp_path, ray_local):
    """``run.progress_bars`` (off by default) holds for a dataset handed to the trainer as for the files the
    feeder reads: the feeder's process runs the given dataset's stream with Ray Data's bars and its
    execution-start lines off, or on when asked."""
    from pipelines.stream.feeder import Feeder
    from pipelines.stream.spec import given_spec
    from pipelines.train.step import synthetic_rows

    cfg = _config(tmp_path)
    rows = [{k: np.asarray(v).tolist() for k, v in r.items()} for r in synthetic_rows(4, 32, 100)]
    ctx = ray.data.DataContext.get_current()
    before = (ctx.enable_progress_bars, ctx.print_on_execution_start)
    try:
        for asked in (False, True):
            ctx.enable_progress_bars = ctx.print_on_execution_start = not asked
            feeder = Feeder(given_spec(cfg), 1, 2, 1, progress_bars=asked, given=ray.data.from_items(rows))
            first = feeder.get(0, 0)
            assert first[0].kind == "step" and first[0].num_rows == 2
            assert (ctx.enable_progress_bars, ctx.print_on_execution_start) == (asked, asked)
    finally:
        ctx.enable_progress_bars, ctx.print_on_execution_start = before
