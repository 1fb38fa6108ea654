"""Checkpoints: DeepSpeed state of every rank + trainer state, persisted through Ray Train.

Layout of one checkpoint (``<run dir>/checkpoint_00000125``)::

    trainer_state.json                 step, epoch, tokens, fit_id, data_state (rank 0 writes it)
    deepspeed/step_125/...             model/optimizer/LR-scheduler shards of *every* rank
    deepspeed/latest                   "step_125"
    manifest.json                      every file above with its size, the world size and ZeRO stage

A checkpoint is *complete* when its ``manifest.json`` exists and every file it lists is there with
its size (:func:`checkpoint_problem`). Resume only ever loads a complete one: when the newest was cut
off (a node died while Ray Train copied it), the previous complete one is used, with a warning; when
none is complete, the run fails rather than starting over.

Each rank writes its DeepSpeed shard files into its own temporary directory and passes it to
``ray.train.report(checkpoint=...)``; Ray Train merges the ranks' files into one directory in
``run.storage_path`` and keeps the last ``run.keep_checkpoints`` (``CheckpointConfig.num_to_keep``).

Resume (``run.resume``):

* ``auto``: ``ray.train.get_checkpoint()`` -- the latest checkpoint of this run directory. Ray Train V2
  finds it from the run's ``checkpoint_manager_snapshot.json`` when the same ``run.name`` is started
  again, and after a worker failure (``run.max_failures``). A newer complete checkpoint on storage that
  Ray did not register (the worker died before its report reached the controller) wins
  (:func:`newer_unregistered`).
* ``never``: start from scratch; a checkpoint is only taken if this very ``fit()`` wrote it (its
  ``fit_id`` matches), so worker-failure restarts still resume, but an old run's state is ignored.
* ``<path>``: a checkpoint directory (or a run directory: its newest ``checkpoint_*``) to start from
  when this run has none of its own yet.

With ``model.adapter`` (LoRA/QLoRA) the DeepSpeed part holds the adapter weights and their optimizer
state only (``exclude_frozen_parameters``): the frozen base is rebuilt from ``model.name_or_path`` /
``model.init`` on resume, so a checkpoint is megabytes, not a copy of the base. The adapter settings
are saved with it and a resume under different ones is refused.

``data_state`` is the feeder's ``state_dict()``, stored as it is: the stream layer owns its meaning
(:mod:`pipelines.stream.state`). Rank 0's feeder resumes from it (:meth:`pipelines.stream.feeder.Feeder.resume`);
:func:`check_resume` (the driver, before the workers start) refuses one that cannot resume the run's stream,
naming what changed, as ``run.on_data_change`` says.

A change of the data-parallel world size with ZeRO (stage >= 1: optimizer state is partitioned per
rank) is refused before training, naming the ``scaling.num_workers`` to resume with
(:func:`check_world_size`); ZeRO-0 checkpoints resume at any world size.
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
MANIFEST = "manifest.json"
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


def saved_layout(directory: str) -> tuple[int | None, int]:
    """``(world size, ZeRO stage)`` a checkpoint was saved with (from its manifest)."""
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    return manifest.get("world_size"), int(manifest.get("zero_stage") or 0)


def check_world_size(world_size: int, directory: str) -> None:
    """Refuse a ZeRO (stage >= 1) checkpoint saved with another data-parallel world size, saying what to run.

    DeepSpeed partitions the optimizer state per rank at stages 1-3 and cannot load it at another
    world size; stage 0 checkpoints load at any world size (the data side never depends on it).
    """
    saved, stage = saved_layout(directory)
    if not stage or saved == world_size:
        return
    raise CheckpointError(
        f"checkpoint {directory} was saved by {saved} workers with ZeRO stage {stage}, and this run has "
        f"{world_size}: DeepSpeed's per-rank optimizer partitions cannot be loaded at another world size. "
        f"Run the same command with scaling.num_workers={saved} to resume (see README, 'Resume')."
    )


def load_local(te: TrainEngine, directory: str) -> TrainerState:
    """Restore model, optimizer, LR scheduler (DeepSpeed) and trainer state from a merged checkpoint dir."""
    with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
        state = TrainerState.from_dict(json.load(f))
    check_world_size(te.world_size, directory)
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
        raise CheckpointError(f"model.adapter: the checkpoint {directory} was trained with {saved}, this run has "
                           f"{now}; use the same adapter settings, or run.resume=never / a new run.name")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message says why and what to do."""


def _local_files(directory: str) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, directory).replace(os.sep, "/")] = os.path.getsize(full)
    return out


def write_manifest(te: TrainEngine, directory: str) -> None:
    """Rank 0 writes ``manifest.json``: the files of every rank's part (collective)."""
    import torch.distributed as dist

    mine = _local_files(directory)
    parts = [mine]
    if te.world_size > 1:
        parts = [None] * te.world_size
        dist.all_gather_object(parts, mine)
    if te.rank != 0:
        return
    files = {k: v for part in parts for k, v in part.items()}
    manifest = {"files": files, "world_size": te.world_size, "zero_stage": te.engine.zero_optimization_stage()}
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


def report_checkpoint(te: TrainEngine, state: TrainerState, metrics: dict[str, Any]) -> str:
    """Save and hand the checkpoint to Ray Train (a barrier across ranks); returns its directory name."""
    import ray.train

    name = checkpoint_dir_name(state.step)
    with tempfile.TemporaryDirectory(prefix="pipelines-ckpt-") as tmp:
        save_local(te, tmp, state)
        write_manifest(te, tmp)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    return name


def read_json(fs: Any, path: str) -> dict[str, Any]:
    """A JSON file through a pyarrow filesystem."""
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode())


def checkpoint_problem(fs: Any, root: str) -> str | None:
    """Why the checkpoint at ``root`` (a path in ``fs``) is incomplete, or ``None`` when it is complete."""
    import pyarrow.fs as pafs

    try:
        manifest = read_json(fs, f"{root}/{MANIFEST}")
    except (OSError, ValueError) as err:
        return f"no readable {MANIFEST} ({type(err).__name__})"
    listed = manifest.get("files") or {}
    if STATE_FILE not in listed:
        return f"{MANIFEST} lists no {STATE_FILE}"
    infos = fs.get_file_info([f"{root}/{rel}" for rel in listed])
    for (rel, size), info in zip(listed.items(), infos, strict=True):
        if info.type != pafs.FileType.File:
            return f"{rel} is missing"
        if info.size != size:
            return f"{rel} has {info.size} bytes, {size} were written"
    return None


def checkpoint_steps(fs: Any, run_root: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the ``checkpoint_*`` directories under ``run_root``, newest first."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(run_root, allow_not_found=True))
    return sorted(((int(m.group(1)), i.path) for i in infos
                   if i.type == pafs.FileType.Directory and (m := _CKPT_RE.match(i.base_name))), reverse=True)


def newest_complete(fs: Any, candidate: str) -> str:
    """``candidate`` when complete, else the newest complete older sibling (with a warning); raises if none."""
    problem = checkpoint_problem(fs, candidate)
    if problem is None:
        return candidate
    parent, name = candidate.rstrip("/").rsplit("/", 1)
    m = _CKPT_RE.match(name)
    limit = int(m.group(1)) if m else 1 << 62
    skipped = [f"{name}: {problem}"]
    for step, path in checkpoint_steps(fs, parent):
        if step >= limit:
            continue
        why = checkpoint_problem(fs, path)
        if why is None:
            msg = (f"checkpoint {candidate} is incomplete ({problem}); resuming from the previous complete "
                   f"checkpoint {path} instead")
            logger.warning(msg)
            print(f"WARNING: {msg}", file=sys.__stderr__, flush=True)
            return path
        skipped.append(f"{path.rsplit('/', 1)[-1]}: {why}")
    raise CheckpointError(f"no complete checkpoint to resume from under {parent}: " + "; ".join(skipped)
                          + ". Set run.resume=never (or a new run.name) to start over.")


def newer_unregistered(fs: Any, path: str) -> str:
    """The newest complete sibling of checkpoint ``path`` that is newer than it, else ``path``.

    Ray Train registers a checkpoint when its controller processes the workers' report; a worker killed
    right after writing checkpoint 16 (every file there, ``manifest.json`` last) can die before that, so
    ``get_checkpoint()`` still names 8. Resuming from 8 would redo steps whose checkpoint is complete
    on storage (and disagree with the driver's :func:`check_resume`, which reads the directory), so the
    newest complete one is used, with a note.
    """
    parent, name = path.rstrip("/").rsplit("/", 1)
    m = _CKPT_RE.match(name)
    if m is None:
        return path
    for step, other in checkpoint_steps(fs, parent):
        if step <= int(m.group(1)):
            break
        if checkpoint_problem(fs, other) is None:
            logger.warning("checkpoint %s is complete but not registered with Ray Train (its worker died before "
                           "the report reached the controller); resuming from it instead of %s", other, path)
            return other
    return path


def latest_in_run_dir(path: str, storage: Any = None) -> tuple[Any, str]:
    """``(fs, path)`` of ``path`` itself if it is a checkpoint, else of its newest complete ``checkpoint_*``."""
    import pyarrow.fs as pafs

    from pipelines.storage import StorageOptions, filesystem_for

    fs, root = filesystem_for(path, StorageOptions.from_config(storage))
    root = root.rstrip("/")
    if fs.get_file_info(f"{root}/{STATE_FILE}").type == pafs.FileType.File or _CKPT_RE.match(root.rsplit("/", 1)[-1]):
        return fs, newest_complete(fs, root)
    steps = checkpoint_steps(fs, root)
    if not steps:
        raise FileNotFoundError(f"run.resume: no {STATE_FILE} or checkpoint_* under {path}")
    return fs, newest_complete(fs, steps[0][1])


def restore(te: TrainEngine, resume: str, fit_id: str, storage: Any = None) -> TrainerState:
    """Apply ``run.resume`` (see the module docstring); returns the state to continue from."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    source = None
    if ckpt is not None:
        path = newer_unregistered(ckpt.filesystem, newest_complete(ckpt.filesystem, ckpt.path))
        saved_fit = read_json(ckpt.filesystem, f"{path}/{STATE_FILE}").get("fit_id", "")
        if resume == "never" and saved_fit != fit_id:
            logger.warning("run.resume=never: ignoring the run directory's checkpoint %s", ckpt.path)
        else:
            source = ray.train.Checkpoint(path, filesystem=ckpt.filesystem)
    elif resume not in ("auto", "never"):
        path = resume if "://" in resume else os.path.abspath(os.path.expanduser(resume))
        fs, inner = latest_in_run_dir(path, storage)
        source = ray.train.Checkpoint(inner, filesystem=fs)
    if source is None:
        return TrainerState(fit_id=fit_id)
    with source.as_directory() as d:
        state = load_local(te, d)
    if te.rank == 0:
        print(f"resumed from {source.path} at step {state.step} (epoch {state.epoch})", file=sys.__stdout__, flush=True)
    state.fit_id = fit_id  # later checkpoints belong to this fit()
    return state


# --------------------------------------------------------------------------- the data position


def check_resume(cfg: Any, spec: Any) -> None:
    """Driver side, before any worker starts: refuse the checkpoint this run would resume from when its
    data position cannot resume the stream of ``spec`` under ``run.on_data_change``
    (:func:`pipelines.stream.resume.resume_state`, which rank 0's feeder applies again)."""
    import pyarrow.fs as pafs

    from pipelines.storage import StorageOptions, filesystem_for
    from pipelines.stream.resume import DataChangeError, resume_state
    from pipelines.train.storage import run_dir

    if cfg.run.resume == "never" or cfg.run.on_data_change == "restart":
        return
    if cfg.run.resume == "auto":
        fs, root = filesystem_for(run_dir(cfg), StorageOptions.from_config(cfg.storage))
        steps = checkpoint_steps(fs, root.rstrip("/"))
        if not steps:
            return
        path = newest_complete(fs, steps[0][1])
    else:
        target = cfg.run.resume
        if "://" not in target:
            target = os.path.abspath(os.path.expanduser(target))
        fs, path = latest_in_run_dir(target, cfg.storage)
    if fs.get_file_info(f"{path}/{STATE_FILE}").type != pafs.FileType.File:
        return
    saved = TrainerState.from_dict(read_json(fs, f"{path}/{STATE_FILE}"))
    try:
        resume_state(saved.data_state, saved.step, saved.epoch, spec, cfg.run.on_data_change, path)
    except DataChangeError as err:
        raise CheckpointError(str(err)) from None
