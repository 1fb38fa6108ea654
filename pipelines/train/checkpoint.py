"""Checkpoints: DeepSpeed state of every rank + trainer state, persisted through Ray Train.

Layout of one checkpoint (``<run dir>/checkpoint_00000125``)::

    trainer_state.json                 step, epoch, tokens, fit_id, data_state (rank 0 writes it)
    deepspeed/step_125/...             model/optimizer/LR-scheduler shards of *every* rank
    deepspeed/latest                   "step_125"

Each rank writes its DeepSpeed shard files into its own temporary directory and passes it to
``ray.train.report(checkpoint=...)``; Ray Train merges the ranks' files into one directory in
``run.storage_path`` and keeps the last ``run.keep_checkpoints`` (``CheckpointConfig.num_to_keep``).

Resume (``run.resume``):

* ``auto``: ``ray.train.get_checkpoint()`` -- the latest checkpoint of this run directory. Ray Train V2
  finds it from the run's ``checkpoint_manager_snapshot.json`` when the same ``run.name`` is started
  again, and after a worker failure (``run.max_failures``).
* ``never``: start from scratch; a checkpoint is only taken if this very ``fit()`` wrote it (its
  ``fit_id`` matches), so worker-failure restarts still resume, but an old run's state is ignored.
* ``<path>``: a checkpoint directory (or a run directory: its newest ``checkpoint_*``) to start from
  when this run has none of its own yet.

With ``model.adapter`` (LoRA/QLoRA) the DeepSpeed part holds the adapter weights and their optimizer
state only (``exclude_frozen_parameters``): the frozen base is rebuilt from ``model.name_or_path`` /
``model.init`` on resume, so a checkpoint is megabytes, not a copy of the base. The adapter settings
are saved with it and a resume under different ones is refused.

``data_state`` is a placeholder dict for exactly-once data resumption (a later issue); today a
resumed run restarts the stream of the saved epoch from its beginning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

from pipelines.train.step import TrainEngine

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
ADAPTER_KEY = "adapter"  # in DeepSpeed's client_state: the model.adapter settings of the checkpoint
DS_SUBDIR = "deepspeed"
_CKPT_RE = re.compile(r"^checkpoint_(\d+)$")


@dataclass
class TrainerState:
    """What besides the DeepSpeed engine a resumed run needs."""

    step: int = 0
    epoch: int = 0
    tokens: int = 0
    fit_id: str = ""
    data_state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainerState:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def checkpoint_dir_name(step: int) -> str:
    """``125 -> "checkpoint_00000125"`` (zero-padded so names sort by step)."""
    return f"checkpoint_{step:08d}"


def save_local(te: TrainEngine, directory: str, state: TrainerState) -> None:
    """Write this rank's part of a checkpoint into ``directory`` (collective: every rank calls it)."""
    tag = f"step_{state.step}"
    te.engine.save_checkpoint(os.path.join(directory, DS_SUBDIR), tag=tag,
                              client_state={"trainer_state": asdict(state), ADAPTER_KEY: _adapter_state(te)},
                              exclude_frozen_parameters=te.adapter.enabled)
    if te.rank == 0:
        with open(os.path.join(directory, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(asdict(state), f, indent=2)


def load_local(te: TrainEngine, directory: str) -> TrainerState:
    """Restore model, optimizer, LR scheduler (DeepSpeed) and trainer state from a merged checkpoint dir."""
    with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
        state = TrainerState.from_dict(json.load(f))
    path, client_state = te.engine.load_checkpoint(
        os.path.join(directory, DS_SUBDIR), tag=f"step_{state.step}",
        load_optimizer_states=True, load_lr_scheduler_states=True,
        load_module_strict=not te.adapter.enabled,  # adapter checkpoints hold no frozen base weights
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint for step {state.step} under {directory}")
    check_adapter_matches(te, (client_state or {}).get(ADAPTER_KEY), directory)
    return state


def _adapter_state(te: TrainEngine) -> dict[str, Any]:
    """``model.adapter`` as saved with a checkpoint (``{"type": "none", ...}`` for full fine-tuning)."""
    return te.adapter.model_dump(mode="json")


def check_adapter_matches(te: TrainEngine, saved: dict[str, Any] | None, directory: str) -> None:
    """Refuse to resume a checkpoint trained with other adapter settings (or a full fine-tune as LoRA).

    A checkpoint written before adapters existed has no record: it is a full fine-tune.
    """
    saved = saved or {"type": "none"}
    now = _adapter_state(te)
    if {k: v for k, v in saved.items() if v is not None} != {k: v for k, v in now.items() if v is not None}:
        raise RuntimeError(f"model.adapter: the checkpoint {directory} was trained with {saved}, this run has "
                           f"{now}; use the same adapter settings, or run.resume=never / a new run.name")


def report_checkpoint(te: TrainEngine, state: TrainerState, metrics: dict[str, Any]) -> str:
    """Save and hand the checkpoint to Ray Train (a barrier across ranks); returns its directory name."""
    import ray.train

    name = checkpoint_dir_name(state.step)
    with tempfile.TemporaryDirectory(prefix="pipelines-ckpt-") as tmp:
        save_local(te, tmp, state)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    return name


def latest_in_run_dir(path: str) -> str:
    """``path`` itself if it is a checkpoint, else its newest ``checkpoint_*`` child (local or URL)."""
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(path)
    if fs.get_file_info(f"{root}/{STATE_FILE}").type == pafs.FileType.File:
        return path
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    steps = sorted((int(m.group(1)), i.base_name) for i in infos if (m := _CKPT_RE.match(i.base_name)))
    if not steps:
        raise FileNotFoundError(f"run.resume: no {STATE_FILE} or checkpoint_* under {path}")
    return f"{path.rstrip('/')}/{steps[-1][1]}"


def restore(te: TrainEngine, resume: str, fit_id: str) -> TrainerState:
    """Apply ``run.resume`` (see the module docstring); returns the state to continue from."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    source = None
    if ckpt is not None:
        with ckpt.as_directory() as d:
            with open(os.path.join(d, STATE_FILE), encoding="utf-8") as f:
                saved_fit = json.load(f).get("fit_id", "")
            if resume == "never" and saved_fit != fit_id:
                logger.warning("run.resume=never: ignoring the run directory's checkpoint %s", ckpt.path)
            else:
                source = ckpt
    elif resume not in ("auto", "never"):
        path = resume if "://" in resume else os.path.abspath(os.path.expanduser(resume))
        source = ray.train.Checkpoint(latest_in_run_dir(path))
    if source is None:
        return TrainerState(fit_id=fit_id)
    with source.as_directory() as d:
        state = load_local(te, d)
    if te.rank == 0:
        print(f"resumed from {source.path} at step {state.step} (epoch {state.epoch})", file=sys.__stdout__, flush=True)
    state.fit_id = fit_id  # later checkpoints belong to this fit()
    return state
