"""Arrow list columns <-> numpy: the one place that builds and takes apart ``list<int>`` arrays.

A list array is flat ``values`` plus ``offsets`` (n + 1) that delimit its rows; rows ``[1, 2]`` and
``[3]`` are offsets ``[0, 2, 3]``, values ``[1, 2, 3]``. Everything here works on those two arrays,
with no Python object per element.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["list_array", "list_flat", "list_parts", "parts_flat"]

INT32 = pa.int32()


def parts_flat(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, values)`` of numpy pieces, as a list array holds them: ``[[1, 2], [3]]`` ->
    ``([0, 2, 3], [1, 2, 3])``."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    if parts:
        np.cumsum([len(p) for p in parts], out=offsets[1:])
    return offsets, (np.concatenate(parts) if parts else np.zeros(0))


def list_array(parts: list[np.ndarray], dtype: pa.DataType = INT32) -> pa.Array:
    """A list<dtype> Arrow array from numpy pieces, without per-element Python work."""
    offsets, values = parts_flat(parts)
    np_dtype = np.int64 if dtype == pa.int64() else np.int32
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values.astype(np_dtype, copy=False), dtype))


def list_flat(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, values)`` of a list column; the offsets index into the values (zero-copy where Arrow allows:
    a plain array or a one-chunk column; several chunks are combined, a copy)."""
    if isinstance(col, pa.ChunkedArray):
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    return arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False)


def list_parts(col: pa.ChunkedArray | pa.Array) -> list[np.ndarray]:
    """Each row of a list column as a numpy view."""
    offsets, values = list_flat(col)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
