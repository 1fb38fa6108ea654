"""The record format between read tasks and the tokenizer: JSON object text, token arrays compact.

A record is one JSON object per sample (``'{"instruction": "...", "output": "..."}'``), so a block's
schema never depends on the data. Token id arrays of pre-tokenized sources would cost ~1 us per id
as JSON lists (dumped by the reader, parsed by the tokenizer: ~1.3 M ids/s per core), so the MDS reader
writes them as base64 of their raw bytes, which the tokenizer decodes without a per-id step::

    array([464, 2068], dtype=int32)  <->  {"dtype": "int32", "b64": "0AEAABQIAAA="}

A JSON list of integers is accepted too (JSONL sources with ``input_ids``).

When every file of a stream is pre-tokenized MDS, records are not JSON at all: the MDS reader yields
a :class:`TokenRecord` per sample and read blocks hold the ids as Arrow list columns
(``pipelines.sources.read.TOKEN_SCHEMA``).
"""

from __future__ import annotations

import base64
from typing import Any, NamedTuple

import numpy as np

__all__ = ["TokenRecord", "as_token_ids", "pack_array", "unpack_array"]

DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


def pack_array(arr: np.ndarray) -> dict[str, str]:
    """A 1-D integer array as ``{"dtype", "b64"}`` (little-endian raw bytes)."""
    arr = np.ascontiguousarray(arr)
    dtype = arr.dtype.newbyteorder("<")
    return {"dtype": dtype.name, "b64": base64.b64encode(arr.astype(dtype, copy=False).tobytes()).decode("ascii")}


def unpack_array(value: Any) -> np.ndarray:
    """An int64 array from :func:`pack_array`'s form or a JSON list of integers; ValueError/TypeError if
    neither (``[464.5, 2068]`` or ``[true, 1]`` is an error, not ``[464, 2068]``)."""
    if isinstance(value, dict):
        dtype = value.get("dtype")
        if dtype not in DTYPES or not isinstance(value.get("b64"), str):
            raise ValueError(f"not a packed integer array: {sorted(value)}")
        return np.frombuffer(base64.b64decode(value["b64"]), np.dtype(dtype).newbyteorder("<")).astype(np.int64)
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" and arr.size:
        raise ValueError(f"not a list of integers ({arr.dtype} values)")
    return arr.astype(np.int64)


class TokenRecord(NamedTuple):
    """A pre-tokenized sample as the MDS reader yields it for id-column blocks (labels: the ids when absent)."""

    input_ids: np.ndarray  # int32, 1-D
    labels: np.ndarray  # int32, 1-D (not yet checked to align with the ids)

    @property
    def nbytes(self) -> int:
        """What the sample adds to its unit's size (see ``pipelines.sources.read.read_files``)."""
        return self.input_ids.nbytes + self.labels.nbytes


INT32_MIN, INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max


def as_token_ids(value: Any, column: str) -> np.ndarray:
    """A token column's value as a 1-D int32 array; ValueError naming the column if it is not one.

    Example: ``array([464, 2068], dtype=int64)`` -> ``array([464, 2068], dtype=int32)``; a value
    beyond int32 is an error here (the vocabulary check could not name it after the cast).
    """
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise ValueError(f"column {column!r} should be a flat list of integer token ids, got shape {arr.shape} of {arr.dtype}")
    wide = arr.dtype.itemsize > 4 or arr.dtype == np.uint32
    if wide and arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        bad = arr[(arr < INT32_MIN) | (arr > INT32_MAX)][0]
        raise ValueError(f"column {column!r}: token id {bad} is not a valid token id (beyond int32)")
    return arr.astype(np.int32, copy=False)
