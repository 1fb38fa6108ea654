"""The global batch: how many packed rows an optimizer step takes, and how the ranks present share them.

A step means the same rows at every world size of an elastic run (or of any run with
``train.global_batch_size`` set): one that shrinks from 2 workers to 1 takes the same rows in the same order
and follows the same loss curve. A fixed-size run without it keeps micro x accumulation rows per worker.
Example: 8 rows per step, micro-batches of 2::

    4 workers: 2 rows each  -> 1 micro-batch per rank
    2 workers: 4 rows each  -> 2 micro-batches (accumulated)
    3 workers: 3, 3, 2 rows -> 2 micro-batches; rank 2's second one is a padding batch with no loss

The loss of a step is the mean over the supervised tokens of the whole global batch
(:func:`pipelines.train.loss.backward_scale`), so how the rows fall on ranks does not change the gradient.
The feeder cuts each step's rows by :func:`rank_rows`; the engine accumulates :attr:`BatchLayout.grad_accum`
micro-batches. No Ray here: the step (:mod:`pipelines.train.step`) runs without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipelines.config import ScalingConfig, TrainConfig


def rank_rows(step_rows: int, world: int) -> list[int]:
    """How many of a step's ``step_rows`` rows each of ``world`` ranks takes: as even as it gets, the first
    ``step_rows % world`` ranks one more. ``rank_rows(8, 3) -> [3, 3, 2]``."""
    base, extra = divmod(step_rows, world)
    return [base + (r < extra) for r in range(world)]


@dataclass(frozen=True)
class BatchLayout:
    """``step_rows`` rows per optimizer step over ``world`` ranks, in micro-batches of ``micro`` rows."""

    step_rows: int
    world: int
    micro: int

    @property
    def rows_per_rank(self) -> int:
        """The most rows a rank takes in a step."""
        return max(rank_rows(self.step_rows, self.world))

    @property
    def grad_accum(self) -> int:
        """Micro-batches per step on every rank (DeepSpeed's ``gradient_accumulation_steps``)."""
        return max(1, math.ceil(self.rows_per_rank / self.micro))


def global_rows(train: TrainConfig, scaling: ScalingConfig, world: int | None = None) -> int:
    """Rows per optimizer step: ``train.global_batch_size`` when set; else micro x accumulation x workers, where
    workers is the elastic run's max, or for a fixed-size run the world it runs at (``world``; default
    ``scaling.num_workers``), as it always was: each worker takes micro x accumulation rows."""
    if train.global_batch_size is not None:
        return train.global_batch_size
    workers = scaling.max_workers if scaling.elastic or world is None else world
    return train.micro_batch_size * train.gradient_accumulation_steps * workers


def batch_layout(train: TrainConfig, scaling: ScalingConfig, world: int) -> BatchLayout:
    """The layout of a run's steps at ``world`` ranks."""
    return BatchLayout(global_rows(train, scaling, world), world, train.micro_batch_size)
