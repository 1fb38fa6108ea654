"""The Ray Train ``train_loop_per_worker``: pulls each step's rows and runs :func:`train_step`.

Per worker::

    init process group + DeepSpeed engine          (step.py)
    restore checkpoint per run.resume              (checkpoint.py; its data_state is the feeder's position)
    rows: from the exactly-once feeder (feed.py)   -- one deterministic global stream, rank r takes the r-th
                                                       slice of each step: the spec's sources, mixed, or a
                                                       dataset given to build_trainer
    for each step: train_step -> log every log_every_steps, eval every eval_every_steps,
                   checkpoint (with the feeder's data state; the ledger gets the steps) every checkpoint_every_steps,
                   every checkpoint_every_minutes and on a preemption notice (triggers.py)
    final checkpoint, final eval, HF export, summary

Stopping rule: with ``train.max_steps`` the loop stops there and re-reads the stream (a new epoch)
whenever it ends first; without it, after ``train.epochs`` passes. ``train_step`` ends an epoch on all
ranks at the same step, so uneven shards never leave a rank waiting in a collective.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import torch.distributed as dist

from pipelines.config import Config, config_from_dict
from pipelines.console import setup_worker_console
from pipelines.storage import StorageOptions
from pipelines.stream.batch import batch_layout
from pipelines.stream.spec import StreamSpec
from pipelines.train.checkpoint import (
    ResumeSource,
    TrainerState,
    checkpoint_dir_name,
    report_checkpoint,
    restore,
    resume_source,
)
from pipelines.train.export import export_run
from pipelines.train.faults import maybe_fail
from pipelines.train.feed import EarlyFeeder, StepFeed
from pipelines.train.metrics import (
    Clock,
    MetricsWriter,
    RunTotals,
    Window,
    engine_summary,
    format_line,
    read_metrics,
    recovery_record,
    startup_line,
)
from pipelines.train.peers import naming_lost_peers
from pipelines.train.step import (
    BatchSource,
    TrainEngine,
    all_reduce_sum,
    build_engine,
    evaluate,
    init_distributed,
    train_step,
)
from pipelines.train.storage import OutputDir, is_remote, run_dir
from pipelines.train.triggers import CheckpointTriggers


def payload(cfg: Config, spec: StreamSpec, fit_id: str, has_eval: bool, given: Any = None,
            started_at: float | None = None) -> dict[str, Any]:
    """What the driver sends each worker: the config (rebuilt and re-validated there), the training stream's
    spec (built once in the driver, so a restarted worker group streams the same files), and ``given``, a
    dataset handed to the trainer (served by the feeder as the spec's one source). ``started_at``: the job's
    start (``time.time()``), the zero of rank 0's start-up lines and of the summary's time breakdown.
    """
    return {"cfg": cfg.model_dump(mode="json"), "base_dir": cfg.base_dir, "source": cfg.source, "spec": spec,
            "given": given, "fit_id": fit_id, "has_eval": has_eval,
            "started_at": time.time() if started_at is None else started_at}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker."""
    import ray.train

    cfg = config_from_dict(config["cfg"], source=config.get("source"), base_dir=config.get("base_dir"))
    setup_worker_console(cfg.run.ray_log_level)
    clock = Clock(config.get("started_at") or time.time())
    device = None
    if cfg.scaling.use_gpu:
        import ray.train.torch

        device = ray.train.torch.get_device()
    clock.mark("workers")  # Ray Train's worker group is up (and its process group joined)
    init_distributed(cfg.scaling.use_gpu, device)
    source = resume_source(cfg.run.resume, config["fit_id"], cfg.storage, run_dir(cfg))
    rank, world = dist.get_rank(), dist.get_world_size()
    with naming_lost_peers(rank, world):  # a surviving rank's error names the lost peer (pipelines.train.peers)
        early = EarlyFeeder(cfg, config["spec"], rank, world, batch_layout(cfg.train, cfg.scaling, world).step_rows,
                            f"{run_dir(cfg)}/ledger", source is None, config.get("given"))
        te = build_engine(cfg, load_universal=source is not None and source.layout.needs_universal(dist.get_world_size()))
        clock.mark("engine")
        state = restore(te, source, config["fit_id"])
        clock.mark("restore")
        if te.rank == 0:
            backend = "nccl" if cfg.scaling.use_gpu else "gloo"
            for line in (startup_line(clock.at("workers"), "workers up", f"{te.world_size} ranks ({backend})"),
                         startup_line(clock.at("engine"), "engine ready", engine_summary(cfg, te),
                                      took=clock.between("workers", "engine"))):
                print(line, file=sys.__stdout__, flush=True)
        eval_shard = ray.train.get_dataset_shard("eval") if config.get("has_eval") else None
        # Rank 0's feeder resumes from the checkpoint's data state (under run.on_data_change) before any training;
        # a step takes the run's global batch, whatever the world size (pipelines.stream.batch).
        feeder, state.epoch = early.share(te.rank, te.world_size, state.data_state, state.step, state.epoch)
        train = StepFeed(feeder, te.rank, cfg.train.micro_batch_size, te.collate_fn())
        clock.mark("feeder")
        WorkerLoop(cfg, te, state, train, eval_shard, clock, source).run()


class NoTrainingData(RuntimeError):
    """The stream ended while ``train.max_steps`` / ``train.epochs`` says steps remain."""


class WorkerLoop:
    """The epoch/step loop of one worker and its periodic side jobs (log, eval, checkpoint)."""

    def __init__(self, cfg: Config, te: TrainEngine, state: TrainerState, train: StepFeed, eval_shard=None,
                 clock: Clock | None = None, source: ResumeSource | None = None):
        self.cfg, self.te, self.state, self.source = cfg, te, state, source
        self.clock = clock or Clock(time.time())
        self.totals = RunTotals()
        self.train, self.eval_shard = train, eval_shard
        self.run_dir = run_dir(cfg)
        self.storage = StorageOptions.from_config(cfg.storage)
        self.out = OutputDir(self.run_dir, self.storage) if te.rank == 0 else None
        # This fit's earlier attempts, as rank 0 logged them (before this one appends): what a restart redid.
        self.earlier = read_metrics(self.out.local) if self.out is not None else []
        self.metrics = MetricsWriter(self.out, cfg, self.run_dir)
        self.window = Window()
        self.triggers = CheckpointTriggers(cfg.train.checkpoint_every_minutes, te.rank, te.device)
        self.last_record: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.last_checkpoint: str | None = None
        self.recovery: dict[str, Any] | None = None  # this attempt's recovery record (rank 0)
        self.checkpointed_step = -1
        self.steps_this_fit = 0
        # Markers of the faults PIPELINES_FAULTS injects (pipelines.train.faults): the run directory, or for
        # object-store runs a local folder of this fit.
        self.fault_dir = (os.path.join(tempfile.gettempdir(), "pipelines-faults", state.fit_id)
                          if is_remote(self.run_dir) else os.path.join(self.run_dir, ".faults"))

    # ----------------------------------------------------------------- main loop

    def run(self) -> None:
        self.clock.mark("loop")
        self.resumed_step = self.state.step
        params = self.te.params  # printed on rank 0's "engine ready" line (engine_summary)
        self.metrics.write({"kind": "params", "step": self.state.step, "trainable_params": params.trainable,
                            "total_params": params.total, "trainable_fraction": params.fraction,
                            "adapter": self.te.adapter.type})
        if self.state.step:  # restored from a checkpoint: mark it in metrics.jsonl
            saved = self.source.layout.world_size if self.source is not None else None
            self.metrics.write({"kind": "resume", "step": self.state.step, "epoch": self.state.epoch,
                                "world_size": self.te.world_size, "saved_world_size": saved})
        if self._done():
            self._print(f"step {self.state.step} already reached the end (train.max_steps/epochs); "
                        "set run.resume=never or a new run.name to train again")
        while not self._done():
            steps = self._epoch()
            if steps == 0:
                raise NoTrainingData(self._no_rows_message())
            if not self._hit_max_steps():
                self.state.epoch += 1
        if self.steps_this_fit and self.checkpointed_step != self.state.step:
            self._checkpoint()  # always end on a checkpoint, so a re-run resumes (or finds it is done)
        if self.eval_shard is not None and self.steps_this_fit and self.last_eval.get("step") != self.state.step:
            self._evaluate()  # final eval, unless eval_every_steps just did it
        model_path = self._export() if self.cfg.run.export_model else None
        self._summary(model_path)
        self.metrics.close()

    def _epoch(self) -> int:
        """One pass over this rank's shard (or until max_steps); returns the optimizer steps taken."""
        train = self.cfg.train
        source = BatchSource(self._feed_batches(self.train))
        steps = 0
        while not self._hit_max_steps():
            stats = train_step(self.te, source)
            if stats is None:
                break
            steps += 1
            self.steps_this_fit += 1
            self.state.step += 1
            self.state.tokens += stats.tokens
            self.window.add(stats)
            self.totals.add(stats)
            if self.steps_this_fit == 1:
                self._first_step_lines(stats)
            step = self.state.step
            maybe_fail(step, self.te.rank, self.te.world_size, self.fault_dir)
            if step % train.log_every_steps == 0 or self._hit_max_steps():
                self._log()
            if train.eval_every_steps and self.eval_shard is not None and step % train.eval_every_steps == 0:
                self._evaluate()
            why = self.triggers.due()  # collective: every minutes, or a preemption notice
            if why is not None or (train.checkpoint_every_steps and step % train.checkpoint_every_steps == 0):
                self._checkpoint(why)
        if self.window.steps:
            self._log()
        return steps

    @staticmethod
    def _feed_batches(feed: StepFeed):
        """Micro-batches of the feeder's step items until the epoch ends: each step item holds exactly
        ``gradient_accumulation_steps`` micro-batches for this rank (fewer, or none, in an epoch's
        last step), so :func:`train_step` consumes one item per optimizer step."""
        while (micro := feed.next_step()) is not None:
            yield from micro

    def _eval_batches(self):
        """Micro-batches of this rank's eval shard (Ray Data's ``iter_torch_batches``)."""
        train = self.cfg.train
        return self.eval_shard.iter_torch_batches(batch_size=train.micro_batch_size, collate_fn=self.te.collate_fn(),
                                                  prefetch_batches=train.prefetch_batches)

    def _no_rows_message(self) -> str:
        """Why a run that still has steps to take got none (an error: never reported as a success)."""
        t = self.cfg.train
        goal = f"train.max_steps={t.max_steps}" if t.max_steps is not None else f"train.epochs={t.epochs}"
        return (f"epoch {self.state.epoch}: the training stream yielded no rows at step {self.state.step}, "
                f"but {goal} says training is not done ({self.steps_this_fit} steps trained in this run). "
                "The data is empty, or the saved data position is at its end; nothing more was recorded "
                "as trained.")

    def _hit_max_steps(self) -> bool:
        return self.cfg.train.max_steps is not None and self.state.step >= self.cfg.train.max_steps

    def _done(self) -> bool:
        if self.cfg.train.max_steps is not None:
            return self._hit_max_steps()
        return self.state.epoch >= self.cfg.train.epochs

    # ----------------------------------------------------------------- side jobs

    def _log(self) -> None:
        wait_s, time_s = all_reduce_sum([self.window.wait_s, self.window.time_s], self.te.device)
        rec = self.window.record(self.state.step, self.state.epoch, self.cfg.data.sequence_len, wait_s, time_s)
        if self.te.rank == 0:  # per-source mix shares and data-quality counters, for metrics.jsonl and the trackers
            rec.update(self.train.telemetry())
        self.window = Window()
        self.last_record = rec
        self._print(startup_line(self.clock.now(), format_line(rec, self.cfg.train.max_steps)))
        self.metrics.write(rec)

    def _evaluate(self) -> None:
        t0 = time.perf_counter()
        res = evaluate(self.te, self._eval_batches(), self.cfg.train.eval_max_batches)
        self.totals.eval_s += time.perf_counter() - t0
        rec = {"kind": "eval", "step": self.state.step, **res}
        self._print(startup_line(self.clock.now(), f"eval step {self.state.step} | loss {res['eval_loss']:.4f} | "
                                 f"ppl {res['eval_perplexity']:.2f} | tokens {res['eval_tokens']:,}",
                                 took=time.perf_counter() - t0))
        self.metrics.write(rec)
        self.last_eval = {**res, "step": self.state.step}

    def _checkpoint(self, reason: str | None = None) -> None:
        """Checkpoint the step just taken; ``reason``: why now, for one that is not every N steps (logged)."""
        t0 = time.perf_counter()
        self.triggers.checkpointed()
        if self.te.rank == 0:
            # The feeder's position after the last step, stored as it is; the feeder also writes these
            # steps to the ledger.
            self.state.data_state = self.train.commit()
        self.metrics.sync()
        name = report_checkpoint(self.te, self.state, self._report_metrics(), self.cfg.run.checkpoint_upload)
        self.last_checkpoint = f"{self.run_dir}/{name}"
        self.checkpointed_step = self.state.step
        self.totals.checkpoint_s += time.perf_counter() - t0
        self.totals.checkpoints += 1
        why = f" ({reason})" if reason else ""
        self._print(startup_line(self.clock.now(), f"checkpoint step {self.state.step}{why} -> {self.last_checkpoint}",
                                 took=time.perf_counter() - t0))
        if reason:
            self.metrics.write({"kind": "checkpoint", "step": self.state.step, "reason": reason})

    def _report_metrics(self) -> dict[str, Any]:
        """Numbers for a checkpoint's ``ray.train.report`` (``Result.metrics``): the last train window + last eval.

        Only checkpoints are reported to Ray Train. Ray Train 2.x keeps the metrics of checkpoint reports
        alone (``Result.metrics`` is the latest checkpoint's), and a worker's report goes into a queue of one
        that the controller drains once per poll (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default):
        a report of metrics at every log line would hold each step to that poll (2 s a step with
        ``log_every_steps: 1``). The log lines, metrics.jsonl and the trackers carry every window.
        """
        merged = {**self.last_record, **self.last_eval, "step": self.state.step, "epoch": self.state.epoch}
        return {k: v for k, v in merged.items() if isinstance(v, (int, float))}

    def _export(self) -> str:
        t0 = time.perf_counter()
        path = export_run(self.te, self.cfg, self.run_dir, self.storage)
        self.totals.export_s += time.perf_counter() - t0
        return path

    def _first_step_lines(self, stats) -> None:
        """Start-up lines: when the first batch arrived (the stream's start-up) and the first step ended."""
        self.clock.mark("first_step")
        first_batch_at = self.clock.at("first_step") - stats.step_time_s + stats.data_wait_s
        self.totals.first_step_s = stats.step_time_s - stats.data_wait_s
        self.totals.first_batch_wait_s = stats.data_wait_s
        self._print(startup_line(first_batch_at, "first batch", f"{stats.rows} rows, {stats.tokens:,} tokens "
                                 "(the stream's start: tokenizer actors, read, tokenize, pack)",
                                 took=stats.data_wait_s))
        self._print(startup_line(self.clock.at("first_step"), "first step", f"loss {stats.loss:.4f}",
                                 took=self.totals.first_step_s))
        if self.source is not None and self.source.fit_id == self.state.fit_id:
            self._recovered()

    def _recovered(self) -> None:
        """Ray Train restarted this fit's worker group (a fault, a lost node, an elastic resize): log what it
        cost, from rank 0's last logged step before it (a log step, so the steps redone are counted from there)."""
        rec = recovery_record(self.earlier, self.state.fit_id, self.resumed_step, self.source.layout.world_size,
                              self.te.world_size, time.time())
        if rec is None or self.te.rank != 0:
            return
        self.recovery = rec
        self.metrics.write(rec)
        what = (f"resized {rec['from_workers']} -> {rec['to_workers']} workers" if rec["resized"]
                else f"restarted with {rec['to_workers']} workers")
        self._print(startup_line(self.clock.now(), f"{what}: resumed at step {rec['step']}, "
                                 f"{rec['steps_redone']} steps redone, {rec['time_lost_s']:.1f}s from the last "
                                 "logged step to this one"))

    def _data_quality(self) -> dict[str, Any]:
        """The feeder's data-quality counters (none for a given dataset)."""
        if self.te.rank != 0:
            return {}
        try:
            return self.train.report().get("counters", {})
        except Exception as err:  # noqa: BLE001  # the summary must not fail the run after the export
            self._print(f"(data-quality counters unavailable: {err!r})")
            return {}

    def _summary(self, model_path: str | None) -> None:
        self.clock.mark("end")
        rec = {
            "kind": "summary",
            "step": self.state.step,
            "steps_this_run": self.steps_this_fit,
            "world_size": self.te.world_size,
            "recoveries": [{k: v for k, v in r.items() if k != "time"} for r in self.earlier
                           if r.get("kind") == "recovery" and r.get("fit_id") == self.state.fit_id]
                          + ([self.recovery] if self.recovery else []),
            "epochs": self.state.epoch,
            "tokens": self.state.tokens,
            "tokens_this_run": self.totals.tokens,
            "wall_time_s": round(self.clock.at("end"), 1),
            "time_s": self.totals.breakdown(self.clock),
            "final_loss": self.last_record.get("loss"),
            "final_eval_loss": self.last_eval.get("eval_loss"),
            "packing_efficiency": self.totals.packing_efficiency(self.cfg.data.sequence_len),
            "data_quality": self._data_quality(),
            "trainable_params": self.te.params.trainable,
            "total_params": self.te.params.total,
            "adapter": self.te.adapter.type,
            "base_model": self.cfg.model.name_or_path,  # None for a model.init (random) base
            "run_dir": self.run_dir,
            "model_path": model_path,  # export_run's main path: <run dir>/model, or <run dir>/adapter
            "adapter_path": (f"{self.run_dir}/adapter" if model_path is not None and self.te.adapter.enabled
                             else None),
            "checkpoint_path": self.last_checkpoint or (f"{self.run_dir}/{checkpoint_dir_name(self.state.step)}"
                                                         if self.state.step else None),
            "ledger_path": f"{self.run_dir}/ledger",
            "metrics_path": f"{self.run_dir}/metrics.jsonl",
        }
        self.metrics.write(rec)
        if self.out is not None:
            with open(os.path.join(self.out.local, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(rec, f, indent=2)
        self._print(startup_line(rec["wall_time_s"], "done", f"step {rec['step']}, {rec['tokens_this_run']:,} tokens "
                                 f"this run; summary: {self.run_dir}/summary.json"))

    def _print(self, line: str) -> None:
        """Rank 0 prints to the process's real stdout (Ray forwards it to the driver once; the
        builtin ``print`` is patched by Ray Train V2 and would show each line twice)."""
        if self.te.rank == 0:
            print(line, file=sys.__stdout__, flush=True)

