"""Ray Data's own first-block latency on this machine: the floor under B2's and B6's first-row targets.

    python benchmarks/ray_floors.py              # 3 runs per case, a markdown table on stdout
    python benchmarks/ray_floors.py --repeats 1

Each case runs in a fresh child process with a fresh local Ray (2 CPUs, as B2), and times the first
block a consumer gets (``iter_internal_ref_bundles``, no prefetch hold) after the dataset is built.
None of the first four does any pipeline work, so what they measure is Ray and Ray Data alone:

* ``ready``: ``ray.data.from_blocks([table])``: a block that already exists, no task, no actor;
* ``ready + actor pool``: the same block in a union with a 1-actor pool stage (as ``build_dataset``'s
  plan has its tokenizer pool): Ray Data's scheduling loop waits on the start of its own actor-location
  tracker actor before it hands the ready block on (BENCHMARKS.md, B2 first row);
* ``read task``: a one-task read that returns the same table (a read worker starts and imports
  ``ray.data``): the floor of the pre-tokenized MDS path, whose check and packing run in read tasks;
* ``read task -> actor pool``: that read, then an actor that returns its input (an identity
  ``map_batches`` actor, 1 CPU, as the tokenizer pool on 2 CPUs): the floor of the tokenizer path;
* ``build_dataset``: ours on the B2 data (the Alpaca demo x 20, GPT-2, 20 JSONL files), first packed row;
  on 2 CPUs the tokenizer runs inside the read tasks (``data.tokenize.placement: auto``);
* ``build_dataset, actors``: the same with ``placement: actors``, the tokenizer in a 1-actor pool;
* ``build_dataset, env as runtime_env``: that pool with its environment given as a ``runtime_env`` (as
  before 2026-12-02), which makes Ray start a new worker process for the actor through its runtime-env
  agent instead of handing it an idle one (``pipelines.stream.dataset.tokenizer_env``).

Ratios are not targets here; the table says how much of a first-row time is Ray's before any of ours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TAG = "RAY_FLOOR "
OLD_ENV = "build_dataset, env as runtime_env"
ACTORS = "build_dataset, actors"
CASES = ("ready", "ready + actor pool", "read task", "read task -> actor pool", "build_dataset", ACTORS, OLD_ENV)


def _table() -> Any:
    """A packed-row-like block: 32 rows of 2,048 int32 ids."""
    import numpy as np
    import pyarrow as pa

    from pipelines.arrays import list_array

    rng = np.random.default_rng(0)
    return pa.table({"input_ids": list_array([rng.integers(0, 50257, 2048, dtype=np.int32) for _ in range(32)])})


class _Identity:
    def __call__(self, batch: Any) -> Any:
        return batch


def _one_task_read(table: Any) -> Any:
    import ray
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class OneTable(Datasource):
        def estimate_inmemory_data_size(self) -> int:
            return table.nbytes

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list[ReadTask]:
            meta = BlockMetadata(num_rows=table.num_rows, size_bytes=table.nbytes, input_files=None,
                                 exec_stats=None)
            return [ReadTask(lambda: [table], meta, schema=table.schema)]

    return ray.data.read_datasource(OneTable(), override_num_blocks=1)


def _with_actor(ds: Any) -> Any:
    import ray

    return ds.map_batches(_Identity, batch_size=None, batch_format="pyarrow", num_cpus=1.0,
                          compute=ray.data.ActorPoolStrategy(min_size=1, max_size=1))


def run_case(case: str, data_dir: str | None) -> dict[str, float]:
    """One case in this (fresh) process: seconds of ``ray.init``, of building, and to the first block."""
    import ray

    from pipelines.ray_local import init_local

    t0 = time.perf_counter()
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    init_s = time.perf_counter() - t0
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    if case == OLD_ENV:
        _env_as_runtime_env()
    if case.startswith("build_dataset"):
        from benchlib import GPT2

        from pipelines.config import config_from_dict
        from pipelines.stream.dataset import build_dataset

        data: dict[str, Any] = {"datasets": [{"path": data_dir, "format": "jsonl", "type": "alpaca"}]}
        if case in (ACTORS, OLD_ENV):
            data["tokenize"] = {"placement": "actors"}
        cfg = config_from_dict({"model": {"tokenizer": str(GPT2)}, "data": data})
    table = _table() if not case.startswith("build_dataset") else None
    t1 = time.perf_counter()
    if case == "ready":
        ds = ray.data.from_blocks([table])
    elif case == "ready + actor pool":
        ds = ray.data.from_blocks([table]).union(_with_actor(_one_task_read(table)))
    elif case == "read task":
        ds = _one_task_read(table)
    elif case == "read task -> actor pool":
        ds = _with_actor(_one_task_read(table))
    else:
        ds = build_dataset(cfg)
    ds.context.execution_options.preserve_order = True
    t2 = time.perf_counter()
    t3 = None
    for _ in ds.iter_internal_ref_bundles():
        t3 = t3 or time.perf_counter()
    ray.shutdown()  # here, not at exit: the next case's child must not share the cores with this teardown
    return {"init_s": init_s, "build_s": t2 - t1, "first_after_build_s": t3 - t2, "first_s": t3 - t1}


def _env_as_runtime_env() -> None:
    """Give the tokenizer pool its environment as a ``runtime_env`` too, as ``tokenizer_stage`` did before."""
    import ray

    map_batches = ray.data.Dataset.map_batches

    def with_runtime_env(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        env = (kwargs.get("fn_constructor_kwargs") or {}).get("env")
        if env:
            kwargs["runtime_env"] = {"env_vars": dict(env)}
        return map_batches(self, fn, *args, **kwargs)

    ray.data.Dataset.map_batches = with_runtime_env


def _child(case: str, data_dir: str | None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib import CHILD_ENV  # the environment every benchmark child gets

    env = {**os.environ, **CHILD_ENV,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, __file__, "--child", case, data_dir or ""], capture_output=True, text=True,
                         env=env, timeout=300, cwd=ROOT)
    for line in out.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    return {"error": out.stderr[-1500:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("CASE", "DATA"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(TAG + json.dumps(run_case(args.child[0], args.child[1] or None)), flush=True)
        return 0

    import benchlib as bl

    data_dir = str(bl.write_alpaca_jsonl(Path(tempfile.mkdtemp(prefix="ray-floors-")), 19980))
    rows = []
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for _ in range(args.repeats):  # interleaved, so a change in the machine's load touches every case alike
        for case in CASES:
            res = _child(case, data_dir)
            if "error" in res:
                print(f"{case}: failed: {res['error']}", file=sys.stderr)
                return 1
            runs[case].append(res)
    for case, ok in runs.items():
        med = {k: statistics.median(r[k] for r in ok) for k in ok[0]}
        rows.append((case, med, [round(r["first_s"], 2) for r in ok]))
    print("| case | ray.init s | build s | first block after build s | first block s (build + wait) | runs |")
    print("|---|---:|---:|---:|---:|---|")
    for case, m, firsts in rows:
        print(f"| {case} | {m['init_s']:.2f} | {m['build_s']:.2f} | {m['first_after_build_s']:.2f} | "
              f"{m['first_s']:.2f} | {firsts} |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    raise SystemExit(main())
