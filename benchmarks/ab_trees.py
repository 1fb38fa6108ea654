"""Before and after on one host: the same ``systems.py`` systems from two checkouts, interleaved.

Host speed varies from run to run here (BENCHMARKS.md: up to 2x between sessions), so a change's own
effect is measured by running the code before it and after it back to back, alternating, on the same
data. Each run is a fresh process of that checkout (``benchlib.run_system`` from its own tree, so its
``pipelines`` and Ray workers import that tree's code).

Example (the numbers in BENCHMARKS.md, "B1-B3 (run of 2026-12-03 07:45)")::

    git worktree add /tmp/before f011da6
    .venv/bin/python benchmarks/ab_trees.py /tmp/before . --data benchmarks/.work/data/alpaca_19980

``--data`` is the B2 data that ``benchmarks/run.py`` writes (20 JSONL shards of the Alpaca demo).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import benchlib as bl
from ingest import ours_params

KEYS = ("steady_tok_s", "e2e_tok_s", "encode_s", "python_s", "ttfb_s", "cpu_s_per_mtok", "error")
CHILD = """
import json, sys
root = sys.argv[1]
sys.path[:0] = [root, root + '/benchmarks']
import benchlib
name, params, env = json.loads(sys.argv[2])
r = benchlib.run_system(name, params, env=env)
print('AB ' + json.dumps(r))
"""


def systems(data: Path) -> dict[str, tuple[dict, dict | None]]:
    """``stage``: ours' stages in one process at 2 threads (as B1); ``ours``: ``build_dataset`` through Ray,
    default config (as B2)."""
    return {
        "stage": ({"tokenizer": str(bl.GPT2), "data": str(data)}, {"RAYON_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "true"}),
        "ours": (ours_params(data, 2), None),
    }


def run_once(tree: Path, name: str, params: dict, env: dict | None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), json.dumps([name, params, env])],
                         capture_output=True, text=True, cwd=tree, check=False).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("AB ")]
    return {k: v for k, v in json.loads(lines[-1][3:]).items() if k in KEYS} if lines else {"error": "no result"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path, help="checkout of the code before the change")
    ap.add_argument("after", type=Path, help="checkout of the code after it")
    ap.add_argument("--data", type=Path, required=True, help="a directory of Alpaca JSONL shards (run.py's B2 data)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default="stage,ours")
    args = ap.parse_args()
    chosen = {k: v for k, v in systems(args.data.resolve()).items() if k in args.systems.split(",")}
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, dict[str, list[dict]]] = {t: {s: [] for s in chosen} for t in trees}
    for rep in range(args.repeats):
        for tag, tree in trees.items():
            for name, (params, env) in chosen.items():
                r = run_once(tree, name, params, env)
                results[tag][name].append(r)
                print(rep, tag, name, json.dumps(r), flush=True)
    print("| system | code | steady tok/s (median) | end-to-end tok/s | first row s | encode s | Python CPU s "
          "| CPU s / M tok |")
    print("|---|---|---|---|---|---|---|---|")
    for name in chosen:
        for tag in trees:
            rs = [r for r in results[tag][name] if not r.get("error")]
            def med(key: str, rs: list[dict] = rs) -> str:
                vals = [r[key] for r in rs if r.get(key) is not None]
                return f"{statistics.median(vals):.3g}" if vals else "-"
            print(f"| {name} | {tag} | {med('steady_tok_s')} | {med('e2e_tok_s')} | {med('ttfb_s')} | {med('encode_s')} | "
                  f"{med('python_s')} | {med('cpu_s_per_mtok')} |")


if __name__ == "__main__":
    main()
