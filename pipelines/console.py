"""What the console shows: the lines of other libraries that a user cannot act on, kept out of it.

A job's console is rank 0's start-up, step and summary lines (:mod:`pipelines.train.metrics`) plus
whatever Ray forwards from its worker processes. Those processes also print, on every run:

* Ray Data, once per process: ``Progress bars disabled. To enable, set ...`` (we turn them off, see
  ``run.progress_bars``) and, per finished stream, ``Dataset eval_..._0 execution finished in 4.22
  seconds``;
* transformers 5: ``Writing model shards`` and ``Loading weights`` progress bars on every save and load;
* torch, on a machine without CUDA: ``No CUDA runtime is found, using CUDA_HOME=...`` when DeepSpeed
  loads its CPU ops (DeepSpeed's own ``... built successfully`` is caught at ``init_distributed``, see
  :func:`pipelines.train.step.init_distributed`);
* Ray Train's preemption watcher on a local single-machine instance (where no node is ever drained): a
  ``core_worker.cc`` error line about its constructor arguments;
* the job script's own process: Ray's start-up lines (:func:`quiet_driver`).

:func:`quiet_worker` is the ``worker_process_setup_hook`` of the job's runtime environment (every worker
process runs it before its first task; cluster/runtime_env.yaml sets it for ``ray job submit``);
:data:`LOCAL_ENV` goes into the environment of a local instance; :func:`setup_worker_console` runs first
in every Ray Train worker.
Only exact lines are removed: failures, warnings and everything else still show, and Ray Data's own log
file (``ray-data.log`` in the session directory) keeps every line.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["LOCAL_ENV", "SETUP_HOOK", "quiet_driver", "quiet_progress_bars", "quiet_worker", "setup_worker_console"]

SETUP_HOOK = "pipelines.console.quiet_worker"
# A local instance is one machine: Ray Train's preemption watcher (node drains) has nothing to watch there.
LOCAL_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


class _DropLines(logging.Filter):
    """Drops the records of one logger whose message contains one of ``parts``."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not any(p in msg for p in self.parts)


def _drop(logger: str, *parts: str) -> None:
    log = logging.getLogger(logger)
    if not any(isinstance(f, _DropLines) and f.parts == parts for f in log.filters):
        log.addFilter(_DropLines(*parts))


def quiet_progress_bars() -> None:
    """transformers' and huggingface_hub's progress bars off in this process (read when they are imported)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import sys

    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def quiet_driver() -> None:
    """The job script's own process, before it starts a local Ray: Ray's "Started a local Ray instance. View
    the dashboard at ..." and its "Token authentication is enabled for this Ray cluster ..." (Ray 2.60 turns
    it on for a local instance unless ``RAY_AUTH_MODE=disabled``) are replaced by the script's one line,
    which names the dashboard and whether token authentication is on."""
    _drop("ray._private.worker", "Started a local Ray instance")
    _drop("ray._private.authentication.authentication_token_setup", "Token authentication is enabled")


def quiet_worker() -> None:
    """Set up a Ray worker process so it prints only what a user can act on (see the module docstring)."""
    _drop("ray.data._internal.progress", "Progress bars disabled", "Progress bars for operators disabled")
    # The success line only ("... execution finished in 4.22 seconds"; a failure's is "... execution failed").
    _drop("ray.data._internal.execution.streaming_executor", " execution finished in ")
    _drop("torch.utils.cpp_extension", "No CUDA runtime is found")
    quiet_progress_bars()


def setup_worker_console(ray_log_level: str) -> None:
    """Worker-side console hygiene, called first in ``train_loop_per_worker`` (so in every worker process,
    before its first ``ray.train.report``).

    ``ray_log_level`` (``run.ray_log_level``) goes to the Ray Train logger that ``LoggingConfig`` misses.

    Ray Train V2 logs every ``ray.train.report`` at INFO from every rank ("Reporting training result
    N: TrainingReport(...)", the whole metrics dict). Ray 2.60 names that module's logger
    ``logging.getLogger(__file__)`` -- a file path, not ``ray.train.v2._internal.execution.context`` --
    so it sits outside the ``ray.train`` hierarchy that ``LoggingConfig(log_level=...)`` filters, and
    its records reach the worker's root console handler. The level is therefore set on that logger
    object itself (whatever its name). Our own line per log step (rank 0) replaces it.

    DeepSpeed 0.19's ZeRO-1/2 optimizer calls ``torch.distributed.all_gather_into_tensor``, which
    torch 2.14 deprecates with a ``FutureWarning`` (from torch's c10d_logger.py) on each rank: not
    ours to fix (a third-party call); this filter names that one message only.
    """
    from ray.train.v2._internal.execution import context as train_context

    train_context.logger.setLevel(getattr(logging, ray_log_level))
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
