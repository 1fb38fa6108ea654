"""Where the time to the first packed row goes: one ``build_dataset`` run with timestamps per stage.

    .venv/bin/python benchmarks/ttfb_breakdown.py [--records-per-file 999] [--files 20]

Data: the Alpaca demo of ../shared/data replicated into JSONL files (one copy per file), GPT-2,
sequence_len 2048, the default tokenizer pool. The tokenizer actor class and the packing function
are wrapped (subclass / wrapper defined here, shipped by value) to append events to a file:
actor process up (constructor entered), tokenizer loaded, first block tokenized, first unit
packed; the driver adds ``ray.init`` done and the first row in its hands. Times are seconds after
``ray.init`` returned. Prints a table and a ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PIPELINES_SHARED_DATA", ROOT.parent / "shared" / "data"))
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

import pipelines.stream.dataset as dataset_mod  # noqa: E402
from pipelines.config import config_from_dict  # noqa: E402

EVENTS = Path(tempfile.gettempdir()) / f"pipelines-ttfb-{os.getpid()}.jsonl"


def event(name: str, path: str = str(EVENTS)) -> None:
    """Append ``name`` with the wall-clock time (workers and driver share the machine's clock)."""
    with open(path, "a") as f:
        f.write(json.dumps({"ev": name, "t": time.time(), "pid": os.getpid()}) + "\n")


class TimedTokenizeAndPack(dataset_mod.TokenizeAndPack):
    """The real tokenizer actor (tokenize, then pack), with its constructor and first call timed."""

    def __init__(self, *args, **kwargs) -> None:
        event("actor process up (constructor entered)")
        super().__init__(*args, **kwargs)
        event("tokenizer loaded")
        self._calls = 0

    def __call__(self, batch):
        first = self._calls == 0
        self._calls += 1
        if first:
            event("first block arrived at the tokenizer")
        tokenized = self.tokenizer(batch)
        if first:
            event("first block tokenized")
        out = self.packer(tokenized)
        if first:
            event("first block packed")
        return out


def make_data(work: Path, records_per_file: int, files: int) -> Path:
    rows = json.loads((SHARED / "sft" / "alpaca_en_demo.json").read_text())[:records_per_file]
    work.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        (work / f"part-{k:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records-per-file", type=int, default=999)
    ap.add_argument("--files", type=int, default=20)
    args = ap.parse_args(argv)
    data = make_data(Path(tempfile.gettempdir()) / "pipelines-ttfb-data", args.records_per_file, args.files)
    dataset_mod.TokenizeAndPack = TimedTokenizeAndPack  # build_dataset's tokenizer stage picks it up
    EVENTS.unlink(missing_ok=True)
    cfg = config_from_dict({"model": {"tokenizer": str(SHARED / "tokenizers" / "gpt2")},
                            "data": {"datasets": [{"path": str(data), "type": "alpaca", "format": "jsonl"}],
                                     "sequence_len": 2048}})
    t0 = time.time()
    from pipelines.ray_local import init_local
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    t_init = time.time()
    # prefetch_batches=0, as B2 and the feeder: with batch_size=None, Ray's prefetch window of 1 holds each
    # block until the next one exists (0.5-0.8 s more on the first row here)
    batches = iter(dataset_mod.build_dataset(cfg).iter_batches(batch_size=None, prefetch_batches=0))
    next(batches)
    event("first row in the driver's hands")
    for _ in batches:
        pass
    t_end = time.time()
    ray.shutdown()
    seen: dict[str, float] = {}
    for line in EVENTS.read_text().splitlines():
        e = json.loads(line)
        seen.setdefault(e["ev"], e["t"] - t_init)  # the first occurrence of each event
    EVENTS.unlink(missing_ok=True)
    print(f"ray.init: {t_init - t0:.2f} s; whole pass {t_end - t_init:.2f} s after it\n")
    print("| event | s after ray.init | step s |")
    print("|---|---:|---:|")
    prev = 0.0
    for name, t in sorted(seen.items(), key=lambda kv: kv[1]):
        print(f"| {name} | {t:.2f} | {t - prev:.2f} |")
        prev = t
    print("RESULT " + json.dumps({"init_s": round(t_init - t0, 3), "events": {k: round(v, 3) for k, v in seen.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
