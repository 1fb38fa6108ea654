"""B2's ``ours`` with the tokenizer in an actor pool and inside the read tasks (``data.tokenize.placement``), interleaved.

    .venv/bin/python benchmarks/fused_stage.py [--repeats 5] [--data DIR]

* ``actors``: read tasks -> the tokenizer actor pool of ``data.tokenize`` (one actor on 2 CPUs);
* ``read_tasks``: the same ``TokenizeAndPack`` inside the read tasks (``pipelines.stream.dataset.read_task_stage``):
  no actor to start, and blocks never cross the object store between reading and tokenizing. Same threads,
  same environment, same concurrency (one task at a time on 2 CPUs). On 2 CPUs ``auto`` picks ``read_tasks``.

Interleaved, each run a fresh process (``benchlib.TreeRSS`` for the tree's CPU), on the B2 data
(``benchmarks/run.py`` writes it; ``--data``) with the B2 config (``ingest.ours_params``, 2 CPUs). Prints
the runs, the medians and a markdown table; the token count and packing efficiency must match.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

MODES = ("actors", "read_tasks")


def child(mode: str, params: dict[str, Any]) -> None:
    import systems

    overrides = params["data_overrides"]
    systems.emit(systems.sys_ours({**params, "data_overrides": {
        **overrides, "tokenize": {**overrides.get("tokenize", {}), "placement": mode}}}))


def run_once(mode: str, params: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, **bl.CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(bl.ROOT), str(bl.BENCH_DIR)])}
    proc = subprocess.Popen([bl.PY, __file__, "--child", mode, json.dumps(params)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=bl.ROOT, text=True, start_new_session=True)
    with bl.TreeRSS(proc.pid) as rss:
        out, err = proc.communicate(timeout=600)
    lines = [ln for ln in out.splitlines() if ln.startswith(bl.RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} run failed (exit {proc.returncode}): {err[-2000:]}")
    r = json.loads(lines[-1][len(bl.RESULT_TAG) :])
    return {"ttfb_s": r["ttfb_s"], "steady_tok_s": r["steady_tok_s"], "e2e_tok_s": r["e2e_tok_s"],
            "tokens": r["tokens"], "efficiency": r["efficiency"], "cpu_s_per_mtok": rss.cpu_s / (r["tokens"] / 1e6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data", type=Path, help="Alpaca JSONL shards (default: B2's, written if missing)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PARAMS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.child[1]))
        return
    from ingest import ours_params

    params = ours_params(args.data or bl.write_alpaca_jsonl(bl.DEFAULT_WORK, 20 * 999), 2)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in MODES:
            runs[mode].append(run_once(mode, params))
            print(rep, mode, json.dumps(runs[mode][-1]), flush=True)
    keys = ("ttfb_s", "steady_tok_s", "e2e_tok_s", "cpu_s_per_mtok")
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in keys} for m in MODES}
    same = {(r["tokens"], round(r["efficiency"], 6)) for m in MODES for r in runs[m]}
    print(f"\nmedians of {args.repeats} interleaved runs each; tokens and packing efficiency in every run: {sorted(same)}\n")
    print("| placement | first row s (after init) | steady tok/s | end-to-end tok/s | CPU s / M tok |")
    print("|---|---:|---:|---:|---:|")
    for m in MODES:
        print(f"| {m} | {med[m]['ttfb_s']:.2f} | {bl.fmt_rate(med[m]['steady_tok_s'])} | "
              f"{bl.fmt_rate(med[m]['e2e_tok_s'])} | {med[m]['cpu_s_per_mtok']:.2f} |")
    print("RESULT " + json.dumps({"runs": runs, "medians": med}))


if __name__ == "__main__":
    main()
