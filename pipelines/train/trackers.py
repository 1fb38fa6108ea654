"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, fed the records of metrics.jsonl.

``run.loggers: [tensorboard, wandb, mlflow]`` picks them (TensorBoard is the default and in the core
install; ``pip install 'pipelines[wandb]'`` / ``'pipelines[mlflow]'`` for the others). Rank 0 opens them
once per fit and hands each one every record it writes to metrics.jsonl: the numbers of a record become
scalars named ``<kind>/<key>`` at the record's step, nested ones joined by ``/``, every part made of
letters, digits and ``_ - .`` only (MLflow refuses other names, and the same names go everywhere). For
example the train record ``{"kind": "train", "step": 20, "loss": 2.31, "mix_share": {"s3://b/alpaca": 0.61}}``
logs ``train/loss = 2.31`` and ``train/mix_share/s3_b_alpaca = 0.61`` at step 20.

The run config is logged once, when a tracker opens (W&B's run config; MLflow's ``config.json``
artifact and flattened params), with any ``user:password@`` in a URL removed. Credentials stay where the
trackers' own clients read them (``WANDB_API_KEY``, ``MLFLOW_TRACKING_TOKEN``/``_USERNAME``/``_PASSWORD``);
nothing here reads, prints or stores them.

Resumes continue the same tracker run: W&B's run id is derived from the run directory, and MLflow's run
is found again by its ``pipelines.run_dir`` tag. A tracker that fails (not installed, unreachable, a
rejected call) gives one warning naming it and the reason, then stays off for the rest of the fit;
training goes on.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from collections.abc import Iterator
from typing import Any, Protocol

from pipelines.config import Config

logger = logging.getLogger(__name__)

_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def redact(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it removed:
    ``"https://bob:s3cret@mlflow.example.com"`` -> ``"https://mlflow.example.com"``."""
    return _USERINFO.sub("", text)


def public_config(cfg: Config) -> dict[str, Any]:
    """The run config as plain JSON values, safe to send to a tracker (URLs without their userinfo)."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return redact(value) if isinstance(value, str) else value

    return clean(cfg.model_dump(mode="json"))


def scalars(rec: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The finite numbers of a metrics record, nested keys joined by ``/`` (bools and text skipped); each key
    keeps letters, digits and ``_ - .``, a run of anything else becomes one ``_`` (``"demo://sft"`` -> ``"demo_sft"``)."""
    for key, value in rec.items():
        if not prefix and key in ("kind", "step"):
            continue
        name = f"{prefix}{_UNSAFE.sub('_', str(key)).strip('_') or '_'}"
        if isinstance(value, dict):
            yield from scalars(value, f"{name}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            yield name, float(value)


class Tracker(Protocol):
    name: str

    def log(self, kind: str, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under ``<run dir>/tensorboard`` (rank 0's local copy of the run directory)."""

    name = "tensorboard"

    def __init__(self, local_run_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(os.path.join(local_run_dir, "tensorboard"))

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(f"{kind}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def wandb_run_id(run_dir: str) -> str:
    """A W&B run id that is the same for every fit of one run directory (so a resume appends to it):
    ``"runs/demo"`` -> ``"demo-3f2a9c1b"``."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", run_dir.rstrip("/").rsplit("/", 1)[-1]).strip("-")[:40] or "run"
    return f"{name}-{hashlib.sha1(run_dir.encode('utf-8')).hexdigest()[:8]}"


class WandbTracker:
    """A W&B run (``run.wandb``: project, entity, group, tags, mode; ``WANDB_MODE=offline`` works as usual,
    writing under ``<run dir>/wandb``)."""

    name = "wandb"

    def __init__(self, cfg: Config, run_dir: str, local_run_dir: str) -> None:
        import wandb

        w = cfg.run.wandb
        self._run = wandb.init(
            project=w.project, entity=w.entity, group=w.group, tags=list(w.tags) or None, mode=w.mode,
            name=cfg.run.name, id=wandb_run_id(run_dir), resume="allow", dir=local_run_dir,
            config=public_config(cfg), settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self._run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run in experiment ``run.mlflow.experiment`` at ``run.mlflow.tracking_uri`` (else
    ``MLFLOW_TRACKING_URI``, else MLflow's default). Each record is one synchronous batch: one request per
    log step, so a failure is seen (and reported) at once and nothing waits in a queue when a worker dies.
    A ``file:`` URI asks for MLflow's file store, which MLflow 3 keeps only on request
    (``MLFLOW_ALLOW_FILE_STORE``); naming one in the config is that request."""

    name = "mlflow"
    TAG = "pipelines.run_dir"

    def __init__(self, cfg: Config, run_dir: str) -> None:
        m = cfg.run.mlflow
        # An unreachable server fails in seconds, not after MLflow's default of 7 retries with backoff (minutes);
        # a value the user set wins.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        if m.tracking_uri and m.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow
        from mlflow.tracking import MlflowClient

        uri = m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._client = MlflowClient(tracking_uri=uri)
        exp = self._client.get_experiment_by_name(m.experiment)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(m.experiment)
        quoted = run_dir.replace("\\", "\\\\").replace("'", "\\'")
        found = self._client.search_runs([exp_id], filter_string=f"tags.`{self.TAG}` = '{quoted}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self._client.create_run(exp_id, run_name=cfg.run.name, tags={self.TAG: run_dir})
            self.run_id = run.info.run_id
            config = public_config(cfg)
            self._client.log_dict(self.run_id, config, "config.json")
            params = [mlflow.entities.Param(k, str(v)[:500]) for k, v in _flat(config)]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self._client.log_batch(self.run_id, params=params[i : i + 100])
    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{kind}/{k}", v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000], synchronous=True)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _flat(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class Trackers:
    """The trackers of ``run.loggers`` for rank 0, each kept apart: one that fails is named in one warning
    and closed off, the others and training go on."""

    def __init__(self, cfg: Config, run_dir: str, local_run_dir: str) -> None:
        self._live: list[Tracker] = []
        makers = {"tensorboard": lambda: TensorBoardTracker(local_run_dir),
                  "wandb": lambda: WandbTracker(cfg, run_dir, local_run_dir),
                  "mlflow": lambda: MlflowTracker(cfg, run_dir)}
        for name in cfg.run.loggers:
            try:
                self._live.append(makers[name]())
            except Exception as err:  # noqa: BLE001  # any failure of a tracker is that tracker's alone
                self._failed(name, "could not start", err)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._live]

    def _failed(self, name: str, what: str, err: BaseException) -> None:
        hint = f" (pip install 'pipelines[{name}]')" if isinstance(err, ImportError) else ""
        logger.warning("run.loggers: %s %s, so it is off for the rest of this run (training goes on): %s%s",
                       name, what, redact(f"{type(err).__name__}: {err}"), hint)

    def log(self, rec: dict[str, Any]) -> None:
        values = dict(scalars(rec))
        if not values:
            return
        kind, step = str(rec.get("kind", "train")), int(rec.get("step", 0))
        for tracker in list(self._live):
            try:
                tracker.log(kind, step, values)
            except Exception as err:  # noqa: BLE001
                self._live.remove(tracker)
                self._failed(tracker.name, "failed to log", err)

    def close(self) -> None:
        for tracker in self._live:
            try:
                tracker.close()
            except Exception as err:  # noqa: BLE001
                self._failed(tracker.name, "failed to close", err)
        self._live = []
