"""``data.tokenize.placement``: the tokenizer in an actor pool or inside the read tasks gives the same rows.

Inside the read tasks (one operator, no actor), a stage that loads transformers gets its environment as the
tasks' ``runtime_env``, so the workers it ran in, which Ray would otherwise hand to later tasks and actors,
never pass on ``USE_TORCH=0`` or its thread settings. A stage that loads ``tokenizers`` alone runs in shared
workers, with its Rust thread settings set in the process for each stream and restored after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest
from conftest import ALPACA, GLAIVE, GPT2, SMOLLM2, make_config, needs_shared, read_op, write_jsonl

from pipelines.config import TokenizeConfig
from pipelines.stream.placement import tokenizer_placement
from pipelines.stream.spec import build_spec

ROW_COLUMNS = ["input_ids", "labels", "position_ids", "sample_ids"]


def test_auto_places_a_lone_unplaced_tokenizer_in_the_read_tasks():
    # 2 CPUs, 1 CPU per tokenizer: the pool would be (1, 1), one actor doing what the read task could.
    assert tokenizer_placement(TokenizeConfig(), cpus=2) == "read_tasks"
    assert tokenizer_placement(TokenizeConfig(num_actors=1), cpus=64) == "read_tasks"
    # Room for more than one: a pool spreads the units of every read task over all its actors.
    assert tokenizer_placement(TokenizeConfig(), cpus=16) == "actors"
    assert tokenizer_placement(TokenizeConfig(num_cpus=0.5), cpus=2) == "actors"  # (1, 3)
    assert tokenizer_placement(TokenizeConfig(num_actors=2), cpus=2) == "actors"
    # Placed by a resource: the actors go where it says, so auto never moves them into the read tasks.
    assert tokenizer_placement(TokenizeConfig(resources={"cpu_node": 1}), cpus=2) == "actors"
    # As set.
    assert tokenizer_placement(TokenizeConfig(placement="actors"), cpus=2) == "actors"
    assert tokenizer_placement(TokenizeConfig(placement="read_tasks"), cpus=16) == "read_tasks"
    with pytest.raises(ValueError, match="placement"):
        TokenizeConfig(placement="driver")


def _rows(ds) -> pa.Table:
    return pa.concat_tables(ds.iter_batches(batch_size=None, batch_format="pyarrow")).select(ROW_COLUMNS)


def _operators(ds) -> list[str]:
    return [ln.split(":")[0] for ln in ds.stats().splitlines() if ln.startswith("Operator")]


def _read_stage(ds):
    """The stage the dataset's read tasks run their blocks through (``ShardDatasource.stage``)."""
    return read_op(ds).datasource.stage


@pytest.mark.slow  # end to end through Ray Data on real data: the full suite runs it, the fast tier does not
@needs_shared
def test_both_placements_give_the_rows_and_counts_of_the_local_path(ray_local, tmp_path):
    """Alpaca and tool-call chats (SmolLM2's chat template: the transformers tokenizer loads in the stage),
    3 files of several units each: the same rows in the same order and the same counters, either way."""
    from pipelines.stream.dataset import build_dataset, data_report, read_task_args
    from pipelines.stream.stages import TokenizeAndPack, iter_packed_local, tokenizer_env

    alpaca = json.loads(ALPACA.read_text(encoding="utf-8"))
    glaive = json.loads(GLAIVE.read_text(encoding="utf-8"))
    (tmp_path / "alpaca").mkdir()
    for i in range(3):
        write_jsonl(tmp_path / "alpaca" / f"part-{i}.jsonl", alpaca[i * 200 : (i + 1) * 200])
    write_jsonl(tmp_path / "glaive.jsonl", glaive[:150])
    datasets = [{"path": str(tmp_path / "alpaca"), "type": "alpaca"},
                {"path": str(tmp_path / "glaive.jsonl"), "type": "chat_template"}]
    got: dict[str, pa.Table] = {}
    reports: dict[str, dict] = {}
    for placement in ("read_tasks", "actors"):
        cfg = make_config(datasets, tokenizer=SMOLLM2, sequence_len=1024, pack_buffer_size=64, deterministic=True,
                          mix_by="none", tokenize={"num_actors": 1, "num_cpus": 0.5, "threads": 1, "placement": placement})
        want = pa.concat_tables(iter_packed_local(cfg)).select(ROW_COLUMNS)
        ds = build_dataset(cfg)
        got[placement] = _rows(ds)
        assert got[placement].num_rows > 30 and got[placement].to_pylist() == want.to_pylist(), placement
        reports[placement] = data_report(ds)["counters"]
        if placement == "read_tasks":
            assert _operators(ds) == ["Operator 1 ReadReadShards"]  # inside the read tasks: tasks only
            assert _read_stage(ds).stage is TokenizeAndPack
            assert _read_stage(ds).isolated  # the chat template loads transformers: workers of its own
            assert read_task_args(build_spec(cfg).placement, _read_stage(ds)) == {
                "num_cpus": 0.5, "runtime_env": {"env_vars": tokenizer_env(1)}}
        else:
            assert _operators(ds) == ["Operator 1 ReadReadShards", "Operator 2 MapBatches(TokenizeAndPack)"]
            assert _read_stage(ds) is None
            assert read_task_args(build_spec(cfg).placement, None) == {"num_cpus": cfg.data.read_num_cpus}
    assert reports["read_tasks"] == reports["actors"]
    assert reports["actors"]["samples_tokenized"] == 750 and reports["actors"]["tokens"] > 100_000
    assert reports["actors"]["rows"] == got["actors"].num_rows


@needs_shared
def test_the_read_workers_environment_stays_with_them(ray_local, tmp_path):
    """After a stream that tokenized chats inside the read tasks (transformers loaded there with
    ``USE_TORCH=0``, 1 Rust thread), plain tasks land in workers with the environment they had before. Were
    it set in the read worker's own process, Ray would hand that worker on, and a train worker there could
    not see torch."""
    import ray

    from pipelines.stream.dataset import build_dataset

    @ray.remote(num_cpus=0.5)
    def probe() -> tuple[str | None, str | None]:
        return os.environ.get("USE_TORCH"), os.environ.get("RAYON_NUM_THREADS")

    # The workers' own environment (inherited from the process that started Ray: a test that tokenized in
    # this process before may have set the Rust threads there).
    before = set(ray.get([probe.remote() for _ in range(4)]))
    assert len(before) == 1 and ("0", "1") not in before  # a leak would be visible
    write_jsonl(tmp_path / "glaive.jsonl", json.loads(GLAIVE.read_text(encoding="utf-8"))[:100])
    cfg = make_config([{"path": str(tmp_path / "glaive.jsonl"), "type": "chat_template"}], tokenizer=SMOLLM2,
                      sequence_len=1024, tokenize={"num_actors": 1, "num_cpus": 0.5, "threads": 1,
                                                   "placement": "read_tasks"})
    assert _rows(build_dataset(cfg)).num_rows > 5
    after = ray.get([probe.remote() for _ in range(12)])
    assert set(after) == before, after


@needs_shared
def test_a_tokenizer_without_transformers_runs_in_shared_read_workers(ray_local, tmp_path):
    """Alpaca records with GPT-2's tokenizer.json load ``tokenizers`` alone: the read tasks carry no
    ``runtime_env`` (Ray may hand them idle workers), give the rows of the local path, and leave the workers'
    environment as it was. 3 threads: a value no earlier test sets, so a leak would be visible."""
    import ray

    from pipelines.stream.dataset import build_dataset, read_task_args
    from pipelines.stream.stages import TokenizeAndPack, iter_packed_local
    from pipelines.tokenize.stage import rust_thread_env

    @ray.remote(num_cpus=0.5)
    def probe() -> tuple[str | None, str | None]:
        return os.environ.get("RAYON_NUM_THREADS"), os.environ.get("TOKENIZERS_PARALLELISM")

    before = set(ray.get([probe.remote() for _ in range(4)]))
    assert len(before) == 1 and not any(rayon == "3" for rayon, _ in before)
    write_jsonl(tmp_path / "a.jsonl", json.loads(ALPACA.read_text(encoding="utf-8"))[:300])
    cfg = make_config([{"path": str(tmp_path / "a.jsonl"), "type": "alpaca"}], tokenizer=GPT2, sequence_len=512,
                      deterministic=True, tokenize={"num_actors": 1, "num_cpus": 0.5, "threads": 3,
                                                    "placement": "read_tasks"})
    ds = build_dataset(cfg)
    stage = _read_stage(ds)
    assert stage.stage is TokenizeAndPack and not stage.isolated
    assert stage.env == rust_thread_env(3) == {"RAYON_NUM_THREADS": "3", "TOKENIZERS_PARALLELISM": "true"}
    assert read_task_args(build_spec(cfg).placement, stage) == {"num_cpus": 0.5}
    got = _rows(ds)
    assert got.num_rows > 20 and got.to_pylist() == pa.concat_tables(iter_packed_local(cfg)).select(ROW_COLUMNS).to_pylist()
    after = ray.get([probe.remote() for _ in range(12)])
    assert set(after) == before, after


_STREAM_IN_PROCESS = """
import json, os, sys
for k in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM", "USE_TORCH"):
    os.environ.pop(k, None)
from tokenizers import Tokenizer as RustTokenizer
from pipelines.config import config_from_dict
from pipelines.stream.dataset import read_task_stage
from pipelines.stream.stages import pack_options, read_options
from pipelines.stream.spec import build_spec
from pipelines.sources.read import read_files
from pipelines.stats import StatsSink

tokenizer, data, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = config_from_dict({"model": {"tokenizer": tokenizer, "init": {}},
                        "data": {"datasets": [{"path": data, "type": "alpaca"}], "sequence_len": 512,
                                 "tokenize": {"placement": "read_tasks", "num_actors": 1, "threads": threads}}},
                       base_dir=".")
spec = build_spec(cfg)
table = spec.table
order = spec.files(0)
stage = read_task_stage(spec, StatsSink(), pack_options(cfg.data, 0), token_ids=False)
seen = set()

def blocks():
    for block in read_files([table.files[i] for i in order], read_options(spec, order), StatsSink()):
        seen.add((os.environ.get("RAYON_NUM_THREADS"), os.environ.get("TOKENIZERS_PARALLELISM")))
        yield block

def n_threads():
    return len(os.listdir("/proc/self/task"))

t0 = n_threads()
rows = sum(t.num_rows for t in stage(blocks()))
t1 = n_threads()
after = [os.environ.get("RAYON_NUM_THREADS"), os.environ.get("TOKENIZERS_PARALLELISM")]
# Parallel by default now (the variable is unset): this would build the process's Rust pool, had the stream not.
RustTokenizer.from_file(tokenizer + "/tokenizer.json").encode_batch_fast(["a b c " * 200] * 2000)
print(json.dumps({"isolated": stage.isolated, "seen": sorted(seen), "after": after, "rows": rows,
                  "stream_threads": t1 - t0, "later_threads": n_threads() - t1}))
"""


@needs_shared
def test_a_shared_workers_stream_sets_the_rust_threads_and_restores_the_environment(tmp_path):
    """In a worker's own process (no Ray here, a fresh interpreter each): the stage's Rust thread settings
    hold while the stream runs, so the process's Rust pool is built with that many threads, and the
    environment is as before once the stream ends. Two runs that differ only in ``threads`` (3 and 2) differ
    by exactly one thread, and a later parallel encode starts no pool of its own."""
    path = write_jsonl(tmp_path / "a.jsonl", json.loads(ALPACA.read_text(encoding="utf-8"))[:300])
    runs = {}
    for threads in (3, 2):
        out = subprocess.run([sys.executable, "-c", _STREAM_IN_PROCESS, str(GPT2), str(path), str(threads)],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[threads] = json.loads(out.stdout.strip().splitlines()[-1])
        assert runs[threads]["isolated"] is False
        assert runs[threads]["seen"] == [[str(threads), "true"]]  # set while every block was read
        assert runs[threads]["after"] == [None, None]
        assert runs[threads]["later_threads"] == 0
    assert runs[3]["rows"] == runs[2]["rows"] > 20
    assert runs[3]["stream_threads"] - runs[2]["stream_threads"] == 1, runs
