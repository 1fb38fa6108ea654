"""Training metrics: one concise log line per ``train.log_every_steps``, metrics.jsonl and TensorBoard.

A logging window aggregates the steps since the last line, e.g. with ``log_every_steps: 10``::

    step 20/250 | loss 2.3141 | lr 2.85e-03 | grad_norm 0.912 | tok/s 4,812 | sup_tok 2,210 | pack 91.2% | data_wait 1.3%

* loss: mean over the window's supervised tokens (each step's loss is already a global token mean),
* tok/s: all ranks' real (unpadded) tokens / wall time of the window,
* sup_tok: supervised tokens per step (all ranks), averaged over the window,
* pack: packing efficiency = real tokens / (rows * sequence_len),
* data_wait: time the ranks spent blocked on the data iterator / window time (mean over ranks).

The train record also holds (metrics.jsonl and the trackers, not the line) ``mix_share``, each source's
share of the tokens the epoch took so far (``data.mix_by`` units), and ``data_quality``, the counters so
far (records read and skipped, samples truncated and dropped, ...), as the feeder reports them.

The same numbers go to ``<run dir>/metrics.jsonl`` (one JSON object per line, ``"kind": "train"``,
``"eval"``, ``"resume"`` or ``"summary"``) and to the trackers of ``run.loggers`` (TensorBoard under
``<run dir>/tensorboard`` by default; W&B, MLflow: :mod:`pipelines.train.trackers`). Only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from pipelines.config import Config
from pipelines.stats import packing_efficiency
from pipelines.train.step import StepStats
from pipelines.train.storage import OutputDir
from pipelines.train.trackers import Trackers


@dataclass
class Window:
    """Running sums for the steps since the last log line."""

    steps: int = 0
    loss_x_tokens: float = 0.0
    supervised: int = 0
    tokens: int = 0
    rows: int = 0
    wait_s: float = 0.0
    time_s: float = 0.0
    last: StepStats | None = None

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.loss_x_tokens += s.loss * s.supervised_tokens
        self.supervised += s.supervised_tokens
        self.tokens += s.tokens
        self.rows += s.rows
        self.wait_s += s.data_wait_s
        self.time_s += s.step_time_s
        self.last = s

    def record(self, step: int, epoch: int, sequence_len: int, wait_s: float, time_s: float) -> dict[str, Any]:
        """The window as one flat metrics dict (plain floats/ints, safe for ray.train.report).

        ``wait_s``/``time_s``: data-wait and step time summed over ranks (so the % is a mean over ranks).
        """
        assert self.last is not None, "empty window"
        return {
            "kind": "train",
            "step": step,
            "epoch": epoch,
            "loss": self.loss_x_tokens / max(self.supervised, 1),
            "lr": self.last.lr,
            "grad_norm": self.last.grad_norm,
            "tokens_per_s": self.tokens / max(self.time_s, 1e-9),
            "supervised_tokens": self.supervised / self.steps,
            "tokens": self.tokens,
            "packing_efficiency": packing_efficiency(self.tokens, self.rows * sequence_len) or 0.0,
            "data_wait_pct": 100.0 * wait_s / max(time_s, 1e-9),
            "step_time_s": self.time_s / self.steps,
        }


def format_line(rec: dict[str, Any], max_steps: int | None) -> str:
    """The concise human line for a train record (see the module docstring)."""
    total = f"/{max_steps}" if max_steps else ""
    return (
        f"step {rec['step']}{total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
        f"grad_norm {rec['grad_norm']:.3f} | tok/s {rec['tokens_per_s']:,.0f} | "
        f"sup_tok {rec['supervised_tokens']:,.0f} | pack {100 * rec['packing_efficiency']:.1f}% | "
        f"data_wait {rec['data_wait_pct']:.1f}%"
    )


class MetricsWriter:
    """Writes metrics.jsonl into the run directory and hands every record to the trackers of
    ``run.loggers`` (:class:`pipelines.train.trackers.Trackers`); rank 0 only, a no-op elsewhere."""

    def __init__(self, out: OutputDir | None, cfg: Config | None = None, run_dir: str = ""):
        self.out = out
        self.trackers: Trackers | None = None
        if out is not None:
            self._jsonl = open(os.path.join(out.local, "metrics.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
            if cfg is not None:
                self.trackers = Trackers(cfg, run_dir, out.local)

    def write(self, rec: dict[str, Any]) -> None:
        """One record: a line of metrics.jsonl (with ``time``, the wall clock) and the trackers' scalars."""
        if self.out is None:
            return
        self._jsonl.write(json.dumps({**rec, "time": round(time.time(), 3)}) + "\n")
        self._jsonl.flush()
        if self.trackers is not None:
            self.trackers.log(rec)

    def sync(self) -> None:
        if self.out is not None:
            self.out.sync()

    def close(self) -> None:
        if self.out is None:
            return
        self._jsonl.close()
        if self.trackers is not None:
            self.trackers.close()
        self.out.sync()


def read_metrics(local_dir: str) -> list[dict[str, Any]]:
    """The records of ``<local_dir>/metrics.jsonl`` so far (``[]`` when there is none; a torn last line is skipped)."""
    path = os.path.join(local_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # the line a killed rank 0 was writing
    return out


def recovery_record(earlier: list[dict[str, Any]], fit_id: str, resumed_step: int, saved_world: int | None,
                    world: int, now: float) -> dict[str, Any] | None:
    """What a restart of this fit's worker group cost, from rank 0's records before it (``earlier``).

    The last train record of the attempt before the restart is the last step known trained (logged every
    ``train.log_every_steps``); ``steps_redone`` counts the steps after the checkpoint up to it, and
    ``time_lost_s`` the wall time from it to the first step after the restart (``now``), which includes
    noticing the fault, placing the workers again, building the engine and loading the checkpoint.
    ``None`` when nothing was logged since the restored step (no measure).
    """
    starts = [i for i, r in enumerate(earlier) if r.get("kind") == "params"]  # each attempt starts with one
    attempt = earlier[starts[-1]:] if starts else earlier
    last = next((r for r in reversed(attempt) if r.get("kind") == "train" and "time" in r), None)
    if last is None:
        return None
    return {"kind": "recovery", "fit_id": fit_id, "step": resumed_step, "from_workers": saved_world,
            "to_workers": world, "resized": saved_world is not None and saved_world != world,
            "last_logged_step": last["step"], "steps_redone": max(0, last["step"] - resumed_step),
            "time_lost_s": round(now - last["time"], 1)}


# --------------------------------------------------------------------------- start-up lines and summary


class Clock:
    """Seconds since the job started (the driver's ``time.time()``), with named marks.

    Rank 0 prints its start-up lines against it, e.g. ``[  24.1s] engine ready: ...``, so the
    driver's and rank 0's lines share one time axis.
    """

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.marks: dict[str, float] = {}

    def now(self) -> float:
        return time.time() - self.started_at

    def mark(self, name: str) -> float:
        self.marks[name] = self.now()
        return self.marks[name]

    def at(self, name: str) -> float:
        return self.marks[name]

    def between(self, a: str, b: str) -> float:
        return self.marks[b] - self.marks[a] if a in self.marks and b in self.marks else 0.0


def startup_line(t: float, phase: str, detail: str = "", took: float | None = None) -> str:
    """``[  12.3s] first step: loss 5.61 (0.5s)``: ``t`` seconds since the job started."""
    return f"[{t:7.1f}s] {phase}" + (f": {detail}" if detail else "") + (f" ({took:.1f}s)" if took is not None else "")


@dataclass
class RunTotals:
    """Sums over the steps of this fit (rank 0's times; token/row counts are global) and side-job times."""

    steps: int = 0
    tokens: int = 0
    rows: int = 0
    step_s: float = 0.0  # fetch + forward/backward + update, this rank
    wait_s: float = 0.0  # of which blocked on data
    first_batch_wait_s: float = 0.0
    first_step_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    checkpoints: int = 0
    export_s: float = 0.0

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.tokens += s.tokens
        self.rows += s.rows
        self.step_s += s.step_time_s
        self.wait_s += s.data_wait_s

    def packing_efficiency(self, sequence_len: int) -> float | None:
        return self.tokens / (self.rows * sequence_len) if self.rows else None

    def breakdown(self, clock: Clock) -> dict[str, float]:
        """Where the wall time went, seconds; the parts add up to ``total`` (``other`` is the rest)."""
        parts = {
            "start_workers": clock.marks.get("workers", 0.0),  # Ray start, trainer controller, worker group
            "start_engine": clock.between("workers", "engine"),  # process group, model, DeepSpeed init
            "start_restore_feeder": clock.between("engine", "loop"),  # checkpoint restore, feeder actor
            "first_batch_wait": self.first_batch_wait_s,  # the stream's start-up: read, tokenize, pack
            "first_step": self.first_step_s,
            "steps": self.step_s - self.wait_s - self.first_step_s,  # compute of steps 2..N
            "data_wait": self.wait_s - self.first_batch_wait_s,  # after the first batch
            "eval": self.eval_s,
            "checkpoint": self.checkpoint_s,
            "export": self.export_s,
        }
        total = clock.marks.get("end", clock.now())
        parts["other"] = total - sum(parts.values())  # logging, reports, loop overhead
        parts["total"] = total
        return {k: round(v, 2) for k, v in parts.items()}


def steady_step_s(summary: dict[str, Any]) -> float | None:
    """Mean compute time of steps 2..N (rank 0) from a summary record."""
    n = summary.get("steps_this_run", 0)
    return summary["time_s"]["steps"] / (n - 1) if n > 1 else None


def data_quality_line(counters: dict[str, int]) -> str:
    """``skipped 0, truncated 0, dropped 0`` (sums of the ``skipped_*``, ``truncated_samples``, ``dropped_*`` counters)."""
    skipped = sum(v for k, v in counters.items() if k.startswith("skipped_"))
    dropped = sum(v for k, v in counters.items() if k.startswith("dropped_"))
    return (f"skipped {skipped:,} records, truncated {counters.get('truncated_samples', 0):,} samples, "
            f"dropped {dropped:,} samples")


def format_summary(summary: dict[str, Any], extra_time: dict[str, float] | None = None) -> str:
    """The end-of-run block the job scripts print, from ``<run dir>/summary.json``.

    ``extra_time``: driver-side seconds to show after the worker's breakdown (e.g. the demo answers).
    """
    t = summary["time_s"]
    start = t["start_workers"] + t["start_engine"] + t["start_restore_feeder"]

    def loss(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    eff = summary.get("packing_efficiency")
    steady = steady_step_s(summary)
    lines = [
        "=" * 78,
        f"summary: {summary['step']:,} steps ({summary['steps_this_run']:,} this run), "
        f"{summary['tokens_this_run']:,} tokens this run, {t['total']:.1f}s to the exported model",
        f"  time:      start-up {start:.1f}s (Ray + workers {t['start_workers']:.1f}, engine {t['start_engine']:.1f}, "
        f"restore/feeder {t['start_restore_feeder']:.1f}) | first batch wait {t['first_batch_wait']:.1f}s | "
        f"first step {t['first_step']:.1f}s",
        f"             steps {t['steps']:.1f}s" + (f" ({steady:.2f}s/step)" if steady else "")
        + f" | data wait {t['data_wait']:.1f}s | eval {t['eval']:.1f}s | checkpoint {t['checkpoint']:.1f}s | "
        f"export {t['export']:.1f}s | other {t['other']:.1f}s"
        + "".join(f" | {k} {v:.1f}s" for k, v in (extra_time or {}).items()),
        f"  loss:      train {loss(summary.get('final_loss'))} | eval {loss(summary.get('final_eval_loss'))}",
        f"  packing:   {100 * eff:.1f}% of row capacity holds tokens" if eff is not None else "  packing:   -",
    ]
    if summary.get("data_quality"):
        lines.append(f"  data:      {data_quality_line(summary['data_quality'])}")
    for r in summary.get("recoveries") or []:  # restarts of the worker group (faults, lost nodes, elastic resizes)
        what = f"resized {r['from_workers']} -> {r['to_workers']}" if r["resized"] else "restarted"
        lines.append(f"  recovery:  {what} workers at step {r['step']}: {r['steps_redone']} steps redone, "
                     f"{r['time_lost_s']:.1f}s lost")
    lines += [
        f"  run dir:   {summary['run_dir']}",
        f"  checkpoint:{' ' if summary.get('checkpoint_path') else ''}{summary.get('checkpoint_path') or ' -'}",
    ]
    if summary.get("ledger_path"):
        lines.append(f"  ledger:    {summary['ledger_path']}")
    lines.append(f"  metrics:   {summary['metrics_path']}")
    lines += _load_lines(summary)
    lines.append("=" * 78)
    return "\n".join(lines)


def _load_lines(summary: dict[str, Any]) -> list[str]:
    """Where the exported model is and the code that loads it: a full (or merged) model with
    transformers, an adapter alone with peft on its base (see :mod:`pipelines.train.export`)."""
    model, adapter = summary.get("model_path"), summary.get("adapter_path")
    lines = [f"  adapter:   {adapter}"] if adapter else []
    if model and model != adapter:  # <run dir>/model: full fine-tuning or train.export_merged
        return lines + [
            f"  model:     {model}",
            "  load it:   from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"             model = AutoModelForCausalLM.from_pretrained({model!r})",
            f"             tokenizer = AutoTokenizer.from_pretrained({model!r})",
        ]
    if adapter:
        base = summary.get("base_model")
        return lines + [
            "  load it:   from peft import PeftModel; from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"             base = AutoModelForCausalLM.from_pretrained({base!r})" if base else
            "             base = <the model.init model, as built for training> (or set train.export_merged=true)",
            f"             model = PeftModel.from_pretrained(base, {adapter!r})",
            f"             tokenizer = AutoTokenizer.from_pretrained({adapter!r})",
        ]
    return lines + ["  model:     - (run.export_model=false)"]


def read_summary(run_dir: str, filesystem: Any = None) -> dict[str, Any]:
    """``<run dir>/summary.json`` (a local path or a URL; ``filesystem``: ``storage_filesystem(cfg)``)."""
    import pyarrow.fs as pafs

    if filesystem is not None:
        fs, path = filesystem, run_dir.split("://", 1)[-1]
    elif "://" in run_dir:
        fs, path = pafs.FileSystem.from_uri(run_dir)
    else:
        fs, path = pafs.LocalFileSystem(), os.path.abspath(run_dir)
    with fs.open_input_stream(f"{path}/summary.json") as f:
        return json.loads(f.read().decode("utf-8"))


def engine_summary(cfg: Any, te: Any) -> str:
    """``LlamaForCausalLM, trainable params 1,066,240 of 1,066,240 (100.00%), adapter none, DeepSpeed ZeRO-2,
    fp32, attention sdpa`` (the parameter counts are taken before DeepSpeed wraps the model, so ZeRO-3's
    partitioning does not hide them)."""
    return (f"{type(te.engine.module).__name__}, {te.params.line()}, adapter {te.adapter.type}, "
            f"DeepSpeed ZeRO-{te.zero_stage}, {'bf16' if cfg.train.bf16 else 'fp32'}, "
            f"attention {te.attn_implementation}")
