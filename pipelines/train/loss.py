"""Loss = mean over the supervised tokens of the whole global batch.

Not a mean of per-row or per-rank means: with packing and sharding, rows and ranks hold different
numbers of supervised tokens, and averaging averages would weight a token in a short row more than
one in a long row. Worked example, 2 ranks, 1 micro-batch each::

    rank 0: 30 supervised tokens, summed token loss 60   (mean 2.0)
    rank 1: 10 supervised tokens, summed token loss 40   (mean 4.0)
    mean of means = 3.0;  global token mean = (60 + 40) / (30 + 10) = 2.5   <- what we optimise

Each rank knows the global token count N (one all_reduce before the step's forward passes), so
micro-batch ``m`` back-propagates ``sum_loss_m * scale`` with ``scale = W * G / N``: DeepSpeed then
divides by G (``engine.backward(scale_wrt_gas=True)``) and averages gradients over the W data-parallel
ranks, leaving exactly ``sum over all ranks and micro-batches of sum_loss / N``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipelines.train.collate import IGNORE_INDEX


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``[B, L-1]`` (fp32); 0 where the shifted label is -100.

    Labels are *not* pre-shifted (docs/design.md): logits at position t predict labels[t + 1].
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)


def supervised_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss target (after the shift)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses of one micro-batch; keeps the graph alive even with no supervised token."""
    losses = token_losses(logits, labels)
    # `+ 0 * logits.sum()`: a micro-batch with no targets still back-propagates (zeros), so every rank
    # joins DeepSpeed's gradient reduction hooks the same number of times.
    return losses.sum() + 0.0 * logits.sum()


def backward_scale(world_size: int, grad_accum: int, global_tokens: int) -> float:
    """Factor for a micro-batch's summed loss so DeepSpeed's /G and /W averaging yields a global token mean."""
    return world_size * grad_accum / max(global_tokens, 1)
