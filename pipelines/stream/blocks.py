"""Packed-row blocks between the feeder and the ranks: references and row ranges, never the tokens.

The feeder reads only a block's small columns (row lengths, ``sample_ids``, the ``unit_*`` position
columns), on the node that holds it (:func:`chunks_of`), and hands each rank a :class:`RankItem`: block
references and row ranges. A rank fetches its blocks itself (:func:`fetch_blocks`) and reads its rows
as numpy views of the object store's buffers (:class:`BlockColumns`). Worked example, 2 ranks x 2 rows,
a step mixing 3 rows of block A (source 0) and 1 row of block B::

    picks   A[5:7]  B[0:1]  A[7:8]
    rank 0  RowSlice(A, 5, 7)
    rank 1  RowSlice(B, 0, 1), RowSlice(A, 7, 8)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipelines.arrays import list_array, list_flat
from pipelines.stream.mixing import Chunk

__all__ = ["ROW_COLUMNS", "BlockColumns", "RankItem", "RowSlice", "as_arrow", "as_list_columns", "block_nodes",
           "chunks_of", "chunks_put", "fetch_blocks"]

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "sample_ids")


@dataclass(frozen=True)
class RowSlice:
    """Rows ``start .. stop`` of one packed-row block: an ``ObjectRef`` of an Arrow table, or on a
    rank, once :class:`FeederClient` has fetched it, that block's :class:`BlockColumns`."""

    block: Any
    start: int
    stop: int


class BlockColumns:
    """A fetched block's list columns as numpy views (offsets, values), made once per block per rank.

    ``input_ids`` ``[[5, 9, 2], [7, 7]]`` -> offsets ``[0 3 5]``, values ``[5 9 2 7 7]``; rows 0..2 ->
    ``[array([5, 9, 2]), array([7, 7])]``, views of the object store's buffer (no copy of the tokens).
    """

    def __init__(self, table: Any) -> None:
        self.table = as_arrow(table)
        self._parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def rows(self, column: str, start: int, stop: int) -> list[np.ndarray]:
        if column not in self._parts:
            col = self.table.column(column)  # one chunk: zero-copy views (list_flat)
            self._parts[column] = list_flat(col)
        offsets, values = self._parts[column]
        o = offsets[start:stop + 1].tolist()
        return [values[x:y] for x, y in zip(o[:-1], o[1:], strict=True)]


@dataclass(frozen=True)
class RankItem:
    """What one rank gets for one item: where its rows are (``slices``, in order), not the rows."""

    index: int
    kind: str  # "step" | "epoch_end"
    epoch: int
    step: int  # global optimizer step this item is (step items) or follows (epoch_end)
    slices: tuple[RowSlice, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(s.stop - s.start for s in self.slices)

    def columns(self, names: tuple[str, ...] = ROW_COLUMNS) -> dict[str, list[np.ndarray]]:
        """This rank's rows: column -> one numpy view per row (zero-copy out of the object store)."""
        (item,), _ = fetch_blocks([self])
        slices = item.slices
        return {c: [row for s in slices for row in s.block.rows(c, s.start, s.stop)] for c in names}

    def sample_ids(self) -> list[list[int]]:
        """The sample ids of each row (what the ledger records of it; training reads only the token columns)."""
        return [r.tolist() for r in self.columns(("sample_ids",))["sample_ids"]]


def fetch_blocks(items: list[RankItem], have: dict[Any, BlockColumns] | None = None
                 ) -> tuple[list[RankItem], dict[Any, BlockColumns]]:
    """``items`` with every block fetched: one ``ray.get`` for the distinct blocks not in ``have``
    (a block serves consecutive items, often several per response). Returns the items and the
    blocks they use, by reference."""
    have = have or {}
    refs = list(dict.fromkeys(s.block for it in items for s in it.slices if not isinstance(s.block, BlockColumns)))
    missing = [r for r in refs if r not in have]
    got = {r: have[r] for r in refs if r in have}
    if missing:
        got.update(zip(missing, map(BlockColumns, ray.get(missing)), strict=True))
    out = [replace(it, slices=tuple(s if isinstance(s.block, BlockColumns) else replace(s, block=got[s.block])
                                    for s in it.slices)) for it in items]
    return out, got


def as_list_columns(batch: pa.Table) -> pa.Table:
    """``batch`` with its row columns (:data:`ROW_COLUMNS`) as ``list<int>`` arrays, what the feeder and the
    ranks read. A dataset given to the trainer may hold them otherwise: Ray Data turns rows of equal length
    into a tensor column (``[[5, 9], [7, 7]]`` -> an ``ArrowTensorArray`` of shape (2, 2)), and numpy batches
    come back that way."""
    for name in ROW_COLUMNS:
        if name not in batch.column_names or pa.types.is_list(batch.schema.field(name).type):
            continue
        rows = [np.asarray(r) for r in batch.column(name).to_pylist()]
        typ = pa.int64() if name == "sample_ids" else pa.int32()
        batch = batch.set_column(batch.schema.get_field_index(name), name, list_array(rows, typ))
    return batch


def as_arrow(block: Any) -> pa.Table:
    """A Ray Data block as an Arrow table (our packing stage writes Arrow: then as it is)."""
    if isinstance(block, pa.Table):
        return block
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_arrow()


@ray.remote(num_cpus=0)
def _chunk_where_it_lies(block: Any, start: int, stop: int, first_row: int) -> Chunk:
    """:meth:`Chunk.from_table`, run on the node that holds the block: only the small arrays travel."""
    return Chunk.from_table(as_arrow(block), None, start, stop, first_row)


def block_nodes(refs: list[Any]) -> dict[Any, list[str]]:
    """The ids of the nodes holding each block: the owner's own table first (no RPC), else the owner is
    asked. An empty list: the block is inlined (under 100 KB, it travels with its reference)."""
    from ray.experimental import get_local_object_locations, get_object_locations

    locs = get_local_object_locations(refs)
    if missing := [r for r in refs if not (locs.get(r) or {}).get("node_ids")]:
        locs.update(get_object_locations(missing))
    return {r: list((locs.get(r) or {}).get("node_ids") or []) for r in refs}


def chunks_of(ds: ray.data.Dataset) -> Iterator[Chunk]:
    """The dataset's blocks in stream order, as chunks: references plus their small columns.

    A block in this node's object store (or inlined) is read in place, zero-copy. A block on another
    node is not pulled here: a 0-CPU task on that node reads its small columns and returns only those
    (a few KB per block), so the feeder's node (rank 0's) never receives the whole run's tokens. The
    tasks of a bundle's remote blocks are all submitted before the first is awaited.
    """
    here = ray.get_runtime_context().get_node_id()
    rows = 0  # rows of the stream before the next block (numbers the rows of a given dataset, Chunk.from_table)
    for bundle in ds.iter_internal_ref_bundles():
        nodes = block_nodes([entry.ref for entry in bundle.blocks])
        parts: list[tuple[Any, int, int, int, Any]] = []  # block, start, stop, first row, pending task
        for entry, cut in zip(bundle.blocks, bundle.slices, strict=True):
            start, stop = (0, entry.metadata.num_rows) if cut is None else (cut.start_offset, cut.end_offset)
            if stop is None:
                stop = ray.get(entry.ref).num_rows if entry.metadata.num_rows is None else entry.metadata.num_rows
            if stop <= start:
                continue  # no rows: e.g. the block of a read task that yielded no unit, which has no columns
            where, task = nodes[entry.ref], None
            if where and here not in where:
                far = NodeAffinitySchedulingStrategy(where[0], soft=True)
                task = _chunk_where_it_lies.options(scheduling_strategy=far).remote(entry.ref, start, stop, rows)
            parts.append((entry.ref, start, stop, rows, task))
            rows += stop - start
        for ref, start, stop, first, task in parts:
            if task is not None:
                chunk = replace(ray.get(task), block=ref)
            else:
                chunk = Chunk.from_table(as_arrow(ray.get(ref)), ref, start, stop, first)
            if len(chunk):
                yield chunk


def chunks_put(tables: Iterable[pa.Table]) -> Iterator[Chunk]:
    """Packed-row tables made in this process, as chunks: each table is put in this node's object store
    once, and the ranks fetch it as they fetch a Ray Data block."""
    for table in tables:
        if table.num_rows:
            yield Chunk.from_table(table, ray.put(table))
