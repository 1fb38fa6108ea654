"""B7: resume latency by position in the epoch, ours vs skip-N-rows resumption.

For 10%, 50% and 90% of an epoch over the same data (Alpaca demo replicated into JSONL shards,
GPT-2 tokenizer, bfd packing), each run in a Ray instance of its own:

* ours: the :class:`~pipelines.stream.dataset.ResumePoint` a checkpoint at that position holds (file,
  unit start, rows of the unit done) -> ``build_dataset(start=...)`` -> time to the first row;
* skip-based (what transformers' Trainer and many loaders do): ``build_dataset`` from the start,
  rows read and dropped until the position -> time to the first row after it.

Both are data-side latency: the model/optimizer restore is the same for both and not included.
Every run gets a Ray instance of its own, started before its clock and shut down after it, as a resumed
job does: so every position starts from the same state. Resumed one after another in one instance, a run's
first row depended on the worker processes the streams before it had left: Ray Data kills the worker of a
stream left halfway (``ray.cancel(force=True)``), and a run that had to start one took 0.7-1.3 s longer. Which
runs did was periodic in the order of the runs, so one position could be slow in all 5 of its runs (the
2026-12-05 21:14 full run: 0.66 s at 10%, 1.92 s at 50%, 1.2 s at 90%, although every position resumes at
the same place in its file). The positions still take turns (10, 50, 90, 10, ...), after an untimed run of
each kind (imports in this process). Prints a markdown table and a ``RESULT {json}`` line (see
benchmarks/README.md).

    .venv/bin/python benchmarks/resume.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchlib import figures, headline, iter_ray_blocks  # noqa: E402  (benchmarks/ is on the path: this runs as a script)

SHARED = ROOT.parent / "shared" / "data"


def _data(work: Path, copies: int) -> Path:
    """``copies`` JSONL shards of the Alpaca demo (999 records each)."""
    out = work / f"resume_{copies}"
    if out.exists():
        return out
    out.mkdir(parents=True)
    records = json.loads((SHARED / "sft" / "alpaca_en_demo.json").read_text())
    for k in range(copies):
        with open(out / f"part-{k:03d}.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return out


def _config(path: Path):
    from pipelines.config import config_from_dict

    return config_from_dict({
        "model": {"tokenizer": str(SHARED / "tokenizers" / "gpt2")},
        "data": {"sequence_len": 1024, "packing": "bfd", "pack_buffer_size": 500,
                 "datasets": [{"path": str(path), "type": "alpaca"}],
                 "tokenize": {"num_actors": 1, "num_cpus": 1}},
    })


def _first_row_s(ds) -> float:
    t0 = time.perf_counter()
    next(iter(iter_ray_blocks(ds)))
    return time.perf_counter() - t0


def _ours(cfg, n_files: int, frac: float) -> float:
    """Resume point of a checkpoint at ``frac``: the file there, second unit, 3 of its rows done."""
    from pipelines.stream.dataset import ResumePoint, build_dataset

    point = ResumePoint(epoch=0, file_pos=int(frac * n_files), row=500, byte=-1, skip_rows=3)
    return _first_row_s(build_dataset(cfg, start=point))


def _skip(cfg, total_rows: int, frac: float) -> float:
    from pipelines.stream.dataset import build_dataset

    target = int(frac * total_rows)
    t0 = time.perf_counter()
    seen = 0
    for batch in iter_ray_blocks(build_dataset(cfg)):
        seen += batch.num_rows
        if seen > target:
            break
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 shards, 1 repeat (default: 20 shards, 5 repeats)")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / ".work"))
    args = ap.parse_args()
    import ray

    copies, repeats = (4, 1) if args.quick else (20, 5)
    data = _data(Path(args.work), copies)
    from pipelines.ray_local import init_local

    def fresh(fn):  # one run in a Ray instance of its own; the clock is inside fn
        init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            return fn()
        finally:
            ray.shutdown()

    cfg = _config(data)
    from pipelines.stream.dataset import build_dataset

    total_rows = fresh(lambda: build_dataset(cfg).count())
    fracs = (0.1, 0.5, 0.9)
    runs: dict[str, dict[float, list[float]]] = {"ours": {f: [] for f in fracs}, "skip": {f: [] for f in fracs}}
    measure = {"ours": lambda f: _ours(cfg, copies, f), "skip": lambda f: _skip(cfg, total_rows, f)}
    for system, run in measure.items():
        fresh(lambda run=run: run(0.3))  # untimed: this process's imports of the run's code
        for _ in range(repeats):
            for frac in fracs:
                runs[system][frac].append(fresh(lambda run=run, frac=frac: run(frac)))
    res: dict[str, dict[str, object]] = {}
    for frac in fracs:
        ours, skip = runs["ours"][frac], runs["skip"][frac]
        res[f"{int(frac * 100)}%"] = {"ours_s": round(statistics.median(ours), 2), "skip_s": round(statistics.median(skip), 2),
                                      "ours_runs": [round(t, 2) for t in ours], "skip_runs": [round(t, 2) for t in skip]}
    print(f"data: {copies} JSONL shards x 999 Alpaca records, {total_rows} packed rows of 1024, GPT-2; "
          f"median of {repeats}, positions in turn, each run in a Ray instance of its own; time to the first row "
          "after resuming (start-up of the process that tokenizes included)")
    print("| position | ours: seek to unit (s) | skip N rows (s) | skip / ours | ours' runs (s) |")
    print("|---|---:|---:|---:|---|")
    for pos, r in res.items():
        print(f"| {pos} | {r['ours_s']} | {r['skip_s']} | {r['skip_s'] / max(r['ours_s'], 1e-9):.1f}x | {r['ours_runs']} |")
    ratio = res["90%"]["ours_s"] / max(res["10%"]["ours_s"], 1e-9)
    print(f"ours 90% / 10% = {ratio:.2f} (target <= 1.2)")
    rows = [headline(f"B7 resume at {pos} of the epoch: time to the first row", "-",
                     figures("ours: seek to the unit", None, r["ours_s"], None, r["ours_runs"]),
                     figures("skip the rows before it", None, r["skip_s"], None, r["skip_runs"])) for pos, r in res.items()]
    print("RESULT " + json.dumps({"positions": res, "ratio_90_10": round(ratio, 3), "headline": rows}))
    if args.quick:
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
