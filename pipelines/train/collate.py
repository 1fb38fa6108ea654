"""Packed rows -> model inputs, with packed samples kept apart.

A row from ``build_dataset`` holds several samples back to back; ``position_ids`` restart at 0 where
each sample starts (docs/design.md). Two ways keep the samples from attending to each other:

* ``"mask"`` (CPU, sdpa, eager): pad the rows of a micro-batch to a common length and build a 4D
  additive block-diagonal causal mask ``[B, 1, L, L]`` (0 = attend, dtype-min = blocked). transformers
  passes a 4D mask through untouched (``masking_utils._preprocess_mask_arguments``) to sdpa and eager.
* ``"flatten"`` (GPU flash-attention-2): concatenate the micro-batch into one row ``[1, T]`` with no
  padding and no mask; flash-attention's varlen kernel finds sample boundaries from ``position_ids``
  (transformers' ``_is_packed_sequence`` needs batch size 1, hence the flattening).

Worked example, one row of two samples (``a`` 3 tokens, ``b`` 2 tokens)::

    position_ids  0 1 2 0 1         segment  0 0 0 1 1
    mask (x = may attend)   a0 a1 a2 b0 b1
                        a0   x
                        a1   x  x
                        a2   x  x  x
                        b0            x
                        b1            x  x

The label of the first token of every sample is set to -100: the model shifts labels by one, so
without that, the last token of ``a`` would be trained to predict the first token of ``b`` -- a
cross-sample target that does not exist when the samples run alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

try:  # Ray Data's marker base class; without Ray (benchmarks/gpu_check.py on a bare GPU box) a plain object
    from ray.data.collate_fn import NumpyBatchCollateFn
except ImportError:  # pragma: no cover - exercised by tests/test_gpu_check.py with Ray blocked
    NumpyBatchCollateFn = object  # type: ignore[assignment,misc]

from pipelines.tokenize.tokenizer import IGNORE_INDEX

CollateMode = Literal["mask", "flatten"]


def _rows(column: np.ndarray | Sequence) -> list[np.ndarray]:
    """Ray hands list columns over as a 2D array (equal lengths) or an object array of 1D arrays."""
    if isinstance(column, np.ndarray) and column.dtype != object and column.ndim == 2:
        return list(column)
    return [np.asarray(r) for r in column]


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Number the samples of each row: a new segment starts wherever the position does not go up by 1.

    ``[[0, 1, 2, 0, 1, 0]] -> [[0, 0, 0, 1, 1, 2]]`` (the same rule transformers uses for packing).
    """
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive 4D mask ``[B, 1, L, L]``: token i may see token j iff same sample and j <= i."""
    seg = segment_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None, :, :]


def mask_first_labels(labels: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """Set the label of every sample's first token (position 0) to -100; see the module docstring."""
    out = labels.astype(np.int64, copy=True)
    out[position_ids == 0] = IGNORE_INDEX
    return out


def collate_rows(
    batch: dict[str, np.ndarray | Sequence],
    mode: CollateMode = "mask",
    pad_token_id: int = 0,
    mask_dtype: torch.dtype = torch.float32,
    pad_to_multiple_of: int = 8,
) -> dict[str, torch.Tensor]:
    """Turn a batch of packed rows into ``input_ids, labels, position_ids`` (+ ``attention_mask``).

    Padding (mode ``"mask"``) gets ``pad_token_id``, label -100 and positions ``0..n-1``, so it is one
    more isolated "sample" that nobody attends to and that carries no loss. Extra keys ``num_rows`` and
    ``num_tokens`` (real, unpadded) feed the throughput and packing-efficiency metrics.
    """
    ids = _rows(batch["input_ids"])
    pos = _rows(batch["position_ids"])
    labels = [mask_first_labels(lab, p) for lab, p in zip(_rows(batch["labels"]), pos, strict=True)]
    lengths = [len(r) for r in ids]
    if mode == "flatten":
        out = {
            "input_ids": torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
            "labels": torch.from_numpy(np.concatenate(labels))[None],
            "position_ids": torch.from_numpy(np.concatenate(pos).astype(np.int64))[None],
        }
    else:
        out = _pad(ids, labels, pos, pad_token_id, pad_to_multiple_of)
        out["attention_mask"] = block_causal_mask(out["position_ids"], mask_dtype)
    out["num_rows"] = torch.tensor(len(ids))
    out["num_tokens"] = torch.tensor(sum(lengths))
    return out


def _pad(ids, labels, pos, pad_token_id: int, multiple: int) -> dict[str, torch.Tensor]:
    longest = max(len(r) for r in ids)
    length = -(-longest // multiple) * multiple if multiple > 1 else longest
    n = len(ids)
    input_ids = np.full((n, length), pad_token_id, dtype=np.int64)
    label_arr = np.full((n, length), IGNORE_INDEX, dtype=np.int64)
    pos_arr = np.tile(np.arange(length, dtype=np.int64), (n, 1))
    for i, (r_ids, r_lab, r_pos) in enumerate(zip(ids, labels, pos, strict=True)):
        k = len(r_ids)
        input_ids[i, :k] = r_ids
        label_arr[i, :k] = r_lab
        pos_arr[i, :k] = r_pos
        pos_arr[i, k:] = np.arange(length - k)  # padding = its own sample starting at position 0
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(label_arr),
        "position_ids": torch.from_numpy(pos_arr),
    }


def dummy_batch(
    mode: CollateMode, pad_token_id: int = 0, mask_dtype: torch.dtype = torch.float32, length: int = 8
) -> dict[str, torch.Tensor]:
    """A micro-batch with no supervised token, for a rank whose data ran out before the others'.

    It still runs forward and backward (ZeRO-3 gathers parameters collectively, and every rank must
    join the gradient reduction) but adds nothing to the gradient. Its ``num_rows``/``num_tokens`` are 0.
    """
    rows = {
        "input_ids": [np.full(length, pad_token_id)],
        "labels": [np.full(length, IGNORE_INDEX)],
        "position_ids": [np.arange(length)],
    }
    out = collate_rows(rows, mode, pad_token_id, mask_dtype, pad_to_multiple_of=1)
    out["num_rows"] = torch.tensor(0)
    out["num_tokens"] = torch.tensor(0)
    return out


class PackedCollate(NumpyBatchCollateFn):
    """:func:`collate_rows` as a Ray Data collate function (runs in the iterator's prefetch threads)."""

    def __init__(self, mode: CollateMode, pad_token_id: int, mask_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.mode = mode
        self.pad_token_id = pad_token_id
        self.mask_dtype = mask_dtype

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return collate_rows(batch, self.mode, self.pad_token_id, self.mask_dtype)
