"""Console output of the main job: start-up lines, one line per log step, the summary block, and no
deprecation noise from our own code.

The entry-point test runs ``ray_jobs/sft.py`` as a user would (its own local Ray, a few steps of a tiny
model) and checks the printed block against what the run wrote (summary.json, metrics.jsonl, files).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipelines.train.metrics import Clock, RunTotals, data_quality_line, format_summary
from pipelines.train.step import StepStats

ROOT = Path(__file__).resolve().parents[1]


def _stats(tokens: int, rows: int, step_s: float, wait_s: float) -> StepStats:
    return StepStats(loss=2.0, lr=1e-3, grad_norm=1.0, tokens=tokens, supervised_tokens=tokens // 2, rows=rows,
                     data_wait_s=wait_s, step_time_s=step_s)


def test_run_totals_breakdown_adds_up():
    clock = Clock(started_at=0.0)
    clock.marks.update(workers=10.0, engine=14.0, loop=15.0, end=40.0)
    t = RunTotals()
    for s in (_stats(1000, 4, 3.0, 2.5), _stats(900, 4, 1.0, 0.1), _stats(800, 4, 1.0, 0.2)):
        t.add(s)
    t.first_batch_wait_s, t.first_step_s = 2.5, 0.5
    t.eval_s, t.checkpoint_s, t.export_s = 1.0, 2.0, 3.0
    b = t.breakdown(clock)
    assert b["start_workers"] == 10.0 and b["start_engine"] == 4.0 and b["start_restore_feeder"] == 1.0
    assert b["steps"] == pytest.approx(5.0 - 2.8 - 0.5)  # compute of steps 2..3
    assert b["data_wait"] == pytest.approx(0.3)
    parts = sum(v for k, v in b.items() if k not in ("total",))
    assert parts == pytest.approx(b["total"]) and b["total"] == 40.0
    assert t.packing_efficiency(256) == pytest.approx(2700 / (12 * 256))


def test_data_quality_line_sums_counter_families():
    c = {"skipped_bad_record": 2, "skipped_no_trained_tokens": 1, "truncated_samples": 4, "truncated_tokens": 99,
         "dropped_oversize": 3, "dropped_no_trained_after_truncation": 1, "rows": 10}
    assert data_quality_line(c) == "skipped 3 records, truncated 4 samples, dropped 4 samples"


def test_format_summary_holds_the_values():
    rec = {"step": 300, "steps_this_run": 300, "tokens_this_run": 1_180_000, "final_loss": 0.6123,
           "final_eval_loss": 0.7011, "packing_efficiency": 0.9612, "data_quality": {"skipped_bad_record": 2},
           "run_dir": "/r/demo", "checkpoint_path": "/r/demo/checkpoint_00000300", "ledger_path": "/r/demo/ledger",
           "metrics_path": "/r/demo/metrics.jsonl", "model_path": "/r/demo/model",
           "time_s": {"start_workers": 20.0, "start_engine": 5.0, "start_restore_feeder": 1.0,
                      "first_batch_wait": 12.0, "first_step": 0.8, "steps": 149.5, "data_wait": 2.0, "eval": 1.0,
                      "checkpoint": 3.0, "export": 0.5, "other": 2.2, "total": 197.0}}
    text = format_summary(rec, {"demo answers": 4.0})
    assert "summary: 300 steps (300 this run), 1,180,000 tokens this run, 197.0s to the exported model" in text
    assert "start-up 26.0s" in text and "first batch wait 12.0s" in text and "(0.50s/step)" in text
    assert "train 0.6123 | eval 0.7011" in text and "96.1%" in text and "skipped 2 records" in text
    assert "demo answers 4.0s" in text
    for path in ("/r/demo", "/r/demo/checkpoint_00000300", "/r/demo/ledger", "/r/demo/metrics.jsonl"):
        assert path in text
    assert "AutoModelForCausalLM.from_pretrained('/r/demo/model')" in text


def test_format_summary_says_how_to_load_an_adapter_or_a_merged_model():
    rec = {"step": 4, "steps_this_run": 4, "tokens_this_run": 100, "run_dir": "/r/l",
           "metrics_path": "/r/l/metrics.jsonl", "time_s": {k: 1.0 for k in (
               "start_workers", "start_engine", "start_restore_feeder", "first_batch_wait", "first_step", "steps",
               "data_wait", "eval", "checkpoint", "export", "other", "total")}}
    alone = format_summary({**rec, "model_path": "/r/l/adapter", "adapter_path": "/r/l/adapter",
                            "base_model": "Qwen/Qwen2.5-0.5B"})
    assert "  adapter:   /r/l/adapter" in alone and "AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B')" in alone
    assert "PeftModel.from_pretrained(base, '/r/l/adapter')" in alone and "  model: " not in alone
    merged = format_summary({**rec, "model_path": "/r/l/model", "adapter_path": "/r/l/adapter", "base_model": None})
    assert "  adapter:   /r/l/adapter" in merged and "AutoModelForCausalLM.from_pretrained('/r/l/model')" in merged
    assert "PeftModel" not in merged
    assert "run.export_model=false" in format_summary(rec)


def test_worker_console_setup_reaches_ray_trains_report_logger():
    """Ray 2.60's per-report INFO line comes from a logger named by its file path, outside ``ray.train``
    (which LoggingConfig filters): the level is set on that logger, and a verbose level lets it through."""
    import logging

    from ray.train.v2._internal.execution import context as train_context

    from pipelines.console import setup_worker_console

    logger = train_context.logger
    before = logger.level
    try:
        setup_worker_console("WARNING")
        assert not logger.isEnabledFor(logging.INFO)
        setup_worker_console("INFO")
        assert logger.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(before)


# --------------------------------------------------------------------------- the entry point, end to end

# A warning line as Python prints it: "<file>:<line>: <Category>: message"
OURS = re.compile(r"(?:pipelines|ray_jobs)/[\w/]+\.py:\d+: \w*(?:DeprecationWarning|FutureWarning)")


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_entry_point_prints_clean_lines_and_a_true_summary(sft_job):
    assert sft_job.returncode == 0, sft_job.console[-4000:]
    check_console(sft_job.console, sft_job.run_dir)


def check_console(out: str, run: Path) -> None:
    """The console of a ``conftest.SFT_TINY`` run (stdout + stderr) against what it wrote to ``run``."""
    assert not OURS.findall(out), OURS.findall(out)
    assert "exclude_resources" not in out  # Ray Train's default ingest options, avoided in build_trainer
    assert "Reporting training result" not in out  # Ray Train's per-report dump from every rank
    assert "row/s]" not in out  # no Ray Data progress bars (run.progress_bars defaults to false)
    assert "Starting execution of Dataset" not in out and "Execution plan of Dataset" not in out  # nor its plan lines
    # Lines of other libraries a user cannot act on (pipelines/console.py), each seen in this console before:
    for noise in ("Progress bars disabled",  # Ray Data, once per process
                  " execution finished in ",  # Ray Data, per finished stream (the eval split's)
                  " built successfully",  # DeepSpeed's CPU communication op, every rank
                  "No CUDA runtime is found",  # torch, when DeepSpeed loads its CPU ops
                  "PreemptionWatcher",  # Ray Train's watcher's core_worker.cc line (a local instance has no drains)
                  "Writing model shards", "Loading weights",  # transformers 5's progress bars (export, demo answers)
                  "Started a local Ray instance", "Token authentication is enabled"):  # Ray's start-up, ours instead
        assert noise not in out, (noise, [line for line in out.splitlines() if noise in line][:3])
    assert re.search(r"^ray: local instance on 127\.0\.0\.1 \((dashboard http://127\.0\.0\.1:\d+, )?token authentication on; "
                     r"set RAY_ADDRESS to join a cluster\)$", out, re.M), out[:2000]

    for phase in ("config:", "cluster up:", "workers up:", "engine ready:", "first batch:", "first step:"):
        assert re.search(rf"\[\s*\d+\.\ds\] {phase}", out), phase
    assert re.search(r"engine ready: LlamaForCausalLM, trainable params [\d,]+ of [\d,]+ \(100\.00%\), adapter none", out)
    step_lines = re.findall(r"\] step (\d+)/6 \|", out)
    assert step_lines == ["2", "4", "6"], step_lines  # one line per log step, from rank 0 only

    summary = json.loads((run / "summary.json").read_text())
    train, evals = _records(run, "train"), _records(run, "eval")
    assert "\nsummary: " in out, out[-3000:]  # the block's first line (format_summary)
    block = out[out.index("\nsummary: "):]
    assert f"summary: 6 steps (6 this run), {sum(r['tokens'] for r in train):,} tokens this run" in block
    assert summary["tokens_this_run"] == sum(r["tokens"] for r in train)
    assert f"train {train[-1]['loss']:.4f} | eval {evals[-1]['eval_loss']:.4f}" in block
    seq = 256
    rows = sum(r["tokens"] / (r["packing_efficiency"] * seq) for r in train)
    assert summary["packing_efficiency"] == pytest.approx(sum(r["tokens"] for r in train) / (rows * seq), rel=1e-6)
    assert f"{100 * summary['packing_efficiency']:.1f}%" in block
    assert "skipped 0 records, truncated 0 samples, dropped 0 samples" in block
    t = summary["time_s"]
    assert t["total"] > 0 and sum(v for k, v in t.items() if k != "total") == pytest.approx(t["total"], abs=0.1)
    assert t["checkpoint"] > 0 and t["export"] > 0 and t["start_workers"] > 0
    assert f"start-up {t['start_workers'] + t['start_engine'] + t['start_restore_feeder']:.1f}s" in block
    assert f"checkpoint {t['checkpoint']:.1f}s | export {t['export']:.1f}s" in block
    ckpt, model = Path(summary["checkpoint_path"]), Path(summary["model_path"])
    assert ckpt == run / "checkpoint_00000006" and (ckpt / "trainer_state.json").is_file()
    assert (model / "config.json").is_file() and Path(summary["ledger_path"]).is_dir()
    for path in (str(run), str(ckpt), str(model), summary["ledger_path"]):
        assert path in block
    assert f"AutoModelForCausalLM.from_pretrained('{model}')" in block
    assert "demo answers (greedy decoding" in out
