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
  (:func:`newer_unregistered`), and so does one when Ray has none registered (:func:`unregistered`).
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

A checkpoint resumes at any world size. With ZeRO stages 1-3 DeepSpeed partitions the optimizer state
(and at stage 3 the weights) per rank, so a checkpoint saved by 2 workers cannot be loaded as it is by 1:
it is first converted to DeepSpeed's universal checkpoint format (``deepspeed.checkpoint.ds_to_universal``:
one fp32 file per parameter with its optimizer moments), which loads at any world size with the optimizer
state intact (:func:`to_universal`). Each node converts once, into a local folder that is removed after
the load; an elastic resize and a resume with another ``scaling.num_workers`` take this path alike.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
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


@dataclass(frozen=True)
class SavedLayout:
    """How a checkpoint was saved: ``world_size`` ranks (``None``: unknown, an old manifest) at ZeRO ``zero_stage``."""

    world_size: int | None
    zero_stage: int

    def needs_universal(self, world_size: int) -> bool:
        """Loading at ``world_size`` needs the universal format: partitioned state saved at another world size."""
        return self.zero_stage >= 1 and self.world_size is not None and self.world_size != world_size


def saved_layout(fs: Any, path: str) -> SavedLayout:
    """The :class:`SavedLayout` of the checkpoint at ``path`` in ``fs`` (from its manifest)."""
    manifest = read_json(fs, f"{path}/{MANIFEST}")
    return SavedLayout(manifest.get("world_size"), int(manifest.get("zero_stage") or 0))


def to_universal(ds_dir: str, tag: str, out_dir: str) -> None:
    """Convert DeepSpeed checkpoint ``ds_dir/tag`` (ZeRO 1-3, any world size) into ``out_dir/tag``, DeepSpeed's
    universal format. In this process (no process pool: this runs inside a Ray worker); its progress output
    is dropped, the caller logs one line."""
    import contextlib
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = SimpleNamespace(input_folder=os.path.join(ds_dir, tag), output_folder=os.path.join(out_dir, tag),
                           num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                           inject_missing_state=True)  # our checkpoints carry no Megatron universal info
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        ds_to_universal(args)


def load_local(te: TrainEngine, directory: str, universal: bool = False, fit_id: str = "") -> TrainerState:
    """Restore model, optimizer, LR scheduler (DeepSpeed) and trainer state from a merged checkpoint dir.

    ``universal``: the checkpoint was saved at another world size with ZeRO >= 1 (the engine was built with
    ``load_universal``); the first rank of each node converts it (:func:`to_universal`) into a local folder
    that every rank of the node loads, collective over all ranks.
    """
    import torch.distributed as dist

    with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
        state = TrainerState.from_dict(json.load(f))
    tag, ds_dir = f"step_{state.step}", os.path.join(directory, DS_SUBDIR)
    converted = None
    if universal:
        launched = "LOCAL_RANK" in os.environ  # Ray Train and torchrun set it; alone, each rank converts its own
        local_rank = int(os.environ["LOCAL_RANK"]) if launched else 0
        node_key = "" if launched else f"-rank{te.rank}"
        converted = os.path.join(tempfile.gettempdir(), "pipelines-universal", f"{fit_id or 'x'}-{tag}{node_key}")
        if local_rank == 0:
            shutil.rmtree(converted, ignore_errors=True)
            to_universal(ds_dir, tag, converted)
        if te.world_size > 1:
            dist.barrier()
        ds_dir = converted
    try:
        path, client_state = te.engine.load_checkpoint(
            ds_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
            load_module_strict=not te.adapter.enabled,  # adapter checkpoints hold no frozen base weights
        )
    finally:
        if converted is not None:
            if te.world_size > 1:
                dist.barrier()  # every rank of the node has read it
            shutil.rmtree(converted, ignore_errors=True)
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


def report_checkpoint(te: TrainEngine, state: TrainerState, metrics: dict[str, Any], upload: str = "sync") -> str:
    """Save this rank's part locally and hand it to Ray Train; returns the checkpoint's directory name.

    ``upload`` (``run.checkpoint_upload``): ``async`` returns once the local files are written; Ray Train copies
    them to the run directory in a background thread, registers the checkpoint when every rank's copy is
    done, and deletes the local folder. A checkpoint is still all or nothing for a resume: an incomplete one
    is never picked (:func:`checkpoint_problem`). ``sync`` waits for the copy (``ray.train.report`` is then a
    barrier across ranks).
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    name = checkpoint_dir_name(state.step)
    tmp = tempfile.mkdtemp(prefix="pipelines-ckpt-")
    try:
        save_local(te, tmp, state)
        write_manifest(te, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mode = CheckpointUploadMode.ASYNC if upload == "async" else CheckpointUploadMode.SYNC
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name,
                     checkpoint_upload_mode=mode, delete_local_checkpoint_after_upload=True)
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


def unregistered(run_directory: str, resume: str, fit_id: str, storage: Any = None) -> Any:
    """The newest complete checkpoint in ``run_directory`` when Ray Train has none registered, else ``None``.

    A checkpoint is registered when every rank's copy is done and the controller has processed the report; a
    node lost in between (e.g. right after a preemption notice's checkpoint) leaves a complete checkpoint that
    ``ray.train.get_checkpoint()`` does not know. ``run.resume: auto`` takes it; ``never`` and a path only one that
    this fit wrote.
    """
    import ray.train

    from pipelines.storage import StorageOptions, filesystem_for

    fs, root = filesystem_for(run_directory, StorageOptions.from_config(storage))
    for _, path in checkpoint_steps(fs, root.rstrip("/")):
        if checkpoint_problem(fs, path) is not None:
            continue
        if resume != "auto" and read_json(fs, f"{path}/{STATE_FILE}").get("fit_id", "") != fit_id:
            return None  # never, or a path to start from: only a checkpoint this fit wrote continues it
        logger.warning("checkpoint %s is complete but not registered with Ray Train (the run stopped before its "
                       "report reached the controller); resuming from it", path)
        return ray.train.Checkpoint(path, filesystem=fs)
    return None


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


@dataclass(frozen=True)
class ResumeSource:
    """The checkpoint a worker group resumes from (:func:`resume_source`) and how it was saved."""

    checkpoint: Any  # ray.train.Checkpoint
    layout: SavedLayout
    fit_id: str  # the fit() that wrote it: this one's means Ray Train restarted the group (a fault or a resize)


def resume_source(resume: str, fit_id: str, storage: Any = None, run_directory: str | None = None) -> ResumeSource | None:
    """Apply ``run.resume`` (see the module docstring): the checkpoint to resume from, or ``None`` for a fresh start.

    Found before the engine is built, so that the engine is built for the checkpoint's format
    (:meth:`SavedLayout.needs_universal`). ``run_directory``: the run's own directory, searched for a complete
    checkpoint that Ray Train never registered when it has none registered (:func:`unregistered`).
    """
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None and run_directory is not None:
        ckpt = unregistered(run_directory, resume, fit_id, storage)
    if ckpt is not None:
        path = newer_unregistered(ckpt.filesystem, newest_complete(ckpt.filesystem, ckpt.path))
        saved_fit = read_json(ckpt.filesystem, f"{path}/{STATE_FILE}").get("fit_id", "")
        if resume == "never" and saved_fit != fit_id:
            logger.warning("run.resume=never: ignoring the run directory's checkpoint %s", ckpt.path)
            return None
        return ResumeSource(ray.train.Checkpoint(path, filesystem=ckpt.filesystem),
                            saved_layout(ckpt.filesystem, path), saved_fit)
    if resume in ("auto", "never"):
        return None
    path = resume if "://" in resume else os.path.abspath(os.path.expanduser(resume))
    fs, inner = latest_in_run_dir(path, storage)
    return ResumeSource(ray.train.Checkpoint(inner, filesystem=fs), saved_layout(fs, inner),
                        read_json(fs, f"{inner}/{STATE_FILE}").get("fit_id", ""))


def restore(te: TrainEngine, source: ResumeSource | None, fit_id: str) -> TrainerState:
    """Load ``source`` into the engine (``None``: a fresh state); returns the state to continue from."""
    import time

    if source is None:
        return TrainerState(fit_id=fit_id)
    universal = source.layout.needs_universal(te.world_size)
    t0 = time.perf_counter()
    with source.checkpoint.as_directory() as d:
        state = load_local(te, d, universal, fit_id)
    if te.rank == 0:
        how = ""
        if universal:
            how = (f"; saved by {source.layout.world_size} workers with ZeRO-{source.layout.zero_stage}, converted to "
                   f"DeepSpeed's universal checkpoint for {te.world_size} in {time.perf_counter() - t0:.1f}s")
        print(f"resumed from {source.checkpoint.path} at step {state.step} (epoch {state.epoch}){how}",
              file=sys.__stdout__, flush=True)
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
