"""``pipelines.arrays``: list columns <-> numpy, with the values and the copies they promise."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipelines.arrays import list_array, list_flat, list_parts

ROWS = [np.array([5, 9, 2], np.int32), np.array([], np.int32), np.array([7, 7], np.int32)]


def _address(values: np.ndarray) -> int:
    return values.__array_interface__["data"][0]


def test_one_chunk_column_is_read_in_place():
    arr = list_array(ROWS)
    col = pa.chunked_array([arr])
    offsets, values = list_flat(col)
    assert offsets.tolist() == [0, 3, 3, 5] and values.tolist() == [5, 9, 2, 7, 7]
    assert _address(values) == arr.values.buffers()[1].address  # the column's own buffer: no copy


def test_several_chunks_and_slices_give_the_rows():
    arr = list_array(ROWS)
    col = pa.chunked_array([arr, list_array([np.array([1], np.int32)])])
    assert [p.tolist() for p in list_parts(col)] == [[5, 9, 2], [], [7, 7], [1]]
    sliced = arr.slice(1, 2)  # offsets then index into the whole values buffer
    offsets, values = list_flat(sliced)
    assert [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)] == [[], [7, 7]]
    assert [p.tolist() for p in list_parts(pa.chunked_array([sliced]))] == [[], [7, 7]]
