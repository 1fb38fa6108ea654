"""Learning-rate schedule: linear warmup, then cosine / linear decay or constant.

How the schedule is sized on a stream of unknown length:

* ``train.max_steps`` set: the decay spans ``max_steps`` optimizer steps (training also stops there,
  re-reading the stream as often as needed, like Hugging Face's ``max_steps``).
* only ``train.epochs``: the number of steps is unknown until the stream ends, and counting rows first
  would mean reading (or materializing) the whole dataset. So the schedule is **warmup, then constant
  at learning_rate**; asking for cosine/linear without ``max_steps`` logs a warning saying so. Set
  ``train.max_steps`` to get a decay.

Worked example, learning_rate 1e-3, warmup_steps 10, max_steps 110, min_lr_ratio 0.1, cosine::

    step 0 -> 1e-4 (1/10 of warmup)   step 9 -> 1e-3   step 60 -> 5.5e-4   step 110 -> 1e-4

The multiplier is applied by ``torch.optim.lr_scheduler.LambdaLR``, which DeepSpeed steps once per
optimizer step and saves in its checkpoints, so a resumed run continues the same curve.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from pipelines.config import TrainConfig

logger = logging.getLogger(__name__)


def effective_scheduler(train: TrainConfig) -> str:
    """The schedule actually used: cosine/linear need ``max_steps``; without it, constant after warmup."""
    if train.lr_scheduler != "constant" and train.max_steps is None:
        return "constant"
    return train.lr_scheduler


def lr_multiplier(train: TrainConfig) -> Callable[[int], float]:
    """``step -> factor`` on ``train.learning_rate`` (step counts completed optimizer steps, from 0)."""
    kind = effective_scheduler(train)
    warmup = train.warmup_steps
    total = train.max_steps or 0
    floor = train.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * (1.0 - progress)  # linear

    return factor


def build_scheduler(optimizer, train: TrainConfig):  # -> torch.optim.lr_scheduler.LambdaLR
    """A ``LambdaLR`` over ``optimizer`` following :func:`lr_multiplier`; warns when decay was dropped."""
    from torch.optim.lr_scheduler import LambdaLR

    if effective_scheduler(train) != train.lr_scheduler:
        logger.warning(
            "train.lr_scheduler=%s needs train.max_steps to size the decay on a stream of unknown length; "
            "using warmup + constant LR", train.lr_scheduler,
        )
    return LambdaLR(optimizer, lr_multiplier(train))
