"""Packing units and resume positions: the one owner of the ``unit_*`` columns and :class:`ResumePoint`.

A *unit* is a run of consecutive records of one file (``data.pack_buffer_size`` of them). It is
packed on its own, so its rows depend only on its records and the config, and a stream position is
"file, unit, rows done". The stream's first unit (row 0 of the first file of an epoch's read order)
is smaller: it ends once its records reach :data:`FIRST_UNIT_BYTES`, so the first packed row comes
after ~300 Alpaca-sized records (256 kB) instead of a whole pack buffer (a read task of its own carries
it, see ``ShardDatasource.get_read_tasks``). Like every boundary it
depends only on the data and the config, so a resumed run cuts the same units.
The unit travels *in the data*, as constant columns, never as a block boundary the runtime must keep:

* read blocks (``pipelines.sources.datasource``) hold one row per unit (lists of sample ids and records)
  and :data:`UNIT_FIELDS`; :func:`explode_units` makes that one row per record, and the tokenizer
  stage copies the unit columns through (:func:`carry_unit_columns`);
* packed rows (``pipelines.stream.packing``) carry :data:`ROW_UNIT_FIELDS`: the unit's location plus the
  row's index among the unit's packed rows;
* the trainer turns the last row it trained on into a :class:`ResumePoint` (:func:`point_after`).

Worked example, units of 1000 records; the 3rd of 7 rows of the unit starting at row 2000 of the
2nd file in the epoch's read order was the last one trained on::

    point_after({"unit_id": (5 << 40) | 2000, "unit_start_byte": 81920, "unit_end_row": 3000,
                 "unit_end_byte": 122880, "unit_row": 2, "unit_rows": 7}, {5: 1}, epoch=0)
    -> ResumePoint(epoch=0, file_pos=1, row=2000, byte=81920, skip_rows=3)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.seeds import file_order
from pipelines.sources.listing import SourceTable, split_sample_id

__all__ = [
    "ROW_UNIT_FIELDS",
    "UNIT_FIELDS",
    "Cursor",
    "ResumePoint",
    "UnitInfo",
    "FIRST_UNIT_BYTES",
    "STREAM_LAYOUT",
    "READ_BLOCK_BYTES",
    "carry_unit_columns",
    "explode_units",
    "file_positions",
    "ordered_files",
    "point_after",
    "row_unit_columns",
    "unit_columns",
]

# Ray Data's target block size for the pipeline's datasets. A read task's output is buffered until it
# exceeds this, so a unit block (one row, hence never sliced) of at least this size leaves its task as
# soon as it is read instead of when the task ends (the default is 128 MB). The same setting slices the
# tokenizer stage's packed rows into blocks of about this size (Ray 2.60 has one per dataset), and a
# running task may only be 2 blocks ahead of Ray Data's executor, so small blocks starve the tokenizer
# actor (docs/design.md, "Placement and timing notes").
READ_BLOCK_BYTES = 4 << 20
# The stream's first unit ends once its records reach this many characters (about 300 Alpaca records,
# 60 k GPT-2 tokens: tokenized in ~0.2 s). Its read task holds only this unit, so its block leaves at once.
FIRST_UNIT_BYTES = 256 << 10

# Bump when the same data and config would be cut into other units or shuffled differently; it is part
# of the stream fingerprint, so a checkpoint of another layout is refused instead of resumed off by rows.
# 2: the stream's first unit is small (FIRST_UNIT_BYTES); unit rows shuffled by pipelines.seeds.unit_shuffle_seed.
# 3: FIRST_UNIT_BYTES 256 kB -> 4 MB (with READ_BLOCK_BYTES).
# 4: pre-tokenized MDS streams read as id columns: a sample adds 8 bytes per token (int32 ids and labels)
#    to its unit's size, where its JSON record text counted before.
# 5: FIRST_UNIT_BYTES 4 MB -> 256 kB (the first unit has a read task of its own).
STREAM_LAYOUT = 5

# Constant within a unit; they let packing verify it saw a whole unit and let the trainer turn
# "rows consumed" into a resume position.
UNIT_FIELDS = [
    ("unit_id", pa.int64()),  # sample id of the unit's first record
    ("unit_start_byte", pa.int64()),  # byte offset of that record's line (-1: not seekable)
    ("unit_end_row", pa.int64()),  # row after the unit's last record, in its file
    ("unit_end_byte", pa.int64()),  # byte offset after the unit (-1: not seekable)
    ("unit_records", pa.int32()),  # records in the unit (after the eval split)
    ("unit_skip", pa.int32()),  # packed rows of this unit already trained on (resume)
]
# Where each packed row sits in its unit: what resumption needs.
ROW_UNIT_FIELDS = [
    ("unit_id", pa.int64()),
    ("unit_start_byte", pa.int64()),
    ("unit_end_row", pa.int64()),
    ("unit_end_byte", pa.int64()),
    ("unit_row", pa.int32()),  # index of this row among the unit's packed rows
    ("unit_rows", pa.int32()),  # packed rows the unit produced
]


@dataclass(frozen=True)
class Cursor:
    """Where reading a file starts: a row and, when known, the byte offset of that row's line."""

    row: int = 0
    byte: int = -1  # -1: unknown or not seekable (compressed) -> skip rows from the start

    @property
    def at_start(self) -> bool:
        return self.row == 0


@dataclass(frozen=True)
class ResumePoint:
    """Where a stream starts: file ``file_pos`` of the epoch's read order, at a unit boundary.

    ``row``/``byte`` locate the unit's first record in that file; ``skip_rows`` of that unit's packed
    rows were already trained on. Made by :func:`point_after` from the rows a run consumed.
    """

    epoch: int = 0
    file_pos: int = 0
    row: int = 0
    byte: int = -1
    skip_rows: int = 0

    @property
    def cursor(self) -> Cursor:
        """Where the first file is opened."""
        return Cursor(self.row, self.byte)


@dataclass(frozen=True)
class UnitInfo:
    """The unit columns of a read block, as one value (see :data:`UNIT_FIELDS`)."""

    unit_id: int
    start_byte: int
    end_row: int
    end_byte: int
    skip: int = 0

    @classmethod
    def of(cls, unit: pa.Table) -> UnitInfo:
        """The unit of a table holding one unit's records (read or tokenized)."""
        col = unit.column
        return cls(col("unit_id")[0].as_py(), col("unit_start_byte")[0].as_py(), col("unit_end_row")[0].as_py(),
                   col("unit_end_byte")[0].as_py(), col("unit_skip")[0].as_py())


def _const(n: int, value: int, typ: pa.DataType) -> pa.Array:
    return pa.array(np.full(n, value), typ)


def unit_columns(info: UnitInfo, n_records: int) -> list[pa.Array]:
    """The :data:`UNIT_FIELDS` columns of a read block's one row: unit ``info`` holding ``n_records`` records."""
    values = (info.unit_id, info.start_byte, info.end_row, info.end_byte, n_records, info.skip)
    return [_const(1, v, typ) for v, (_, typ) in zip(values, UNIT_FIELDS, strict=True)]


def carry_unit_columns(src: pa.Table, dst: pa.Table) -> pa.Table:
    """``dst`` (same rows as ``src``, e.g. the tokenizer's output) with ``src``'s unit columns appended."""
    for name, _ in UNIT_FIELDS:
        dst = dst.append_column(name, src.column(name))
    return dst


def explode_units(units: pa.Table) -> pa.Table:
    """Unit rows (list columns: ``sample_id`` and the records) -> one row per record, unit columns repeated.

    Example: one unit row ``sample_id=[7, 8], record=['{..}', '{..}'], unit_id=7, ...`` -> two rows
    ``(7, '{..}', unit_id=7, ...)`` and ``(8, '{..}', unit_id=7, ...)``. Id-column blocks explode the
    same way (``input_ids=[[1, 2], [3]]`` -> rows ``[1, 2]`` and ``[3]``). A table already holding one
    row per record is returned as is.
    """
    if not pa.types.is_list(units.schema.field("sample_id").type):
        return units
    unit_names = {name for name, _ in UNIT_FIELDS}
    record_names = [name for name in units.column_names if name not in unit_names]
    sid = units.column("sample_id").combine_chunks()
    parents = pc.list_parent_indices(sid)
    columns = [units.column(name).combine_chunks().flatten() for name in record_names]
    columns += [units.column(name).take(parents) for name, _ in UNIT_FIELDS]
    return pa.Table.from_arrays(columns, names=[*record_names, *(name for name, _ in UNIT_FIELDS)])


def row_unit_columns(info: UnitInfo, n_rows: int, skip: int) -> list[pa.Array]:
    """The :data:`ROW_UNIT_FIELDS` columns of a unit's packed rows ``skip..n_rows-1``."""
    k = n_rows - skip
    return [
        _const(k, info.unit_id, pa.int64()),
        _const(k, info.start_byte, pa.int64()),
        _const(k, info.end_row, pa.int64()),
        _const(k, info.end_byte, pa.int64()),
        pa.array(np.arange(skip, n_rows), pa.int32()),
        _const(k, n_rows, pa.int32()),
    ]


def point_after(row: Mapping[str, Any], file_pos_of: Mapping[int, int], epoch: int) -> ResumePoint:
    """The resume point right after ``row`` (a packed row's :data:`ROW_UNIT_FIELDS`) was trained on.

    ``file_pos_of`` maps a source index to its position in the epoch's read order (:func:`file_positions`).
    """
    source, first_row = split_sample_id(row["unit_id"])
    file_pos = file_pos_of[source]
    if row["unit_row"] + 1 < row["unit_rows"]:
        return ResumePoint(epoch, file_pos, first_row, row["unit_start_byte"], row["unit_row"] + 1)
    return ResumePoint(epoch, file_pos, row["unit_end_row"], row["unit_end_byte"], 0)


def dataset_files(table: SourceTable, datasets: list[int] | None = None) -> list[int]:
    """Indices into ``table.files`` of the ``data.datasets`` entries ``datasets`` (all: ``None``), in table order."""
    return [f.source_index for f in table.files if datasets is None or f.dataset_index in datasets]


def ordered_files(table: SourceTable, seed: int, epoch: int, datasets: list[int] | None = None) -> list[int]:
    """Indices into ``table.files`` in the epoch's read order, optionally only some dataset entries."""
    chosen = dataset_files(table, datasets)
    return [chosen[i] for i in file_order(len(chosen), seed, epoch)]


def file_positions(table: SourceTable, seed: int, epoch: int, datasets: list[int] | None = None) -> dict[int, int]:
    """Source index -> position in the epoch's read order (what :func:`point_after` needs)."""
    return {source: pos for pos, source in enumerate(ordered_files(table, seed, epoch, datasets))}

