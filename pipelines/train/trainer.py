"""``build_trainer(cfg) -> ray.train.torch.TorchTrainer``: the public entry point for notebooks and jobs.

    cfg = load_config("configs/default.yaml", ["scaling.num_workers=2"])
    preflight(cfg)                     # cheap checks that need no cluster (the job scripts run it first)
    trainer = build_trainer(cfg)       # needs Ray (build_dataset creates the lazy ray.data pipeline)
    result = trainer.fit()

Mapping from the config: ``scaling.*`` -> ``ScalingConfig`` (``num_workers: [min, max]``: elastic); ``run.name``/``run.storage_path`` -> the
run directory; ``run.max_failures`` -> ``FailureConfig``; ``run.keep_checkpoints`` ->
``CheckpointConfig(num_to_keep)``. CPU workers use gloo and get ``DS_ACCELERATOR=cpu`` in their
runtime env; GPU workers use NCCL.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from pipelines.config import Config
from pipelines.stream.spec import build_spec, given_spec
from pipelines.train.checkpoint import check_resume
from pipelines.train.loop import payload, train_loop_per_worker
from pipelines.train.preflight import preflight
from pipelines.train.storage import ray_storage, storage_root

if TYPE_CHECKING:
    import ray.data
    from ray.train.torch import TorchTrainer


def has_eval(cfg: Config) -> bool:
    """An eval split exists when eval datasets or a held-out fraction are configured."""
    return bool(cfg.data.eval_datasets or cfg.data.eval_fraction)


def _worker_env(use_gpu: bool) -> dict[str, Any] | None:
    """Worker environment: DeepSpeed's CPU accelerator on CPU workers, and ``PIPELINES_FAULTS`` when set
    (:mod:`pipelines.train.faults`)."""
    from pipelines.train.faults import ENV as FAULTS_ENV

    env = {} if use_gpu else {"DS_ACCELERATOR": "cpu"}
    if os.environ.get(FAULTS_ENV):
        env[FAULTS_ENV] = os.environ[FAULTS_ENV]
    return {"env_vars": env} if env else None


def scaling_config(cfg: Config):  # -> ray.train.ScalingConfig
    """``scaling.*`` as Ray Train's ``ScalingConfig``; ``num_workers: [min, max]`` is an elastic worker group
    (Ray Train's ``ElasticScalingPolicy``), checked for growth every ``scaling.resize_check_s``."""
    import ray.train

    s = cfg.scaling
    return ray.train.ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu,
                                   resources_per_worker=s.resources_per_worker,
                                   elastic_resize_monitor_interval_s=s.resize_check_s)


def _min_workers_timeout(cfg: Config):  # -> pipelines.train.elastic.MinWorkersTimeout
    from pipelines.train.elastic import MinWorkersTimeout

    s = cfg.scaling
    resources = s.resources_per_worker or ({"CPU": 1.0, "GPU": 1.0} if s.use_gpu else {"CPU": 1.0})
    return MinWorkersTimeout(s.min_workers, s.min_workers_timeout_s, resources)


def _ingest_options(cfg: Config):  # -> ray.data.ExecutionOptions
    """Execution options for the datasets handed to Ray Train (eval).

    Passed explicitly: Ray Train's default (``DataConfig.default_ingest_options``) copies the driver's
    ``exclude_resources`` through the deprecated setter (a ``RayDeprecationWarning`` on every run) and
    drops the ``preserve_order`` that ``build_dataset`` set on the dataset for ``data.deterministic``.
    """
    from ray.data import DataContext, ExecutionOptions

    ctx = DataContext.get_current().execution_options
    return ExecutionOptions(resource_limits=ctx.resource_limits, preserve_order=cfg.data.deterministic,
                            verbose_progress=ctx.verbose_progress)


def build_trainer(
    cfg: Config,
    train_dataset: ray.data.Dataset | None = None,
    eval_dataset: ray.data.Dataset | None = None,
    *,
    started_at: float | None = None,
) -> TorchTrainer:
    """A ``TorchTrainer`` fed by the feeder: the configured training stream, or ``train_dataset`` (packed rows:
    ``input_ids``, ``labels``, ``position_ids``; with ``sample_ids`` and the ``unit_*`` columns, as
    ``build_dataset`` makes them, the ledger names the samples, else their row numbers). Eval reads
    ``eval_dataset``, or ``build_dataset(cfg, "eval")`` when an eval split is configured.

    ``started_at``: ``time.time()`` when the job started (the job scripts pass it); rank 0's start-up
    lines and the summary count seconds from it. Default: now.
    """
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    preflight(cfg)
    # Workers run in Ray's own working directories: a relative run.storage_path ("runs") is made
    # absolute here, against the driver's cwd, or rank 0 would write metrics/model somewhere else.
    cfg = cfg.model_copy(deep=True)
    cfg.run.storage_path = storage_root(cfg)
    # The training stream, worked out once for the whole fit (a restarted worker group streams the same files);
    # a given dataset is the one source of its own spec.
    spec = build_spec(cfg, "train") if train_dataset is None else given_spec(cfg)
    if eval_dataset is None and has_eval(cfg):
        from pipelines.stream.dataset import build_dataset

        eval_dataset = build_dataset(cfg, split="eval")
    check_resume(cfg, spec)  # refuse a data position that does not fit this stream, before any worker starts
    datasets: dict[str, Any] = {}
    if eval_dataset is not None:
        datasets["eval"] = eval_dataset
    for ds in (*datasets.values(), *([train_dataset] if train_dataset is not None else [])):
        ds.context.enable_progress_bars = cfg.run.progress_bars
        ds.context.print_on_execution_start = cfg.run.progress_bars
    if train_dataset is not None:  # its position is the rows taken: the order must be the same on a resume
        train_dataset.context.execution_options.preserve_order = cfg.data.deterministic
    use_gpu = cfg.scaling.use_gpu
    storage_path, storage_filesystem = ray_storage(cfg)
    run_config = ray.train.RunConfig(
        name=cfg.run.name,
        storage_path=storage_path,
        storage_filesystem=storage_filesystem,
        failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures),
        callbacks=[_min_workers_timeout(cfg)] if cfg.scaling.elastic else None,
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
        worker_runtime_env=_worker_env(use_gpu),
        logging_config=ray.train.LoggingConfig(log_level=cfg.run.ray_log_level),  # rank 0 prints our own lines
    )
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=payload(cfg, spec, fit_id=uuid.uuid4().hex, has_eval=eval_dataset is not None,
                                  given=train_dataset, started_at=time.time() if started_at is None else started_at),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=scaling_config(cfg),
        run_config=run_config,
        datasets=datasets or None,
        dataset_config=ray.train.DataConfig(execution_options=_ingest_options(cfg)),
    )
