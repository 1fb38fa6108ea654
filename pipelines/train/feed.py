"""Training data for one rank from the feeder (:mod:`pipelines.stream.feeder`): step items -> micro-batches.

Rank 0 starts the ``DataFeeder`` from the checkpoint's data state and shares its handle with the
other ranks (a ``broadcast_object_list``); the feeder dies with rank 0, so a restarted worker group
always starts a fresh one from the checkpoint it restored. Each optimizer step takes one item: this
rank's ``micro_batch_size x gradient_accumulation_steps`` rows (fewer at the end of an epoch; the
step pads with no-loss micro-batches), collated here. The item holds block references and row
ranges; this rank fetches its rows from the object store itself (zero-copy on the same node) and
splits the Arrow list columns into per-row numpy views by their offsets -- no Python ints::

    input_ids  values [5 9 2 7 7 1 ...]  offsets [0 3 5 ...]  ->  rows [5 9 2], [7 7], ...
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.distributed as dist

from pipelines.config import Config
from pipelines.stream.feeder import FeederClient, RankItem, start_feeder
from pipelines.stream.state import DataState, DataStateError

# Feeder epochs when train.max_steps decides the end: the stream is re-read as often as needed.
UNBOUNDED_EPOCHS = 1 << 30


def share_feeder(cfg: Config, rank: int, world: int, rows_per_rank: int, data_state: dict | None,
                 ledger_root: str | None) -> Any:
    """Rank 0 starts the feeder; every rank gets its handle."""
    box = [None]
    if rank == 0:
        epochs = cfg.train.epochs if cfg.train.max_steps is None else UNBOUNDED_EPOCHS
        box[0] = start_feeder(cfg, world, rows_per_rank, data_state, ledger_root, epochs=epochs)
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def resume_epoch(data_state: dict | None) -> int | None:
    """The epoch a restored run trains next: the saved one, or the one after it when it was done
    (a checkpoint on an epoch's last step). ``None`` without a data state."""
    try:
        state = DataState.from_dict(data_state)
    except DataStateError:  # refused (or restarted) on rank 0 by checkpoint.resume_data_state, before training
        return None
    return None if state is None else state.epoch + int(state.epoch_done)


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
        """The data state after the last consumed item (call on rank 0 when checkpointing)."""
        import ray

        return ray.get(self.feeder.commit.remote(self.last_index))

    def report(self) -> dict:
        import ray

        return ray.get(self.feeder.report.remote())


TOKEN_COLUMNS = ("input_ids", "labels", "position_ids")


def _columns(item: RankItem) -> dict[str, list[np.ndarray]]:
    """This rank's rows of a step item: column -> one numpy view per row."""
    return item.columns(TOKEN_COLUMNS)
