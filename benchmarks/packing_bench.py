"""B4: packing efficiency and the share of truncated / dropped / split samples, per strategy.

Each real data set is tokenized once with this project's own stages (``iter_packed_local`` with
``packing: none`` and no length limit, so lengths and labels are exactly what the pipeline packs),
then packed at each sequence length with:

* ``bfd`` (ours): :func:`pipelines.stream.packing.pack_samples` on each packing unit, i.e. each run of
  ``pack_buffer_size`` consecutive records of a file, as ``build_dataset`` does (default 10000; a
  small buffer of 100 is shown too);
* greedy first-fit in arrival order (every bin stays open; what a streaming packer without a buffer does);
* first-fit decreasing over the whole data set (multipack-style samplers; needs the whole data set first);
* ``concat`` (:func:`pipelines.stream.packing.pack_samples` with ``concat``): samples are split across rows.

Oversize samples follow the pipeline's default policy (``truncate``) for every strategy but ``concat``.

    .venv/bin/python benchmarks/packing_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

SEQ_LENS = (512, 1024, 2048)
DATASETS = {"alpaca_en_demo": bl.ALPACA, "lima": bl.LIMA}
TOKENIZERS = {"gpt2": bl.GPT2, "smollm2-135m": bl.SMOLLM2}
BFD_DEFAULT, BFD_SMALL = "bfd (ours, pack_buffer_size 10000)", "bfd (pack_buffer_size 100)"
GREEDY, FFD, CONCAT = "greedy first-fit, arrival order", "FFD whole dataset (multipack)", "concat (ours)"
STRATEGIES = (BFD_DEFAULT, BFD_SMALL, GREEDY, FFD, CONCAT)
UNIT_RECORDS = {BFD_DEFAULT: 10000, BFD_SMALL: 100, CONCAT: 10000}


def tokenize_all(data_path: Path, tokenizer: Path) -> Any:
    """All samples of one file as :class:`pipelines.stream.packing.Samples`, in file order, untruncated."""
    from pipelines.config import config_from_dict
    from pipelines.stats import StatsSink
    from pipelines.stream.packing import Samples
    from pipelines.stream.stages import iter_packed_local

    cfg = config_from_dict({"model": {"tokenizer": str(tokenizer)},
                            "data": {"datasets": [{"path": str(data_path), "type": "alpaca"}],
                                     "packing": "none", "sequence_len": 1 << 30}})
    sids, ids, labels = [], [], []
    for table in iter_packed_local(cfg, "train", StatsSink()):
        sids += [s[0] for s in table.column("sample_ids").to_pylist()]
        for col, out in (("input_ids", ids), ("labels", labels)):
            arr = table.column(col).combine_chunks()
            off, val = arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False)
            out += [val[off[i] : off[i + 1]] for i in range(len(arr))]
    order = np.argsort(np.asarray(sids, dtype=np.int64), kind="stable")  # file order = arrival order
    return Samples(np.asarray(sids, dtype=np.int64)[order], [ids[i] for i in order], [labels[i] for i in order])


def _subset(s: Any, idx: np.ndarray | list[int]) -> Any:
    from pipelines.stream.packing import Samples

    return Samples(s.sample_ids[idx], [s.ids[i] for i in idx], [s.labels[i] for i in idx])


def _pack_units(s: Any, strategy: str, seq: int, buffer: int) -> tuple[list[np.ndarray], list[np.ndarray], Any]:
    """The pipeline's own packing, unit by unit: (row token arrays, row sample-id arrays, counts)."""
    from pipelines.stats import Counts
    from pipelines.stream.packing import PackOptions, pack_samples

    counts = Counts()
    rows_ids: list[np.ndarray] = []
    rows_sids: list[np.ndarray] = []
    for a in range(0, len(s.ids), buffer):
        rows = pack_samples(_subset(s, np.arange(a, min(a + buffer, len(s.ids)))), PackOptions(strategy, seq), counts)
        rows_ids += rows.ids
        rows_sids += rows.sample_ids
    return rows_ids, rows_sids, counts


def _fit(s: Any, seq: int) -> tuple[Any, Any]:
    from pipelines.stats import Counts
    from pipelines.stream.packing import PackOptions, fit_to_length

    counts = Counts()
    return fit_to_length(s, PackOptions("bfd", seq), counts), counts


def split_samples(rows_sample_ids: list[np.ndarray]) -> int:
    """Samples found in more than one row, counted from the rows themselves, e.g. rows ``[1, 2], [2, 3]`` -> 1."""
    seen = np.concatenate(rows_sample_ids) if rows_sample_ids else np.zeros(0, np.int64)
    return int((np.unique(seen, return_counts=True)[1] > 1).sum())


def measure(s: Any, seq: int) -> list[dict[str, Any]]:
    """One row per strategy for one tokenized data set at one sequence length."""
    from pipelines.stats import packing_efficiency

    n = len(s.ids)
    out = []
    for strategy in STRATEGIES:
        t0 = time.perf_counter()
        if strategy in UNIT_RECORDS:
            kind = "concat" if strategy == CONCAT else "bfd"
            rows_ids, rows_sids, counts = _pack_units(s, kind, seq, UNIT_RECORDS[strategy])
            row_lens = np.asarray([len(r) for r in rows_ids])
            split, c = split_samples(rows_sids), counts.counters
        else:
            fitted, counts = _fit(s, seq)
            lens = np.asarray([len(x) for x in fitted.ids])
            bins = bl.first_fit(lens, seq) if strategy == GREEDY else bl.ffd(lens, seq)
            row_lens = np.asarray([int(lens[b].sum()) for b in bins])
            split, c = split_samples([fitted.sample_ids[np.asarray(b, dtype=np.int64)] for b in bins]), counts.counters
        rows = len(row_lens)
        dropped = c.get("dropped_oversize", 0) + c.get("dropped_no_trained_after_truncation", 0)
        out.append({
            "strategy": strategy, "sequence_len": seq, "samples": n, "rows": rows,
            "efficiency": packing_efficiency(row_lens.sum(), rows * seq),
            "truncated_share": c.get("truncated_samples", 0) / n, "dropped_share": dropped / n,
            "split_share": split / n, "samples_per_row": n / rows if rows else None,
            "seconds": time.perf_counter() - t0, "row_lengths": row_lens.tolist(),
        })
    return out


def run_b4(quick: bool = False, verbose: bool = True) -> dict[str, Any]:
    """B4 results: ``{"rows": [...], "errors": [...]}`` (errors name what was not available)."""
    rows, errors = [], []
    datasets = {"alpaca_en_demo": bl.ALPACA} if quick else DATASETS
    for dname, dpath in datasets.items():
        for tname, tpath in TOKENIZERS.items():
            if not dpath.is_file() or not (tpath / "tokenizer.json").is_file():
                errors.append(f"{dname} / {tname}: not available (data or tokenizer missing)")
                continue
            if verbose:
                print(f"  B4 {dname} / {tname} ...", flush=True)
            try:
                s = tokenize_all(dpath, tpath)
                for seq in SEQ_LENS:
                    for r in measure(s, seq):
                        rows.append({"dataset": dname, "tokenizer": tname, **r})
            except Exception as err:  # the library under test is being changed; report, don't fail
                errors.append(f"{dname} / {tname}: not available ({type(err).__name__}: {err})")
    return {"rows": rows, "errors": errors}


def b4_table(res: dict[str, Any], dataset: str) -> tuple[list[str], list[list[Any]]]:
    headers = ["tokenizer", "seq", "strategy", "efficiency", "rows", "samples/row", "truncated", "dropped",
               "split across rows"]
    out = []
    for r in res["rows"]:
        if r["dataset"] != dataset:
            continue
        out.append([r["tokenizer"], r["sequence_len"], r["strategy"], _pct(r["efficiency"]), r["rows"],
                    r["samples_per_row"], _pct(r["truncated_share"]), _pct(r["dropped_share"]),
                    _pct(r["split_share"])])
    return headers, out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="B4 packing efficiency")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run_b4(args.quick)
    for d in sorted({r["dataset"] for r in res["rows"]}):
        print(f"\n{d}\n" + bl.md_table(*b4_table(res, d)))
    for e in res["errors"]:
        print(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
