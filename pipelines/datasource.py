"""A Ray Data ``Datasource`` over the resolved files: read tasks own whole files.

Each read task streams its files and yields small Arrow blocks of two columns::

    sample_id: int64    (source_index << 40) | row, see pipelines.sources
    record:    string   the record as a JSON object text, e.g. '{"instruction": "...", "output": "..."}'

Records stay JSON text until the tokenizer actors parse them, so a block's schema never depends on
the data (nested chat turns, optional fields) and parsing runs in the parallel actor pool. Read tasks
only decode bytes and split records; their closures hold file paths and options, nothing more.

Bad bytes are reported here (``data.on_bad_record``): non-UTF-8 lines, empty files, a JSON file
that is not an array. Bad JSON *content* is reported by the tokenizer actors, naming file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from pipelines.sources import SourceFile, SourceTable, make_sample_id
from pipelines.stats import Counts, StatsSink
from pipelines.storage import StorageOptions, filesystem_for

BLOCK_RECORDS = 1024
READ_CHUNK_BYTES = 8 << 20
SCHEMA = pa.schema([("sample_id", pa.int64()), ("record", pa.string())])


class BadRecordError(ValueError):
    """A record that cannot be used; the message names the file and line/row."""


@dataclass(frozen=True)
class ReadOptions:
    """What every read task needs besides its files. Cheap to serialize."""

    storage: StorageOptions
    on_bad_record: str  # raise | skip
    text_fields: tuple[str, ...]  # per dataset: the key plain-text lines are stored under
    eval_fraction: float = 0.0
    split: str = "train"


BadHandler = Callable[[str, str], None]  # (location, message)


def _fs(file: SourceFile, opts: StorageOptions) -> pafs.FileSystem:
    return filesystem_for(file.url, opts)[0]


def _iter_lines(fs: pafs.FileSystem, path: str) -> Iterator[bytes]:
    """Lines of a (possibly compressed: .gz, .zst, .bz2 by extension) file, streamed in chunks."""
    rest = b""
    with fs.open_input_stream(path) as stream:
        while chunk := stream.read(READ_CHUNK_BYTES):
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            yield from lines
    if rest:
        yield rest


def _decode(raw: bytes, where: str, bad: BadHandler) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad(where, f"not valid UTF-8 (byte {err.start}: {raw[err.start:err.start + 4]!r})")
        return None


def read_jsonl(fs: pafs.FileSystem, file: SourceFile, text_field: str, bad: BadHandler) -> Iterator[tuple[int, str]]:
    """JSON Lines: one record per line; blank lines keep their row number but hold no record."""
    any_line = False
    for row, raw in enumerate(_iter_lines(fs, file.path)):
        if not raw.strip():
            continue
        any_line = True
        text = _decode(raw, f"{file.url} line {row + 1}", bad)
        if text is not None:
            yield row, text
    if not any_line:
        bad(file.url, "empty file")


def read_text(fs: pafs.FileSystem, file: SourceFile, text_field: str, bad: BadHandler) -> Iterator[tuple[int, str]]:
    """Plain text: the whole file is one document (row 0), stored as ``{text_field: ...}``."""
    with fs.open_input_stream(file.path) as stream:
        raw = stream.read()
    if not raw.strip():
        bad(file.url, "empty file")
        return
    text = _decode(raw, f"{file.url}", bad)
    if text is not None:
        yield 0, json.dumps({text_field: text}, ensure_ascii=False)


def read_json_array(fs: pafs.FileSystem, file: SourceFile, text_field: str, bad: BadHandler) -> Iterator[tuple[int, str]]:
    """A JSON file: an array of records (the whole file is parsed: use JSONL for big data), or JSON Lines."""
    with fs.open_input_stream(file.path) as stream:
        raw = stream.read()
    head = raw.lstrip()[:1]
    if not head:
        bad(file.url, "empty file")
        return
    if head != b"[":  # JSON Lines saved as .json
        yield from read_jsonl(fs, file, text_field, bad)
        return
    text = _decode(raw, file.url, bad)
    if text is None:
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        bad(file.url, f"malformed JSON at line {err.lineno} column {err.colno}: {err.msg}")
        return
    for row, rec in enumerate(records):
        yield row, json.dumps(rec, ensure_ascii=False)


def read_parquet(fs: pafs.FileSystem, file: SourceFile, text_field: str, bad: BadHandler) -> Iterator[tuple[int, str]]:
    """Parquet: streamed by record batch; each row becomes a JSON record."""
    row = 0
    with fs.open_input_file(file.path) as f:
        pf = pq.ParquetFile(f)
        if pf.metadata.num_rows == 0:
            bad(file.url, "empty file")
        for batch in pf.iter_batches(batch_size=BLOCK_RECORDS):
            for rec in batch.to_pylist():
                yield row, json.dumps(rec, ensure_ascii=False, default=str)
                row += 1


READERS: dict[str, Callable[..., Iterator[tuple[int, str]]]] = {
    "jsonl": read_jsonl,
    "json": read_json_array,
    "parquet": read_parquet,
    "text": read_text,
}


def register_reader(fmt: str, reader: Callable[..., Iterator[tuple[int, str]]]) -> None:
    """Add a reader for a format (``mds`` registers itself from ``pipelines.mds``)."""
    READERS[fmt] = reader


def in_eval_split(sample_ids: np.ndarray, fraction: float) -> np.ndarray:
    """Deterministic held-out membership: splitmix64(sample_id) / 2**64 < fraction."""
    x = sample_ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def _block(ids: list[int], records: list[str], opts: ReadOptions) -> pa.Table:
    arr = np.asarray(ids, dtype=np.int64)
    if opts.eval_fraction > 0:
        keep = in_eval_split(arr, opts.eval_fraction)
        if opts.split != "eval":
            keep = ~keep
        idx = np.nonzero(keep)[0]
        arr, records = arr[idx], [records[i] for i in idx]
    return pa.Table.from_arrays([pa.array(arr, pa.int64()), pa.array(records, pa.string())], schema=SCHEMA)


def read_files(files: list[SourceFile], opts: ReadOptions, sink: StatsSink) -> Iterator[pa.Table]:
    """The body of one read task: stream its files, yield blocks of ``BLOCK_RECORDS`` records."""
    counts = Counts()

    def bad(where: str, msg: str) -> None:
        if opts.on_bad_record == "raise":
            raise BadRecordError(f"{where}: {msg} (set data.on_bad_record: skip to skip and count such records)")
        counts.add("skipped_bad_bytes", 1, f"{where}: {msg}")

    for file in files:
        reader = READERS.get(file.format)
        if reader is None:
            raise BadRecordError(f"{file.url}: no reader for format {file.format!r}")
        fs = _fs(file, opts.storage)
        ids: list[int] = []
        records: list[str] = []
        for row, record in reader(fs, file, opts.text_fields[file.dataset_index], bad):
            ids.append(make_sample_id(file.source_index, row))
            records.append(record)
            if len(ids) >= BLOCK_RECORDS:
                counts.add("records_read", len(ids))
                yield _block(ids, records, opts)
                ids, records = [], []
        if ids:
            counts.add("records_read", len(ids))
            yield _block(ids, records, opts)
        sink.send(counts)
        counts = Counts()


def group_files(files: list[SourceFile], parallelism: int) -> list[list[SourceFile]]:
    """Split files into at most ``parallelism`` contiguous groups of similar total size.

    Example: sizes [5, 1, 1, 1, 4] into 2 groups: a new group starts once the running total reaches
    half of 12, giving [[5, 1], [1, 1, 4]]. Order is kept, so read order follows file order.
    """
    n = max(1, min(parallelism, len(files)))
    total = sum(max(f.size, 1) for f in files)
    groups: list[list[SourceFile]] = [[]]
    acc = 0
    for f in files:
        if groups[-1] and acc >= total * len(groups) / n and len(groups) < n:
            groups.append([])
        groups[-1].append(f)
        acc += max(f.size, 1)
    return groups


class ShardDatasource(Datasource):
    """Ray Data source over a :class:`SourceTable`, reading files in a seeded order."""

    def __init__(self, table: SourceTable, order: list[int], opts: ReadOptions, sink: StatsSink) -> None:
        super().__init__()
        self._files = [table.files[i] for i in order]
        self._opts = opts
        self._sink = sink

    def get_name(self) -> str:
        return "ReadShards"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(f.size for f in self._files) or None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None) -> list[ReadTask]:
        tasks = []
        for group in group_files(self._files, max(parallelism, 1)):
            meta = BlockMetadata(
                num_rows=None,
                size_bytes=sum(f.size for f in group) or None,
                input_files=[f.url for f in group],
                exec_stats=None,
            )
            opts, sink = self._opts, self._sink

            def read_fn(group=group, opts=opts, sink=sink) -> Iterator[pa.Table]:
                return read_files(group, opts, sink)

            tasks.append(ReadTask(read_fn, meta, schema=SCHEMA, per_task_row_limit=per_task_row_limit))
        return tasks


def read_all_records(table: SourceTable, opts: ReadOptions) -> Iterator[tuple[int, str]]:
    """Every ``(sample_id, record)`` of a table in file order, without Ray (tests and tools)."""
    for block in read_files(list(table.files), opts, StatsSink(None)):
        yield from zip(block.column("sample_id").to_pylist(), block.column("record").to_pylist(), strict=True)

