"""Training data for one rank from the feeder (:mod:`pipelines.stream.feeder`): step items -> micro-batches.

Rank 0 starts the ``DataFeeder`` before the engine builds (:class:`EarlyFeeder`), positions it at the
checkpoint's data state and shares its handle with the other ranks (a ``broadcast_object_list``); the
feeder dies with rank 0, so a restarted worker group always starts a fresh one from the checkpoint it
restored. Each optimizer step takes one item: this
rank's share of the step's global batch (:mod:`pipelines.stream.batch`; fewer at the end of an epoch; the
step pads with no-loss micro-batches), collated here. The item holds block references and row
ranges; this rank fetches its rows from the object store itself (zero-copy on the same node) and
splits the Arrow list columns into per-row numpy views by their offsets -- no Python ints::

    input_ids  values [5 9 2 7 7 1 ...]  offsets [0 3 5 ...]  ->  rows [5 9 2], [7 7], ...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.distributed as dist

from pipelines.config import Config
from pipelines.storage import StorageOptions
from pipelines.stream.blocks import RankItem
from pipelines.stream.client import FeederClient
from pipelines.stream.feeder import start_feeder
from pipelines.stream.spec import StreamSpec

# Feeder epochs when train.max_steps decides the end: the stream is re-read as often as needed.
UNBOUNDED_EPOCHS = 1 << 30


class EarlyFeeder:
    """Rank 0's feeder, started before the engine builds (the model, DeepSpeed, a checkpoint's load), so that
    its process starts meanwhile. On a fresh run (no checkpoint to resume) its position is known at once:
    it is set then, and the feeder reads the first steps while the engine builds. Other ranks hold nothing.
    """

    def __init__(self, cfg: Config, spec: StreamSpec, rank: int, world: int, step_rows: int, ledger_root: str,
                 fresh: bool, given: Any = None) -> None:
        self.cfg, self.feeder, self.fresh_resume = cfg, None, None
        if rank != 0:
            return
        epochs = cfg.train.epochs if cfg.train.max_steps is None else UNBOUNDED_EPOCHS
        self.feeder = start_feeder(spec, world, step_rows, None, ledger_root, epochs,
                                   storage=StorageOptions.from_config(cfg.storage),
                                   progress_bars=cfg.run.progress_bars, given=given)
        if fresh:  # as share() would ask after a fresh restore (step 0, epoch 0, no data state)
            self.fresh_resume = self._resume(None, 0, 0)

    def _resume(self, saved: dict | None, step: int, epoch: int) -> Any:
        return self.feeder.resume.remote(saved, step, epoch, self.cfg.run.on_data_change, f"step {step}")

    def share(self, rank: int, world: int, saved: dict | None, step: int, epoch: int) -> tuple[Any, int]:
        """Rank 0 resumes the feeder from a checkpoint's data state ``saved`` (taken at ``step`` in ``epoch``;
        see :meth:`pipelines.stream.feeder.Feeder.resume`), unless a fresh run did so already; every rank
        gets its handle and the epoch training continues in (the next one when the checkpoint ended an epoch)."""
        import ray

        box: list[Any] = [None, epoch]
        if rank == 0:
            pending = self.fresh_resume if self.fresh_resume is not None else self._resume(saved, step, epoch)
            resumed = ray.get(pending)
            if resumed.banner:
                print("!" * 80 + f"\nWARNING: {resumed.banner}\n" + "!" * 80, file=sys.__stdout__, flush=True)
            box = [self.feeder, epoch if resumed.state is None else resumed.state.next_epoch]
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0], box[1]


class StepFeed:
    """This rank's view: ``next_step()`` gives the micro-batches of the next step, ``None`` at an epoch end."""

    def __init__(self, feeder: Any, rank: int, micro_batch_size: int, collate: Callable[[dict], dict]) -> None:
        self.feeder = feeder
        self.client = FeederClient(feeder, rank)
        self.micro, self.collate = micro_batch_size, collate
        self.last_index = -1  # the item this rank last consumed (what rank 0 commits)
        self.epoch: int | None = None
        self.wait_s = 0.0  # time blocked on the feeder for the last item
        self.finished = False  # the feeder has nothing more (all epochs done)

    def next_step(self) -> list[dict] | None:
        t0 = time.perf_counter()
        item = self.client.next()
        columns = _columns(item) if item is not None and item.kind == "step" else None
        self.wait_s = time.perf_counter() - t0
        if item is None:
            self.finished = True
            return None
        self.last_index, self.epoch = item.index, item.epoch
        if columns is None:
            return None
        n = item.num_rows
        return [self.collate({k: v[i:i + self.micro] for k, v in columns.items()}) for i in range(0, n, self.micro)]

    def commit(self) -> dict:
        """Commit the last consumed item (rank 0, when checkpointing): the feeder's ``state_dict()`` after it,
        which the checkpoint stores as it is."""
        import ray

        return ray.get(self.feeder.commit.remote(self.last_index))

    def report(self) -> dict:
        import ray

        return ray.get(self.feeder.report.remote())

    def telemetry(self) -> dict:
        """The feeder's mix shares and data-quality counters as of this rank's last item (see ``Feeder.telemetry``)."""
        import ray

        return ray.get(self.feeder.telemetry.remote(self.last_index))


TOKEN_COLUMNS = ("input_ids", "labels", "position_ids")


def _columns(item: RankItem) -> dict[str, list[np.ndarray]]:
    """This rank's rows of a step item: column -> one numpy view per row."""
    return item.columns(TOKEN_COLUMNS)
