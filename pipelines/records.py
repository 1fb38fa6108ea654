"""The record format between read tasks and the tokenizer: JSON object text, token arrays compact.

A record is one JSON object per sample (``'{"instruction": "...", "output": "..."}'``), so a block's
schema never depends on the data. Token id arrays of pre-tokenized sources would cost ~1 us per id
as JSON lists (dumped by the reader, parsed by the tokenizer: ~1.3 M ids/s per core), so the MDS reader
writes them as base64 of their raw bytes, which the tokenizer decodes without a per-id step::

    array([464, 2068], dtype=int32)  <->  {"dtype": "int32", "b64": "0AEAABQIAAA="}

A JSON list of integers is accepted too (JSONL sources with ``input_ids``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

__all__ = ["pack_array", "unpack_array"]

DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


def pack_array(arr: np.ndarray) -> dict[str, str]:
    """A 1-D integer array as ``{"dtype", "b64"}`` (little-endian raw bytes)."""
    arr = np.ascontiguousarray(arr)
    dtype = arr.dtype.newbyteorder("<")
    return {"dtype": dtype.name, "b64": base64.b64encode(arr.astype(dtype, copy=False).tobytes()).decode("ascii")}


def unpack_array(value: Any) -> np.ndarray:
    """An int64 array from :func:`pack_array`'s form or a JSON list; ValueError/TypeError if neither."""
    if isinstance(value, dict):
        dtype = value.get("dtype")
        if dtype not in DTYPES or not isinstance(value.get("b64"), str):
            raise ValueError(f"not a packed integer array: {sorted(value)}")
        return np.frombuffer(base64.b64decode(value["b64"]), np.dtype(dtype).newbyteorder("<")).astype(np.int64)
    return np.asarray(value, dtype=np.int64)
