"""Where B2's CPU goes once rows flow: cores used per process (and per thread of the busiest) through Ray;
and where the whole pass's CPU goes, Ray's start-up included.

    .venv/bin/python benchmarks/steady_cpu.py [--root CHECKOUT] [--data DIR] [--repeats 1]

One ``build_dataset`` pass over the B2 data (``benchmarks/run.py`` writes it; default config, 2 CPUs,
``ingest.ours_params``), iterated as B2's ``ours`` does. The CPU times of every process in the tree (and of
each thread) are read when the first packed row arrives and again at the end, so Ray's start-up is left
out: what remains is the steady state, in CPU-seconds and in cores (CPU-seconds over the wall time between
the two reads). On 2 CPUs the tokenizing read worker should hold close to 2 cores: its Rust tokenizer's
threads, and its own thread (read, Python per sample, packing). ``--root`` runs another checkout's
``pipelines`` (its driver and Ray's workers), to compare two versions of the code on one host. Prints a
table per run and a ``RESULT {json}`` line.

Each run's second table is the whole pass: every process's CPU time since it started, read when ``ray.init``
returns, at the first row and at the end; B2 counts the same CPU (the whole process tree, start-up included)
per million tokens. The driver's imports count in the first run; later runs in the same driver count its CPU
from their own start. Example line: ``0.92 = 0.34 + 0.55 + 0.03 ray::_AutoscalingCoordinatorActor``:
0.34 CPU-s by the end of ``ray.init``, 0.55 more until the first row, 0.03 after it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchlib import use_checkout

HERE = Path(__file__).resolve().parent


def label(cmdline: list[str]) -> str:
    """A process's short name: a Python script's file name, a Ray worker's title, or the program's name.

    Example: ``[".../python", "-u", ".../ray/_private/log_monitor.py", ...]`` -> ``log_monitor.py``;
    ``["ray::DataStats"]`` -> ``ray::DataStats``; ``[".../ray/gcs/gcs_server", ...]`` -> ``gcs_server``.
    """
    if not cmdline:
        return ""
    script = next((a for a in cmdline[1:] if a.endswith(".py")), None)
    return Path(script).name if script else Path(cmdline[0].split()[0]).name


def snapshot(procs: list[Any]) -> dict[int, tuple[float, str, dict[int, float]]]:
    """pid -> (CPU seconds, name, {thread id: CPU seconds}) for the live processes of ``procs``."""
    out = {}
    for pr in procs:
        try:
            c = pr.cpu_times()
            threads = {t.id: t.user_time + t.system_time for t in pr.threads()}
            out[pr.pid] = (c.user + c.system, label(pr.cmdline()) or pr.name(), threads)
        except Exception:  # noqa: BLE001 - a process that ended between listing and reading
            continue
    return out


def one_pass(data: Path, driver_cpu_before: float = 0.0) -> dict[str, Any]:
    """One pass; ``driver_cpu_before``: this process's CPU seconds before the pass, left out of the whole-pass
    numbers (0 for the first pass, whose imports count, as in B2's fresh process)."""
    import psutil
    import pyarrow.compute as pc
    import ray
    from benchlib import iter_ray_blocks
    from ingest import ours_params
    from systems import _ours_config

    from pipelines.ray_local import init_local
    from pipelines.stream.dataset import build_dataset

    cfg = _ours_config(ours_params(data, 2))
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    me = psutil.Process()
    tree = lambda: [me, *me.children(recursive=True)]  # noqa: E731
    at_init = snapshot(tree())
    ds = build_dataset(cfg)
    t0 = time.perf_counter()
    first = tokens = first_tokens = 0
    before: dict = {}
    for block in iter_ray_blocks(ds):
        n = int(pc.sum(pc.list_value_length(block["input_ids"])).as_py())
        if not first:
            first, first_tokens, before = time.perf_counter(), n, snapshot(tree())
        tokens += n
    end, after = time.perf_counter(), snapshot(tree())
    ray.shutdown()
    wall = end - first
    procs = []
    for pid, (cpu, name, threads) in after.items():
        cpu0, _, threads0 = before.get(pid, (0.0, "", {}))
        top = sorted(((v - threads0.get(t, 0.0)) for t, v in threads.items()), reverse=True)[:4]
        procs.append({"pid": pid, "name": name, "cpu_s": cpu - cpu0, "cores": (cpu - cpu0) / wall,
                      "top_threads_cpu_s": [round(x, 3) for x in top]})
    procs.sort(key=lambda p: -p["cpu_s"])
    total = sum(p["cpu_s"] for p in procs)
    own = {me.pid: driver_cpu_before}
    whole = [{"pid": pid, "name": name, "cpu_s": cpu - own.get(pid, 0.0),
              "at_init_s": at_init.get(pid, (0.0,))[0] - own.get(pid, 0.0),
              "at_first_row_s": before.get(pid, (0.0,))[0] - own.get(pid, 0.0)} for pid, (cpu, name, _) in after.items()]
    whole.sort(key=lambda p: -p["cpu_s"])
    return {"steady_tok_s": (tokens - first_tokens) / wall, "steady_wall_s": wall, "first_row_s": first - t0,
            "cpu_s": total, "cores": total / wall, "processes": procs[:8], "tokens": tokens,
            "whole_cpu_s": sum(p["cpu_s"] for p in whole), "whole": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=HERE.parent, help="checkout whose pipelines to run")
    ap.add_argument("--data", type=Path, default=HERE / ".work" / "data" / "alpaca_19980")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    import psutil

    data = args.data.resolve()
    root = use_checkout(args.root)
    results = []
    for k in range(args.repeats):
        r = one_pass(data, sum(psutil.Process().cpu_times()[:2]) if k else 0.0)
        results.append(r)
        print(f"steady {r['steady_tok_s'] / 1e6:.3f} M tok/s over {r['steady_wall_s']:.2f} s, first row "
              f"{r['first_row_s']:.2f} s, {r['cpu_s']:.2f} CPU-s = {r['cores']:.2f} cores")
        for p in r["processes"]:
            if p["cpu_s"] > 0.02:
                print(f"  {p['cpu_s']:6.2f} CPU-s {p['cores']:4.2f} cores  {p['name']}  threads {p['top_threads_cpu_s']}")
        print(f"whole pass: {r['whole_cpu_s']:.2f} CPU-s = {r['whole_cpu_s'] / (r['tokens'] / 1e6):.2f} per M tokens; "
              "per process, since it started = by the end of ray.init + until the first row + after it:")
        for p in r["whole"]:
            if p["cpu_s"] > 0.02:
                first = p["at_first_row_s"] - p["at_init_s"]
                print(f"  {p['cpu_s']:6.2f} = {p['at_init_s']:5.2f} + {first:5.2f} + {p['cpu_s'] - p['at_first_row_s']:5.2f}"
                      f"  {p['name']}")
    print("RESULT " + json.dumps({"root": str(root), "runs": results}))


if __name__ == "__main__":
    main()
