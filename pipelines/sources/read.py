"""Reading the resolved files into blocks of packing units, in any process (no Ray Data here: the feeder
reads pre-tokenized sources in its own process with these, and :mod:`pipelines.sources.datasource` runs them
in Ray Data's read tasks).

:func:`read_files` streams files and yields one Arrow block per *packing unit* (``unit_size``
consecutive records of one file), holding **one row**: the unit is atomic in the data, so however
Ray Data re-buffers or slices blocks it can never cut a unit in two::

    sample_id: list<int64>    (source_index << 40) | row per record, see pipelines.sources.listing
    record:    list<string>   each record as a JSON object text, e.g. '{"instruction": "...", "output": "..."}'
    unit_*:                   where the unit starts and ends in its file (pipelines.stream.units.UNIT_FIELDS)

``pipelines.stream.units.explode_units`` turns such blocks into one row per record (the tokenizer does).

A stream whose files are all pre-tokenized MDS (``ReadOptions.token_ids``) has no JSON records: its
blocks hold the ids themselves, ``input_ids``/``labels: list<list<int32>>`` in place of ``record``
(:data:`TOKEN_SCHEMA`), from the shard's arrays to the packer without a Python object per token.

Records stay JSON text until the tokenizer stage parses them, so a block's schema never depends on
the data (nested chat turns, optional fields).

Bad bytes are reported here (``data.on_bad_record``): non-UTF-8 lines, empty files, a JSON file
that is not an array. Bad JSON *content* is reported by the tokenizer stage, naming file and line.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipelines.arrays import list_array
from pipelines.errors import BadRecordError
from pipelines.seeds import splitmix64
from pipelines.sources.listing import SourceFile, SourceTable, make_sample_id
from pipelines.sources.records import TokenRecord
from pipelines.stats import Counts, StatsSink
from pipelines.storage import StorageOptions, filesystem_for
from pipelines.stream.units import (
    FIRST_UNIT_BYTES,
    UNIT_FIELDS,
    Cursor,
    UnitInfo,
    explode_units,
    unit_columns,
)

BLOCK_RECORDS = 1024
READ_CHUNK_BYTES = 8 << 20
MAX_UNIT_BYTES = 32 << 20
SCHEMA = pa.schema([("sample_id", pa.list_(pa.int64())), ("record", pa.list_(pa.string())), *UNIT_FIELDS])
TOKEN_SCHEMA = pa.schema([("sample_id", pa.list_(pa.int64())), ("input_ids", pa.list_(pa.list_(pa.int32()))),
                          ("labels", pa.list_(pa.list_(pa.int32()))), *UNIT_FIELDS])


@dataclass(frozen=True)
class ReadOptions:
    """What every read task needs besides its files. Cheap to serialize."""

    storage: StorageOptions
    on_bad_record: str  # raise | skip
    text_fields: tuple[str, ...]  # per dataset: the key a plain-text file's content is stored under
    eval_fraction: float = 0.0
    split: str = "train"
    unit_size: int = 10000  # records per packing unit (data.pack_buffer_size)
    first_unit_source: int = -1  # the stream's first file: its first unit is small (see pipelines.stream.units)
    token_ids: bool = False  # every file is pre-tokenized MDS: blocks of TOKEN_SCHEMA, records are TokenRecords

    @property
    def schema(self) -> pa.Schema:
        """The read blocks' schema."""
        return TOKEN_SCHEMA if self.token_ids else SCHEMA


BadHandler = Callable[[str, str], None]  # (location, message)
FROM_START = Cursor()


def _fs(file: SourceFile, opts: StorageOptions) -> pafs.FileSystem:
    return filesystem_for(file.url, opts)[0]


COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".zstd", ".lz4", ".br")


# A reader ``(fs, file, bad, cursor)`` yields (row, record as JSON text, start byte, end byte) per
# record; bytes are -1 where the format has no seekable offsets. It calls ``bad(where, message)`` for
# unusable bytes. The MDS reader for id-column blocks yields a TokenRecord in place of the text.
Record = tuple[int, str | TokenRecord, int, int]
Reader = Callable[[pafs.FileSystem, SourceFile, BadHandler, Cursor], Iterator[Record]]


def _iter_lines(fs: pafs.FileSystem, path: str, cursor: Cursor) -> Iterator[tuple[int, bytes, int, int]]:
    """``(row, line, start byte, end byte)`` of a text file, streamed in chunks, from ``cursor``.

    Uncompressed files are opened for random access and seeked to ``cursor.byte``; compressed ones
    (by extension) are decompressed from the start and rows before ``cursor.row`` are skipped.
    """
    seekable = cursor.byte >= 0 and not path.lower().endswith(COMPRESSED_SUFFIXES)
    if seekable:
        stream = fs.open_input_file(path)
        stream.seek(cursor.byte)
        row, pos = cursor.row, cursor.byte
    else:
        stream = fs.open_input_stream(path)
        row, pos = 0, 0
    compressed = path.lower().endswith(COMPRESSED_SUFFIXES)
    rest = b""
    with stream:
        while True:
            chunk = stream.read(READ_CHUNK_BYTES)
            if not chunk:
                break
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                end = pos + len(line) + 1
                if row >= cursor.row:
                    yield row, line, (-1 if compressed else pos), (-1 if compressed else end)
                row, pos = row + 1, end
    if rest and row >= cursor.row:
        yield row, rest, (-1 if compressed else pos), (-1 if compressed else pos + len(rest))


def _decode(raw: bytes, where: str, bad: BadHandler) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad(where, f"not valid UTF-8 (byte {err.start}: {raw[err.start:err.start + 4]!r})")
        return None


def read_jsonl(fs: pafs.FileSystem, file: SourceFile, bad: BadHandler,
               cursor: Cursor = FROM_START) -> Iterator[Record]:
    """JSON Lines: one record per line; blank lines keep their row number but hold no record."""
    any_line = False
    for row, raw, start, end in _iter_lines(fs, file.path, cursor):
        if not raw.strip():
            continue
        any_line = True
        text = _decode(raw, f"{file.url} line {row + 1}", bad)
        if text is not None:
            yield row, text, start, end
    if not any_line and cursor.at_start:
        bad(file.url, "empty file")


def read_text(fs: pafs.FileSystem, file: SourceFile, bad: BadHandler,
              cursor: Cursor = FROM_START, text_field: str = "text") -> Iterator[Record]:
    """Plain text: the whole file is one document (row 0), stored as ``{text_field: ...}``."""
    if not cursor.at_start:
        return
    with fs.open_input_stream(file.path) as stream:
        raw = stream.read()
    if not raw.strip():
        bad(file.url, "empty file")
        return
    text = _decode(raw, f"{file.url}", bad)
    if text is not None:
        yield 0, json.dumps({text_field: text}, ensure_ascii=False), -1, -1


def read_json_array(fs: pafs.FileSystem, file: SourceFile, bad: BadHandler,
                    cursor: Cursor = FROM_START) -> Iterator[Record]:
    """A JSON file: an array of records (the whole file is parsed: use JSONL for big data), or JSON Lines."""
    with fs.open_input_stream(file.path) as stream:
        raw = stream.read()
    head = raw.lstrip()[:1]
    if not head:
        bad(file.url, "empty file")
        return
    if head != b"[":  # JSON Lines saved as .json
        yield from read_jsonl(fs, file, bad, Cursor(cursor.row))
        return
    text = _decode(raw, file.url, bad)
    if text is None:
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        bad(file.url, f"malformed JSON at line {err.lineno} column {err.colno}: {err.msg}")
        return
    for row in range(cursor.row, len(records)):
        yield row, json.dumps(records[row], ensure_ascii=False), -1, -1


def read_parquet(fs: pafs.FileSystem, file: SourceFile, bad: BadHandler,
                 cursor: Cursor = FROM_START) -> Iterator[Record]:
    """Parquet: streamed by row group (groups before ``cursor.row`` are not read); rows become JSON records."""
    with fs.open_input_file(file.path) as f:
        pf = pq.ParquetFile(f)
        if pf.metadata.num_rows == 0:
            bad(file.url, "empty file")
        row = 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if row + n <= cursor.row:
                row += n
                continue
            for batch in pf.iter_batches(batch_size=BLOCK_RECORDS, row_groups=[g]):
                for rec in batch.to_pylist():
                    if row >= cursor.row:
                        yield row, json.dumps(rec, ensure_ascii=False, default=str), -1, -1
                    row += 1


READERS: dict[str, Reader] = {
    "jsonl": read_jsonl,
    "json": read_json_array,
    "parquet": read_parquet,
    "text": read_text,
}


def reader_for(file: SourceFile, opts: ReadOptions) -> Reader:
    """The reader of a file's format; MDS's is imported on first use, in whichever process reads."""
    if file.format == "text":
        return functools.partial(read_text, text_field=opts.text_fields[file.dataset_index])
    if file.format == "mds":
        from pipelines.mds.reader import read_mds, read_mds_ids

        return read_mds_ids if opts.token_ids else read_mds
    if opts.token_ids:
        raise BadRecordError(f"{file.url}: only pre-tokenized MDS shards can be read as id columns, not {file.format!r}")
    if file.format not in READERS:
        raise BadRecordError(f"{file.url}: no reader for format {file.format!r}")
    return READERS[file.format]


def in_eval_split(sample_ids: np.ndarray, fraction: float) -> np.ndarray:
    """Deterministic held-out membership: splitmix64(sample_id) / 2**64 < fraction."""
    x = splitmix64(sample_ids)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


@dataclass
class _Unit:
    """Records of one packing unit under construction (consecutive rows of one file)."""

    file: SourceFile
    ids: list[int]
    records: list[str] | list[TokenRecord]
    start_byte: int
    skip: int = 0
    nbytes: int = 0


def _unit_table(u: _Unit, end_row: int, end_byte: int, opts: ReadOptions) -> pa.Table:
    """One unit as a block: its records plus constant unit columns (see module docstring)."""
    arr = np.asarray(u.ids, dtype=np.int64)
    records = u.records
    if opts.eval_fraction > 0:
        keep = in_eval_split(arr, opts.eval_fraction)
        if opts.split != "eval":
            keep = ~keep
        idx = np.nonzero(keep)[0]
        arr, records = arr[idx], [records[i] for i in idx]
    info = UnitInfo(u.ids[0], u.start_byte, end_row, end_byte, u.skip)
    if opts.token_ids:
        ids = _one_row(list_array([r.input_ids for r in records]))
        # Labels that are the ids (a shard without labels) share the ids' buffers instead of a second copy.
        same = all(r.labels is r.input_ids for r in records)
        payload = [ids, ids if same else _one_row(list_array([r.labels for r in records]))]
    else:
        payload = [pa.array([records], pa.list_(pa.string()))]
    columns = [pa.array([arr], pa.list_(pa.int64())), *payload, *unit_columns(info, len(arr))]
    return pa.Table.from_arrays(columns, schema=opts.schema)


def _one_row(values: pa.Array) -> pa.Array:
    """A list array of one row holding all of ``values``."""
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values)


def read_files(files: list[SourceFile], opts: ReadOptions, sink: StatsSink, start: Cursor | None = None,
               skip_rows: int = 0, *, units: slice = slice(None)) -> Iterator[pa.Table]:
    """The body of one read task: stream its files and yield one block (of one row) per packing unit.

    A unit is ``opts.unit_size`` consecutive records of one file (or fewer, at the file's end or past
    ``MAX_UNIT_BYTES``; the stream's first unit stops at ``FIRST_UNIT_BYTES``, see :mod:`pipelines.stream.units`). Units are what packing works on and what resumption counts, so they depend
    only on the data and the config. ``start`` resumes the first file at a unit boundary; that unit's
    first ``skip_rows`` packed rows were already trained on and are dropped after packing.

    ``units`` picks which of the task's units it yields (``slice(0, 1)``: only the first, then stop;
    ``slice(1, None)``: all but the first). Units are cut the same whatever it picks, and a unit that is
    not yielded counts nothing (records, bad bytes), so two tasks that split a stream this way count
    each record once. See :meth:`ShardDatasource.get_read_tasks`.
    """
    assert units.step is None and (units.start or 0) >= 0 and (units.stop is None or units.stop >= 0), units
    counts = Counts()
    n_units = 0  # units cut so far (yielded or not)

    def emit(unit: _Unit, end_row: int, end_byte: int) -> Iterator[pa.Table]:
        nonlocal counts, n_units
        wanted = n_units >= (units.start or 0) and (units.stop is None or n_units < units.stop)
        n_units += 1
        if wanted:
            counts.add("records_read", len(unit.ids))
            yield _unit_table(unit, end_row, end_byte, opts)
        else:
            counts = Counts()  # counted since the last unit: this unit's, which the task yielding it counts

    def bad(where: str, msg: str) -> None:
        if opts.on_bad_record == "raise":
            raise BadRecordError(f"{where}: {msg} (set data.on_bad_record: skip to skip and count such records)")
        counts.add("skipped_bad_bytes", 1, f"{where}: {msg}")

    for k, file in enumerate(files):
        reader = reader_for(file, opts)
        cursor = start if (k == 0 and start is not None) else Cursor()
        fs = _fs(file, opts.storage)
        unit: _Unit | None = None
        pending_skip = skip_rows if (k == 0 and start is not None) else 0
        end_row, end_byte = cursor.row, cursor.byte
        for row, record, rec_start, rec_end in reader(fs, file, bad, cursor):
            if unit is None:
                first = row == 0 and file.source_index == opts.first_unit_source
                max_bytes = FIRST_UNIT_BYTES if first else MAX_UNIT_BYTES
                unit = _Unit(file, [], [], rec_start, skip=pending_skip)
                pending_skip = 0
            unit.ids.append(make_sample_id(file.source_index, row))
            unit.records.append(record)
            unit.nbytes += len(record) if isinstance(record, str) else record.nbytes
            end_row, end_byte = row + 1, rec_end
            if len(unit.ids) >= opts.unit_size or unit.nbytes >= max_bytes:
                yield from emit(unit, end_row, end_byte)
                unit = None
                if units.stop is not None and n_units >= units.stop:
                    break
        if unit is not None:
            yield from emit(unit, end_row, end_byte)
        if n_units >= (units.start or 0):  # else the counts so far are those of a unit not yet cut
            sink.send(counts)
            counts = Counts()
        if units.stop is not None and n_units >= units.stop:
            return


def read_all_records(table: SourceTable, opts: ReadOptions) -> Iterator[tuple[int, str]]:
    """Every ``(sample_id, record)`` of a table in file order, without Ray (tests and tools)."""
    for block in read_files(list(table.files), opts, StatsSink()):
        records = explode_units(block)
        yield from zip(records.column("sample_id").to_pylist(), records.column("record").to_pylist(), strict=True)

