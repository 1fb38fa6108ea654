"""B7: resume latency by position in the epoch, ours vs skip-N-rows resumption.

For 10%, 50% and 90% of an epoch over the same data (a few large JSONL files, each the Alpaca demo replicated
``--copies`` times, ~0.86 MB a copy; GPT-2 tokenizer, bfd packing), each run in a Ray instance of its own:

* positions: one untimed pass over the stream takes the packed row at each fraction and the resume point a
  checkpoint right after it holds (``point_after`` of its ``unit_*`` columns, as the feeder makes it: the file,
  the unit's first record and its byte offset in that file, the unit's rows already trained), and the next
  row's samples. So the positions fall wherever the stream is then: deep inside a large file, at a byte offset.
* ours: that resume point -> ``build_dataset(start=...)`` -> time to the first row. Its samples must be the
  ones the pass saw next (a wrong seek fails the run, it is not timed);
* skip-based (what transformers' Trainer and many loaders do): ``build_dataset`` from the start, rows read
  and dropped until the position -> time to the first row after it.

Both are data-side latency: the model/optimizer restore is the same for both and not included.
Every run gets a Ray instance of its own, started before its clock and shut down after it, as a resumed
job does: so every position starts from the same state. Resumed one after another in one instance, a run's
first row depended on the worker processes the streams before it had left: Ray Data kills the worker of a
stream left halfway (``ray.cancel(force=True)``), and a run that had to start one took 0.7-1.3 s longer. Which
runs did was periodic in the order of the runs, so one position could be slow in all 5 of its runs (the
2026-12-05 21:14 full run: 0.66 s at 10%, 1.92 s at 50%, 1.2 s at 90%). The positions still take turns
(10, 50, 90, 10, ...), after an untimed run of each kind (imports in this process). Until 2026-12-07 every
position resumed at record 500 of a 1 MB file (20 files), so its 90%/10% ratio was ~1 by construction (issue 43).
Prints a markdown table and a ``RESULT {json}`` line (see benchmarks/README.md).

    .venv/bin/python benchmarks/resume.py [--quick] [--files 4] [--copies 16]
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


def _data(work: Path, files: int, copies: int) -> Path:
    """``files`` JSONL files, each ``copies`` copies of the Alpaca demo (999 records a copy)."""
    out = work / f"resume_{files}x{copies}"
    if out.exists():
        return out
    out.mkdir(parents=True)
    records = json.loads((SHARED / "sft" / "alpaca_en_demo.json").read_text())
    text = "".join(json.dumps(r) + "\n" for r in records)
    for k in range(files):
        (out / f"part-{k:03d}.jsonl").write_text(text * copies)
    return out


def _config(path: Path):
    from pipelines.config import config_from_dict

    return config_from_dict({
        "model": {"tokenizer": str(SHARED / "tokenizers" / "gpt2")},
        "data": {"sequence_len": 1024, "packing": "bfd", "pack_buffer_size": 500,
                 "datasets": [{"path": str(path), "type": "alpaca"}],
                 "tokenize": {"num_actors": 1, "num_cpus": 1}},
    })


def _positions(cfg, fracs: tuple[float, ...]) -> tuple[int, dict[float, dict]]:
    """One pass over the epoch: its packed rows, and per fraction the resume point of a checkpoint right after
    the row there (as the feeder takes it: ``point_after`` of the row's ``unit_*`` columns) and the samples of
    the row after it (what a resume must give first)."""
    from pipelines.stream.dataset import build_dataset
    from pipelines.stream.spec import build_spec
    from pipelines.stream.units import ROW_UNIT_FIELDS, point_after

    spec = build_spec(cfg, "train")
    file_pos = spec.file_positions(0)
    rows, table = 0, []
    for batch in iter_ray_blocks(build_dataset(spec)):
        table.append(batch.select([f for f, _ in ROW_UNIT_FIELDS] + ["sample_ids"]))
        rows += batch.num_rows
    import pyarrow as pa

    every = pa.concat_tables(table)
    out = {}
    for frac in fracs:
        at = int(frac * rows)
        row = {f: every.column(f)[at].as_py() for f, _ in ROW_UNIT_FIELDS}
        point = point_after(row, file_pos, 0)
        out[frac] = {"row": at, "point": point, "next": every.column("sample_ids")[at + 1].as_py()}
    return rows, out


def _ours(cfg, position: dict) -> float:
    """From the resume point of a checkpoint at the position: time to the first row, which must be the next."""
    from pipelines.stream.dataset import build_dataset

    ds = build_dataset(cfg, start=position["point"])
    t0 = time.perf_counter()
    first = next(iter(iter_ray_blocks(ds)))
    took = time.perf_counter() - t0
    got = first.column("sample_ids")[0].as_py()
    if got != position["next"]:
        raise RuntimeError(f"resumed at {position['point']}: first row's samples {got[:4]}..., the epoch's next row "
                           f"has {position['next'][:4]}...")
    return took


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
    ap.add_argument("--quick", action="store_true", help="2 files of 1 copy, 1 repeat (default: 4 files of 16 copies, "
                                                        "5 repeats)")
    ap.add_argument("--files", type=int, default=4, help="JSONL files (default 4)")
    ap.add_argument("--copies", type=int, default=16, help="copies of the Alpaca demo in each file (default 16: ~14 MB)")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / ".work"))
    args = ap.parse_args()
    import ray

    files, copies, repeats = (2, 1, 1) if args.quick else (args.files, args.copies, 5)
    data = _data(Path(args.work), files, copies)
    from pipelines.ray_local import init_local

    def fresh(fn):  # one run in a Ray instance of its own; the clock is inside fn
        init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            return fn()
        finally:
            ray.shutdown()

    cfg = _config(data)
    fracs = (0.1, 0.5, 0.9)
    total_rows, positions = fresh(lambda: _positions(cfg, fracs))
    runs: dict[str, dict[float, list[float]]] = {"ours": {f: [] for f in fracs}, "skip": {f: [] for f in fracs}}
    measure = {"ours": lambda f: _ours(cfg, positions[f]), "skip": lambda f: _skip(cfg, total_rows, f)}
    for system, run in measure.items():
        fresh(lambda run=run: run(fracs[0]))  # untimed: this process's imports of the run's code
        for _ in range(repeats):
            for frac in fracs:
                runs[system][frac].append(fresh(lambda run=run, frac=frac: run(frac)))
    res: dict[str, dict[str, object]] = {}
    for frac in fracs:
        ours, skip, point = runs["ours"][frac], runs["skip"][frac], positions[frac]["point"]
        res[f"{int(frac * 100)}%"] = {"ours_s": round(statistics.median(ours), 2), "skip_s": round(statistics.median(skip), 2),
                                      "ours_runs": [round(t, 2) for t in ours], "skip_runs": [round(t, 2) for t in skip],
                                      "row": positions[frac]["row"], "file_pos": point.file_pos, "record": point.row,
                                      "byte": point.byte, "skip_rows": point.skip_rows}
    mb = sum(f.stat().st_size for f in data.glob("*.jsonl")) / 1e6
    print(f"data: {files} JSONL files x {copies} x 999 Alpaca records ({mb:.0f} MB), {total_rows} packed rows of "
          f"1024, GPT-2; median of {repeats}, positions in turn, each run in a Ray instance of its own; time to the "
          "first row after resuming (start-up of the process that tokenizes included)")
    print("| position | resume point: file, record, byte offset, unit rows done | ours: seek (s) | skip N rows (s) "
          "| skip / ours | ours' runs (s) |")
    print("|---|---|---:|---:|---:|---|")
    for pos, r in res.items():
        print(f"| {pos} (row {r['row']}) | {r['file_pos']}, {r['record']}, {r['byte']:,}, {r['skip_rows']} | "
              f"{r['ours_s']} | {r['skip_s']} | {r['skip_s'] / max(r['ours_s'], 1e-9):.1f}x | {r['ours_runs']} |")
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
