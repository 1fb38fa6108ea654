"""The Python every sample needs around the Rust tokenizer, measured step by step on B2's data, in one thread.

    .venv/bin/python benchmarks/python_floor.py [--data DIR] [--passes 3]

B2's ceiling is ``encode_batch_fast`` alone on 2 threads (B1). Any pipeline that goes through the
``tokenizers`` Python API also parses each JSON record, builds its prompt, turns each encoding's ids (a
list of Python ints) into an array and frees the encoding objects; on 2 cores that CPU competes with the
encoding. This script measures each of those steps apart (CPU seconds of this process, the encoding on one
Rust thread: ``RAYON_NUM_THREADS=1``), on B2's data (``benchmarks/run.py`` writes it): a lower bound on the
CPU that such a pipeline spends besides encoding. Steps, per pass over the records:

* ``json``: ``json.loads`` of every line;
* ``format``: the Alpaca prompt and trained spans (:class:`pipelines.sources.formats.AlpacaFormat`);
* ``encode``: ``encode_batch_fast``, 512 texts per call (the reference);
* ``ids``: ``[e.ids for e in encodings]`` and one ``np.fromiter`` into int32 (what ``Tokenizer._from_ids``
  does);
* ``free``: dropping the encoding objects (each holds its tokens' strings).

Prints a table and a ``RESULT {json}`` line; medians over ``--passes``.
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers builds its thread pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from itertools import chain  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
BATCH = 512
STEPS = ("json", "format", "encode", "ids", "free")


def one_pass(lines: list[str], tok: object, fmt: object) -> tuple[dict[str, float], int]:
    """CPU seconds per step for one pass over ``lines``, and the number of tokens."""
    cpu = dict.fromkeys(STEPS, 0.0)
    tokens = 0
    for start in range(0, len(lines), BATCH):
        c0 = time.process_time()
        recs = [json.loads(line) for line in lines[start:start + BATCH]]
        c1 = time.process_time()
        texts = [fmt(rec).text for rec in recs]
        c2 = time.process_time()
        encs = tok.encode_batch_fast(texts, add_special_tokens=True)
        c3 = time.process_time()
        raw = [e.ids for e in encs]
        n = sum(map(len, raw))
        flat = np.fromiter(chain.from_iterable(raw), np.int32, n)
        c4 = time.process_time()
        del encs
        c5 = time.process_time()
        del raw, flat
        tokens += n
        for key, dt in zip(STEPS, (c1 - c0, c2 - c1, c3 - c2, c4 - c3, c5 - c4), strict=True):
            cpu[key] += dt
    return cpu, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=HERE / ".work" / "data" / "alpaca_19980")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    from benchlib import GPT2, jsonl_files
    from tokenizers import Tokenizer

    from pipelines.config import DataConfig, DatasetConfig
    from pipelines.sources.formats import AlpacaFormat

    files = jsonl_files(args.data)
    if not files:
        raise SystemExit(f"no JSONL files in {args.data} (benchmarks/run.py writes B2's data there)")
    lines = [ln for f in files for ln in Path(f).read_text(encoding="utf-8").splitlines() if ln.strip()]
    tok = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
    ds = DatasetConfig(path=str(args.data), type="alpaca")
    fmt = AlpacaFormat(ds, DataConfig(datasets=[ds]), None)
    one_pass(lines[:BATCH], tok, fmt)  # warm-up
    runs = [one_pass(lines, tok, fmt) for _ in range(args.passes)]
    tokens = runs[0][1]
    med = {k: statistics.median(r[0][k] for r in runs) for k in STEPS}
    print(f"{len(lines)} records, {tokens} tokens, median of {args.passes} passes, 1 encode thread")
    print("| step | CPU-s per pass | ns per token | x encode |")
    print("|---|---:|---:|---:|")
    for k in STEPS:
        print(f"| {k} | {med[k]:.3f} | {med[k] / tokens * 1e9:.1f} | {med[k] / med['encode']:.3f} |")
    rest = sum(med[k] for k in STEPS if k != "encode")
    print(f"all but encode: {rest:.3f} CPU-s = {rest / med['encode']:.3f}x encode")
    print("RESULT " + json.dumps({"records": len(lines), "tokens": tokens, "cpu_s": med,
                                  "runs": [r[0] for r in runs]}))


if __name__ == "__main__":
    main()
