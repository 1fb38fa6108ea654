"""The throughput cost of ``data.deterministic`` (rows kept in read order), side by side in one run.

Same data (Alpaca demo as JSONL shards), GPT-2, bfd at 1024, the same tokenizer pool; the dataset is
iterated to the end with ``data.deterministic`` true and false, alternating, median of the repeats.

    .venv/bin/python benchmarks/determinism.py [--copies 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from resume import _data  # noqa: E402  (the same shards as B7)

SHARED = ROOT.parent / "shared" / "data"


def _run(path: Path, deterministic: bool) -> tuple[float, int]:
    from pipelines.config import config_from_dict
    from pipelines.stream.dataset import build_dataset

    cfg = config_from_dict({
        "model": {"tokenizer": str(SHARED / "tokenizers" / "gpt2")},
        "data": {"sequence_len": 1024, "packing": "bfd", "pack_buffer_size": 500, "deterministic": deterministic,
                 "datasets": [{"path": str(path), "type": "alpaca"}], "tokenize": {"num_actors": 1, "num_cpus": 1}},
    })
    t0 = time.perf_counter()
    tokens = 0
    for batch in build_dataset(cfg).iter_batches(batch_size=None, batch_format="pyarrow"):
        tokens += sum(len(x) for x in batch.column("input_ids").to_pylist())
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import ray

    data = _data(ROOT / "benchmarks" / ".work", args.copies)
    from pipelines.ray_local import init_local
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    times: dict[bool, list[float]] = {True: [], False: []}
    tokens = 0
    for _ in range(args.repeats):
        for det in (True, False):
            t, tokens = _run(data, det)
            times[det].append(t)
    ray.shutdown()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"data: {args.copies} JSONL shards x 999 Alpaca records, {tokens} tokens, GPT-2, bfd @1024; "
          f"median of {args.repeats}, end to end including tokenizer actor start-up")
    print("| data.deterministic | seconds | tokens/s |")
    print("|---|---:|---:|")
    print(f"| true | {on:.1f} | {tokens / on / 1e6:.3f} M |")
    print(f"| false | {off:.1f} | {tokens / off / 1e6:.3f} M |")
    print(f"cost of determinism: {100 * (on / off - 1):+.1f}% time")
    print("RESULT " + json.dumps({"deterministic_s": on, "free_order_s": off, "tokens": tokens}))


if __name__ == "__main__":
    main()
