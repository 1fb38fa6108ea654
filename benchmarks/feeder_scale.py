"""Feeder scale (issue #10 item 4): N simulated ranks pull 8 rows of 2048 tokens per step from the feeder.

    .venv/bin/python benchmarks/feeder_scale.py            # N = 2, 8, 32, 64; writes benchmarks/results/feeder_scale.png
    .venv/bin/python benchmarks/feeder_scale.py --quick    # N = 2, 4 on a small stream (CI smoke)
    .venv/bin/python benchmarks/feeder_scale.py --step-ms 500 --steps 200   # N = 8, 64 at a set step time

At a set step time (``--step-ms``), each rank spends that long on every step (sleeping: a GPU's step, no CPU)
while its client's next request is in flight, for ``--steps`` steps of a stream made for that N; both systems
serve it once per N. The rate is then the step time's, so the figure is what the ranks wait for their rows:
data wait % of the run (the mean over ranks of their waits / their wall time), p50/p99 per step. Without it
(below) the ranks take rows as fast as they can: the feeder's capacity.

The rows are pre-tokenized (real GPT-2 ids of c4_demo, concatenated into rows of exactly 2048 tokens,
in blocks of 64 rows with their ``unit_*`` position columns, as the packing stage writes them) and
materialized in Ray's object store before any clock starts, so tokenization and packing are not the
bound. In one run, over the same blocks:

* ``ceiling``: one plain ``ds.iter_batches()`` consumer in the driver (the Ray Data ceiling here);
* ``feeder``: ``pipelines.stream.feeder.Feeder`` serving the blocks as a given dataset (the path of
  ``build_trainer(cfg, train_dataset=ds)``: references + row ranges; ranks fetch and split rows);
* ``split`` (the peer): Ray Data's own per-rank path, ``ds.streaming_split(N, equal=True)``, which Ray Train
  gives each worker without the feeder; each rank iterates ``iter_batches(batch_size=8)`` (fresh rank actors).

The feeder before its rewrite (``to_pylist``, row-by-row mixing, pickled lists of ints) was compared here
as ``old`` until issue 41; its figures are in docs/benchmark_history.md.

Each rank is a Ray actor with ``1/N`` CPU (no torch: it does what ``StepFeed`` does before collation,
then concatenates the rows as the flash-attention ``flatten`` collate would). Per N: tokens/s delivered
to all ranks together, the feeder process's CPU-seconds per million tokens (``getrusage`` in the
feeder, every thread), the same for the whole process tree (raylet, GCS, feeder, ranks), p50/p99 of
a rank's wait per step, and the feeder's peak RSS. Prints a markdown table and ``RESULT {json}``.

Before each clock: every rank has received the feeder's handle (its first use loads the actor's class,
~0.3 s per rank here), the stream's execution has started and its first block is in hand (the
ceiling's too), and the machine is quiet (``benchlib.wait_quiet``: Ray keeps starting worker
processes after actors are created; at N = 2 two of them took 1.7 of a 1.5 s run's 3.0 CPU-s).
With 32 or 64 rank actors alive the machine never gets quiet (their idle processes kept 21-55% of
the 2 cores busy in the 18:45 run); the wait then ends after 10 s, and "busy before" says how busy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchlib import TreeRSS, figures, headline, wait_quiet  # noqa: E402

from pipelines.ray_local import init_local  # noqa: E402
from pipelines.sources.listing import make_sample_id  # noqa: E402
from pipelines.stream.client import FeederClient  # noqa: E402
from pipelines.stream.feeder import Feeder, feeder_concurrency  # noqa: E402

SEQ, K, BLOCK_ROWS = 2048, 8, 64
SHARED = Path(os.environ.get("PIPELINES_SHARED_DATA", ROOT.parent / "shared" / "data"))
C4 = SHARED / "text" / "c4_demo.jsonl"
GPT2 = SHARED / "tokenizers" / "gpt2" / "tokenizer.json"
COLUMNS = ("input_ids", "labels", "position_ids", "sample_ids")
QUIET_TIMEOUT_S, QUICK_QUIET_TIMEOUT_S = 10.0, 2.0  # the longest wait for a quiet machine before a clock


# --------------------------------------------------------------------------- data


def corpus_tokens() -> tuple[np.ndarray, np.ndarray]:
    """GPT-2 ids of c4_demo, concatenated, and the document index of each token (before any clock)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(GPT2))
    texts = [json.loads(line)["text"] for line in C4.read_text(encoding="utf-8").splitlines() if line.strip()]
    encs = tok.encode_batch(texts)
    ids = [np.asarray(e.ids + [50256], dtype=np.int32) for e in encs]
    doc = np.concatenate([np.full(len(x), i, dtype=np.int64) for i, x in enumerate(ids)])
    return np.concatenate(ids), doc


def make_block(ids: np.ndarray, doc: np.ndarray, first_row: int, rows: int) -> pa.Table:
    """``rows`` packed rows of exactly SEQ tokens (a unit of the packing stage), with position columns."""
    tok = ids[: rows * SEQ].reshape(rows, SEQ)
    d = doc[: rows * SEQ].reshape(rows, SEQ)
    starts = np.concatenate([np.ones((rows, 1), bool), d[:, 1:] != d[:, :-1]], axis=1)
    pos = np.arange(SEQ)[None, :] - np.maximum.accumulate(np.where(starts, np.arange(SEQ)[None, :], 0), axis=1)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * SEQ)
    lst = lambda a: pa.ListArray.from_arrays(offsets, pa.array(a.reshape(-1).astype(np.int32)))  # noqa: E731
    sids = [make_sample_id(0, 0) + np.unique(r) for r in d]  # the documents in each row
    unit = make_sample_id(0, first_row)
    return pa.table({
        "input_ids": lst(tok), "labels": lst(tok), "position_ids": lst(pos),
        "sample_ids": pa.array([s.tolist() for s in sids], pa.list_(pa.int64())),
        "unit_id": pa.array([unit] * rows, pa.int64()), "unit_row": pa.array(range(rows), pa.int64()),
        "unit_rows": pa.array([rows] * rows, pa.int64()), "unit_start_byte": pa.array([-1] * rows, pa.int64()),
        "unit_end_row": pa.array([first_row + rows] * rows, pa.int64()),
        "unit_end_byte": pa.array([-1] * rows, pa.int64()),
    })


def make_dataset(total_rows: int) -> ray.data.Dataset:
    """A materialized dataset of ``total_rows`` packed rows in blocks of BLOCK_ROWS (object store)."""
    ids, doc = corpus_tokens()
    per = BLOCK_ROWS * SEQ
    reps = -(-per // len(ids)) + 1
    ids, doc = np.tile(ids, reps), np.tile(doc, reps)
    blocks, rng = [], np.random.default_rng(0)
    for b in range(0, total_rows, BLOCK_ROWS):
        start = int(rng.integers(0, len(ids) - per))
        rows = min(BLOCK_ROWS, total_rows - b)
        blocks.append(make_block(ids[start:], doc[start:], b, rows))
    return ray.data.from_arrow(blocks).materialize()


# --------------------------------------------------------------------------- systems


class GatedFeeder(Feeder):
    """The feeder, its stream started before the clock: ``prime()`` opens it (Ray Data's execution starts and
    the first block is in hand, as the ceiling's is), and its first block waits for ``go()`` (the clock's
    start), so the feeder has produced nothing ahead then. Also reports its process's CPU seconds (all
    threads) and peak RSS."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _open(self, i: int, state: Any):
        chunks, positions = super()._open(i, state)
        first = next(chunks)
        self.gate.wait()
        return itertools.chain([first], chunks), positions

    def prime(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._produce, daemon=True)
                self._thread.start()

    def go(self) -> None:
        self.gate.set()

    def usage(self) -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime, r.ru_maxrss / 1024.0  # MB (Linux: KB)


@ray.remote
class Rank:
    """A simulated training rank: fetch each step's rows, split them, concatenate (flatten collate)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        sys.path.insert(0, str(ROOT / "benchmarks"))

    def ready(self) -> bool:
        return True

    def connect(self, feeder: Any) -> None:
        """Receive the feeder's handle before the clock (a training rank gets it once, at start-up:
        its first use loads the actor's class, ~0.3 s here)."""
        self.feeder = feeder

    def run(self, feeder: Any, step_s: float = 0.0) -> dict[str, Any]:
        """Take every step; ``step_s`` > 0: then spend that long on it (the model's step; no CPU), as a rank at a
        set step time does, while the client's next request is in flight."""
        client = FeederClient(feeder, self.rank)
        waits, tokens, t0 = [], 0, time.perf_counter()
        while True:
            w0 = time.perf_counter()
            item = client.next()
            if item is None:
                break
            cols = item.columns(("input_ids", "labels", "position_ids")) if item.kind == "step" else None
            waits.append(time.perf_counter() - w0)
            if cols and cols["input_ids"]:
                flat = {k: np.concatenate(v) for k, v in cols.items()}  # the flatten collate, in numpy
                tokens += int(flat["input_ids"].size)
                _train(step_s, w0 + waits[-1])
        return {"tokens": tokens, "waits": waits, "start": t0, "end": time.perf_counter()}


    def prime_split(self, it: Any) -> int:
        """Ray Data's own per-rank path, ``ds.streaming_split(N)`` (what Ray Train hands each worker without the
        feeder): open this rank's iterator and take its first step's rows before the clock (the split's execution
        starts with them, as the feeder's stream starts before its clock); returns their tokens."""
        self.split = iter(it.iter_batches(batch_size=K, batch_format="numpy"))
        return self._tokens(next(self.split))

    @staticmethod
    def _tokens(batch: dict) -> int:
        col = batch["input_ids"]
        flat = np.concatenate(list(col)) if col.dtype == object else col.reshape(-1)  # the flatten collate
        return int(flat.size)

    def run_split(self, step_s: float = 0.0) -> dict[str, Any]:
        waits, tokens, t0 = [], 0, time.perf_counter()
        while True:
            w0 = time.perf_counter()
            batch = next(self.split, None)
            if batch is None:
                break
            waits.append(time.perf_counter() - w0)
            tokens += self._tokens(batch)
            _train(step_s, w0 + waits[-1])
        return {"tokens": tokens, "waits": waits, "start": t0, "end": time.perf_counter()}


def _train(step_s: float, since: float) -> None:
    """A step of ``step_s`` seconds that began when the rank had its rows (``since``): the rank's own work on
    them counts towards it, the rest is spent waiting as on a GPU."""
    if step_s > 0:
        time.sleep(max(0.0, since + step_s - time.perf_counter()))


def tree_cpu_s() -> float:
    """User + system CPU seconds of this process and all its descendants (Ray's raylet, GCS and
    every worker: the feeder, the ranks), as of now."""
    tree = TreeRSS(os.getpid())
    tree.sample()
    return tree.cpu_s


def _waits(res: list[dict[str, Any]]) -> dict[str, float]:
    """Each rank's wait for its rows, over every step of every rank: p50/p99 per step, and the share of each rank's
    own time (its first request to its last step) spent waiting, the mean over ranks: what a training run calls
    data wait."""
    waits = np.concatenate([r["waits"] for r in res])
    return {"wait_p50_ms": float(np.percentile(waits, 50) * 1e3), "wait_p99_ms": float(np.percentile(waits, 99) * 1e3),
            "data_wait_pct": float(np.mean([100 * sum(r["waits"]) / (r["end"] - r["start"]) for r in res])),
            "steps": int(max(len(r["waits"]) for r in res))}


def run_feeder(ds: ray.data.Dataset, ranks: list[Any], quiet_s: float, step_s: float = 0.0) -> dict[str, Any]:
    from pipelines.config import config_from_dict
    from pipelines.stream.spec import given_spec

    n = len(ranks)
    cfg = config_from_dict({"model": {"tokenizer": str(GPT2.parent)},
                            "data": {"datasets": [{"path": str(C4), "type": "completion"}]}})
    feeder = ray.remote(num_cpus=0, max_concurrency=feeder_concurrency(n))(GatedFeeder).remote(
        given_spec(cfg), n, n * K, 1, given=ds)
    ray.get(feeder.prime.remote())
    ray.get([r.connect.remote(feeder) for r in ranks])
    quiet = wait_quiet(timeout_s=quiet_s)
    cpu0, _ = ray.get(feeder.usage.remote())
    tree0 = tree_cpu_s()
    t0 = time.perf_counter()
    runs = [r.run.remote(feeder, step_s) for r in ranks]
    feeder.go.remote()
    res = ray.get(runs)
    wall = time.perf_counter() - t0
    tree = tree_cpu_s() - tree0
    cpu1, rss = ray.get(feeder.usage.remote())
    ray.kill(feeder)
    tokens = sum(r["tokens"] for r in res)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": tokens / wall,
            "cpu_s_per_m_tokens": (cpu1 - cpu0) / tokens * 1e6, "tree_cpu_s_per_m_tokens": tree / tokens * 1e6,
            "quiet_before": quiet, **_waits(res), "feeder_peak_rss_mb": rss}


def run_split(ds: ray.data.Dataset, ranks: list[Any], quiet_s: float, step_s: float = 0.0) -> dict[str, Any]:
    """The peer: ``ds.streaming_split(N, equal=True)`` (Ray Train's default for a train dataset), one iterator per
    rank, ``iter_batches(batch_size=8)`` each, the same flatten as the feeder's ranks. Its first step per rank is
    taken before the clock and counted (as the ceiling's first batch)."""
    its = ds.streaming_split(len(ranks), equal=True)
    first = sum(ray.get([r.prime_split.remote(it) for r, it in zip(ranks, its, strict=True)]))
    quiet = wait_quiet(timeout_s=quiet_s)
    tree0 = tree_cpu_s()
    t0 = time.perf_counter()
    res = ray.get([r.run_split.remote(step_s) for r in ranks])
    wall = time.perf_counter() - t0
    tree = tree_cpu_s() - tree0
    tokens = first + sum(r["tokens"] for r in res)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": tokens / wall,
            "tree_cpu_s_per_m_tokens": tree / tokens * 1e6, "quiet_before": quiet, **_waits(res)}


def run_ceiling(ds: ray.data.Dataset, quiet_s: float) -> dict[str, Any]:
    """One plain ``ds.iter_batches()`` consumer in the driver (default batch size and format). Its first
    batch is taken before the clock (Ray Data's execution start, as for the feeders) and counted."""
    def count(batch: dict) -> int:
        col = batch["input_ids"]
        return int(col.size) if col.dtype != object else sum(len(r) for r in col)

    batches = iter(ds.iter_batches())
    tokens = count(next(batches))
    wait_quiet(timeout_s=quiet_s)
    t0 = time.perf_counter()
    for batch in batches:
        tokens += count(batch)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": tokens / wall}


# --------------------------------------------------------------------------- main


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [int(n) for n in results["per_n"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("feeder", "feeder (refs + row ranges)"),):
        ax.plot(ns, [results["per_n"][str(n)][key]["tokens_per_s"] / 1e6 for n in ns], "o-", label=label)
    ax.axhline(results["ceiling"]["tokens_per_s"] / 1e6, color="gray", ls="--", label="ds.iter_batches() ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated ranks N (8 rows x 2048 tokens per step each)")
    ax.set_ylabel("M tokens/s delivered (all ranks)")
    ax.set_title("feeder_scale: tokens/s vs N")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 2, 4 on a small stream (CI smoke)")
    ap.add_argument("--ns", default=None, help="comma list of N (default 2,8,32,64; quick 2,4)")
    ap.add_argument("--steps", type=int, default=None, help="steps at the largest N (default 48; quick 4)")
    ap.add_argument("--plot", default=None, help="PNG path (default benchmarks/results/feeder_scale.png; quick: a temp dir)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="ranks spend this long on each step (a set step time; default 0: as fast as they can). "
                         "Then every N gets its own stream of --steps steps (default 200) and the figure is data wait")
    args = ap.parse_args()
    if args.step_ms:
        return main_step_time(args)
    quiet_s = QUICK_QUIET_TIMEOUT_S if args.quick else QUIET_TIMEOUT_S
    if args.plot is None:
        import tempfile

        base = Path(tempfile.mkdtemp(prefix="feeder-scale-")) if args.quick else ROOT / "benchmarks" / "results"
        args.plot = str(base / "feeder_scale.png")
    ns = [int(x) for x in (args.ns or ("2,4" if args.quick else "2,8,32,64")).split(",")]
    steps = args.steps or (4 if args.quick else 48)
    total_rows = max(ns) * K * steps
    if not C4.is_file():
        print(f"not available: {C4} missing")
        return
    # Workers (feeders, ranks) import this script's classes by name.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ds = make_dataset(total_rows)
    out: dict[str, Any] = {"rows": total_rows, "tokens": total_rows * SEQ, "seq": SEQ, "rows_per_rank": K,
                           "load_avg_before": os.getloadavg()}
    out["ceiling"] = run_ceiling(ds, quiet_s)
    out["per_n"] = {}
    for n in ns:
        try:
            ranks = [Rank.options(num_cpus=1.0 / n).remote(r) for r in range(n)]
            ray.get([r.ready.remote() for r in ranks])
            out["per_n"][str(n)] = {"feeder": run_feeder(ds, ranks, quiet_s)}
            for r in ranks:
                ray.kill(r)
            ranks = [Rank.options(num_cpus=1.0 / n).remote(r) for r in range(n)]  # fresh ranks for the peer
            ray.get([r.ready.remote() for r in ranks])
            out["per_n"][str(n)]["split"] = run_split(ds, ranks, quiet_s)
            for r in ranks:
                ray.kill(r)
        except Exception as err:  # e.g. out of memory at large N: report it, keep the smaller N
            out["per_n"][str(n)] = {"error": repr(err)}
    out["load_avg_after"] = os.getloadavg()
    done = [n for n in ns if "error" not in out["per_n"][str(n)]]
    if done:
        per = [out["per_n"][str(n)]["feeder"] for n in done]
        out["largest_n"] = done[-1]
        out["largest_n_ratio"] = per[-1]["tokens_per_s"] / out["ceiling"]["tokens_per_s"]
        out["max_cpu_s_per_m_tokens"] = max(p["cpu_s_per_m_tokens"] for p in per)
        out["split_ratio"] = {str(n): out["per_n"][str(n)]["feeder"]["tokens_per_s"]
                              / out["per_n"][str(n)]["split"]["tokens_per_s"] for n in done}
        out["headline"] = [headline(f"B8 {n} ranks, delivered tokens (one run)", "M tok/s",
                                    *(figures(label, p["wall_s"], None, p["tokens_per_s"] / 1e6) for label, p in
                                      (("the feeder", per_n["feeder"]), ("ds.streaming_split(N)", per_n["split"]))))
                           for n in done for per_n in [out["per_n"][str(n)]]]
    ray.shutdown()
    print(f"rows {total_rows} x {SEQ} tokens = {total_rows * SEQ / 1e6:.1f} M tokens; each system reads them once per N; "
          f"load average before/after {out['load_avg_before'][0]:.1f}/{out['load_avg_after'][0]:.1f}")
    print(f"ceiling (one ds.iter_batches() consumer): {out['ceiling']['tokens_per_s'] / 1e6:.1f} M tokens/s")
    print()
    print("| N | system | M tokens/s (all ranks) | x ceiling | feeder CPU-s / M tokens | all processes CPU-s / M tokens "
          "| wait p50 / p99 ms | feeder peak RSS MB | busy before |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    ceiling = out["ceiling"]["tokens_per_s"]
    for n in ns:
        per = out["per_n"][str(n)]
        if "error" in per:
            print(f"| {n} | - | not run: {per['error'][:80]} | | | | | | |")
            continue
        for key in [k for k in ("feeder", "split") if k in per]:
            r = per[key]
            label = "feeder" if key == "feeder" else "ds.streaming_split(N) (peer)"
            feeder_cols = (f"{r['cpu_s_per_m_tokens']:.4f}", f"{r['feeder_peak_rss_mb']:.0f}") if key == "feeder" \
                else ("-", "-")
            print(f"| {n} | {label} | {r['tokens_per_s'] / 1e6:.2f} | {r['tokens_per_s'] / ceiling:.2f}x | "
                  f"{feeder_cols[0]} | {r['tree_cpu_s_per_m_tokens']:.3f} | "
                  f"{r['wait_p50_ms']:.1f} / {r['wait_p99_ms']:.1f} | {feeder_cols[1]} | "
                  f"{r['quiet_before']['busy']:.0%} |")
    for n, ratio in out.get("split_ratio", {}).items():
        print(f"N={n}: feeder / ds.streaming_split(N) = {ratio:.2f}x delivered tokens/s")
    if any("error" not in v for v in out["per_n"].values()):
        try:
            plot(out, Path(args.plot))
            print(f"\nplot: {Path(args.plot).relative_to(ROOT) if Path(args.plot).is_relative_to(ROOT) else args.plot}")
        except ImportError as err:
            print(f"no plot: {err}")
    print("RESULT " + json.dumps(out))


def main_step_time(args: argparse.Namespace) -> None:
    """B8 at a set step time: per N, a stream of exactly ``steps`` steps for N ranks that each spend ``step_ms`` on
    a step; the feeder and ``streaming_split(N)`` each serve it once. What matters then is not the rate (the
    step time sets it) but how long the ranks wait for their rows: data wait % of the run, p50/p99 per step."""
    ns = [int(x) for x in (args.ns or ("2,4" if args.quick else "8,64")).split(",")]
    steps = args.steps or (20 if args.quick else 200)
    step_s = args.step_ms / 1e3
    quiet_s = QUICK_QUIET_TIMEOUT_S if args.quick else QUIET_TIMEOUT_S
    if not C4.is_file():
        print(f"not available: {C4} missing")
        return
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    out: dict[str, Any] = {"step_ms": args.step_ms, "steps": steps, "seq": SEQ, "rows_per_rank": K,
                           "load_avg_before": os.getloadavg(), "per_n": {}}
    for n in ns:
        try:
            ds = make_dataset(n * K * steps)
            per: dict[str, Any] = {}
            for key, run in (("feeder", run_feeder), ("split", run_split)):
                ranks = [Rank.options(num_cpus=1.0 / n).remote(r) for r in range(n)]  # fresh ranks for each system
                ray.get([r.ready.remote() for r in ranks])
                per[key] = run(ds, ranks, quiet_s, step_s)
                for r in ranks:
                    ray.kill(r)
            out["per_n"][str(n)] = per
            del ds
        except Exception as err:  # e.g. out of memory at large N: report it, keep the smaller N
            out["per_n"][str(n)] = {"error": repr(err)}
    out["load_avg_after"] = os.getloadavg()
    ray.shutdown()
    print(f"{steps} steps of {K} rows x {SEQ} tokens per rank, {args.step_ms:g} ms a step; load average "
          f"before/after {out['load_avg_before'][0]:.1f}/{out['load_avg_after'][0]:.1f}\n")
    print("| N | system | data wait % | wait p50 / p99 ms | M tokens/s (all ranks) | demand M tokens/s "
          "| all processes CPU-s / M tokens | busy before |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    demand = {n: n * K * SEQ / step_s for n in ns}
    for n in ns:
        per = out["per_n"][str(n)]
        if "error" in per:
            print(f"| {n} | - | not run: {per['error'][:80]} | | | | | |")
            continue
        for key, label in (("feeder", "feeder"), ("split", "ds.streaming_split(N) (peer)")):
            r = per[key]
            print(f"| {n} | {label} | {r['data_wait_pct']:.2f} | {r['wait_p50_ms']:.1f} / {r['wait_p99_ms']:.1f} | "
                  f"{r['tokens_per_s'] / 1e6:.2f} | {demand[n] / 1e6:.2f} | {r['tree_cpu_s_per_m_tokens']:.3f} | "
                  f"{r['quiet_before']['busy']:.0%} |")
    done = [n for n in ns if "error" not in out["per_n"][str(n)]]
    # The opening table's rates are "higher is better": delivered tokens/s (the step time caps it; waiting lowers
    # it), with each system's data wait in its label.
    out["headline"] = [headline(f"B8 {n} ranks at a set step time ({args.step_ms:g} ms, {steps} steps; one run)",
                                "M tok/s", *(figures(f"{label}: data wait {p['data_wait_pct']:.2f}%", p["wall_s"], None,
                                                     p["tokens_per_s"] / 1e6) for label, p in
                                             (("the feeder", per_n["feeder"]),
                                              ("ds.streaming_split(N)", per_n["split"]))))
                       for n in done for per_n in [out["per_n"][str(n)]]]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
