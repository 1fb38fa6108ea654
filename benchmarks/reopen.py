"""Streams opened one after another in one process, as the feeder opens them (a stream per source and per epoch).

    .venv/bin/python benchmarks/reopen.py [--root CHECKOUT] [--sources 2] [--epochs 4] [--repeats 1]

One local Ray on 2 CPUs. For each epoch, for each source: ``build_dataset(cfg, epoch=e, datasets=[s])`` (what
``pipelines.stream.feeder.StreamPlan.open`` calls), read to the end, its counters checked against the rows read, and
the dataset kept (the feeder keeps every stream it opened, for its report). Reports the time from
``build_dataset`` to each stream's first packed row, and what is left at the end: the ``DataStats`` (counters)
worker processes and their summed RSS, and the process tree's size. Sources: one B2 shard each (999 Alpaca
records, ``benchmarks/run.py`` writes them), GPT-2, ``sequence_len`` 1024. ``--root`` runs another checkout's
``pipelines`` (its driver and Ray's workers), to compare two versions on one host. Prints a ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from benchlib import use_checkout

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("PIPELINES_SHARED_DATA", HERE.parents[1] / "shared" / "data"))


def one_run(data: Path, sources: int, epochs: int) -> dict[str, Any]:
    import psutil
    import ray
    from benchlib import iter_ray_blocks

    from pipelines.config import config_from_dict
    from pipelines.ray_local import init_local
    from pipelines.stream.dataset import build_dataset, data_report

    files = sorted(data.glob("*.jsonl"))[:sources]
    assert len(files) == sources, f"{data} holds {len(files)} JSONL shards, {sources} wanted"
    cfg = config_from_dict({"model": {"tokenizer": str(SHARED / "tokenizers" / "gpt2")},
                            "data": {"datasets": [{"path": str(f), "type": "alpaca"} for f in files],
                                     "sequence_len": 1024}})
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    me = psutil.Process()
    kept, first_row_s = [], []
    for epoch in range(epochs):
        for source in range(sources):
            t0 = time.perf_counter()
            ds = build_dataset(cfg, epoch=epoch, datasets=[source])
            kept.append(ds)
            rows = 0
            for block in iter_ray_blocks(ds):
                if not rows:
                    first_row_s.append(time.perf_counter() - t0)
                rows += block.num_rows
            assert data_report(ds)["counters"]["rows"] == rows > 0
    stats = [p for p in me.children(recursive=True) if "DataStats" in p.name()]
    res = {"first_row_s": [round(t, 3) for t in first_row_s], "streams": len(kept),
           "stats_processes": len(stats), "stats_rss_mb": round(sum(p.memory_info().rss for p in stats) / 2**20),
           "tree_processes": len(me.children(recursive=True))}
    ray.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=HERE.parent, help="checkout whose pipelines to run")
    ap.add_argument("--data", type=Path, default=HERE / ".work" / "data" / "alpaca_19980")
    ap.add_argument("--sources", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    data = args.data.resolve()
    root = use_checkout(args.root)
    runs = []
    for _ in range(args.repeats):
        r = one_run(data, args.sources, args.epochs)
        runs.append(r)
        later = sorted(r["first_row_s"][1:])
        print(f"{r['streams']} streams: first row {r['first_row_s'][0]:.2f} s (first stream), median "
              f"{later[len(later) // 2]:.2f} s (the others); left at the end: {r['stats_processes']} DataStats "
              f"process(es), {r['stats_rss_mb']} MB RSS; {r['tree_processes']} processes in the tree")
    print("RESULT " + json.dumps({"root": str(root), "runs": runs}))


if __name__ == "__main__":
    main()
