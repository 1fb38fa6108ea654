"""Does the streaming data path stall training? ``python benchmarks/train_stall.py [--steps N] [key=value ...]``.

Trains the same tiny model on CPU for the same number of steps twice, in one Ray instance:

1. fed by ``build_dataset`` the default way (``build_trainer(cfg)``: read -> tokenize (in the read tasks on 2 CPUs) ->
   packing, served per step by the exactly-once feeder, concurrently with training on the same CPUs),
2. fed by synthetic packed rows of the same shape (``sequence_len`` tokens, the same micro-batch),
   already in memory (``ray.data.from_items`` handed to the trainer): the data path at its fastest.

Both runs use the identical TorchTrainer/DeepSpeed loop; the numbers come from each run's
metrics.jsonl with the first logging window (start-up: pipeline spin-up, first compiles) left out.
Prints data-wait % of step time for both and ``steps/s(build_dataset) / steps/s(synthetic)``.
Target (issue 7): data wait < 5 % and ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchlib import figures, headline  # noqa: E402  (benchmarks/ is on the path: this runs as a script)


def _window_stats(run_dir: Path) -> dict[str, float]:
    """Steady-state numbers of one run: windows after the first."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"][1:]
    if not train:
        raise SystemExit(f"{run_dir}: too few steps for a steady-state window; raise --steps")
    step_time = statistics.fmean(r["step_time_s"] for r in train)
    return {
        "windows": len(train),
        "steps_per_s": 1.0 / step_time,
        "data_wait_pct": statistics.fmean(r["data_wait_pct"] for r in train),
        "data_wait_pct_max": max(r["data_wait_pct"] for r in train),
        "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in train),
        "packing_efficiency": statistics.fmean(r["packing_efficiency"] for r in train),
    }


def _run(cfg, dataset=None) -> tuple[dict[str, float], float]:
    from pipelines.train.trainer import build_trainer

    t0 = time.perf_counter()
    build_trainer(cfg, train_dataset=dataset).fit()
    return _window_stats(Path(cfg.run.storage_path) / cfg.run.name), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import ray

    from pipelines.config import load_config
    from pipelines.train.step import synthetic_rows

    out = Path(tempfile.mkdtemp(prefix="train_stall-"))
    base = [f"train.max_steps={args.steps}", f"train.log_every_steps={args.log_every}", "data.eval_fraction=0",
            "train.checkpoint_every_steps=null", "run.export_model=false", f"run.storage_path={out}", "run.resume=never"]
    cfg_real = load_config(args.config, [*base, "run.name=build_dataset", *args.overrides])
    cfg_syn = load_config(args.config, [*base, "run.name=synthetic", *args.overrides])

    from pipelines.ray_local import init_local
    init_local(include_dashboard=False, log_to_driver=False)
    real, real_wall = _run(cfg_real)
    tr = cfg_syn.train
    n_rows = args.steps * tr.micro_batch_size * tr.gradient_accumulation_steps * cfg_syn.scaling.num_workers
    rows = [{k: v.tolist() for k, v in r.items()}
            for r in synthetic_rows(n_rows + 64, cfg_syn.data.sequence_len, 260)]
    syn, syn_wall = _run(cfg_syn, ray.data.from_items(rows))
    ray.shutdown()

    ratio = real["steps_per_s"] / syn["steps_per_s"]
    print(f"\ntrain_stall: {args.steps} steps, {cfg_real.scaling.num_workers} CPU workers, "
          f"micro_batch {tr.micro_batch_size} x {cfg_real.data.sequence_len} tokens, windows of {args.log_every}")
    print(f"{'feed':<15}{'steps/s':>9}{'tok/s':>10}{'data wait %':>13}{'max wait %':>12}{'wall s':>8}")
    for name, s, wall in (("build_dataset", real, real_wall), ("synthetic", syn, syn_wall)):
        print(f"{name:<15}{s['steps_per_s']:>9.2f}{s['tokens_per_s']:>10,.0f}{s['data_wait_pct']:>13.2f}"
              f"{s['data_wait_pct_max']:>12.2f}{wall:>8.1f}")
    print(f"steps/s ratio build_dataset/synthetic: {ratio:.3f}  (target >= 0.95; data wait target < 5 %)")
    rows = [headline("B5 training on the stream's rows against synthetic rows (data wait: BENCHMARKS.md, B5)", "k tok/s",
                     # steady windows only: the walls hold each trainer's start, the first run's the longer
                     figures("build_dataset rows", None, None, real["tokens_per_s"] / 1e3),
                     figures("synthetic rows, no data work", None, None, syn["tokens_per_s"] / 1e3))]
    print("RESULT " + json.dumps({"build_dataset": real, "synthetic": syn, "ratio": ratio, "steps": args.steps,
                                  "headline": rows}))


if __name__ == "__main__":
    main()
