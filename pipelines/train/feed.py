"""Training data for one rank from the feeder (:mod:`pipelines.loader`): step items -> micro-batches.

Rank 0 starts the ``DataFeeder`` from the checkpoint's data state and shares its handle with the
other ranks (a ``broadcast_object_list``); the feeder dies with rank 0, so a restarted worker group
always starts a fresh one from the checkpoint it restored. Each optimizer step takes one item: this
rank's ``micro_batch_size x gradient_accumulation_steps`` rows (fewer at the end of an epoch; the
step pads with no-loss micro-batches), collated here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.distributed as dist

from pipelines.config import Config
from pipelines.loader import FeederClient, start_feeder

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
        self.wait_s = time.perf_counter() - t0
        if item is None:
            self.finished = True
            return None
        self.last_index, self.epoch = item["index"], item["epoch"]
        if item["kind"] != "step":
            return None
        rows = item["rows"]
        return [self.collate(_columns(rows[i:i + self.micro])) for i in range(0, len(rows), self.micro)]

    def commit(self) -> dict:
        """The data state after the last consumed item (call on rank 0 when checkpointing)."""
        import ray

        return ray.get(self.feeder.commit.remote(self.last_index))

    def report(self) -> dict:
        import ray

        return ray.get(self.feeder.report.remote())


def _columns(rows: list[dict]) -> dict[str, list[np.ndarray]]:
    return {k: [np.asarray(r[k]) for r in rows] for k in ("input_ids", "labels", "position_ids")}
