"""Writing a Ray Dataset as MosaicML MDS: :class:`MDSDatasink` (used by ``ray_jobs/convert.py``).

Each write task writes one ``part-NNNNN/`` sub-directory of shards (laid out as mosaic's ``MDSWriter`` does), then
``on_write_complete`` writes one merged ``index.json``, which mosaic's ``StreamingDataset`` reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
from ray.data.block import Block, BlockAccessor
from ray.data.datasource import Datasink
from ray.data.datasource.datasink import WriteResult

from pipelines.mds import encodings
from pipelines.mds.compression import compress, compression_problem, extension, get_hash, is_hash
from pipelines.mds.index import INDEX, MDSError
from pipelines.storage import StorageError, StorageOptions, filesystem_for, is_remote, with_retries
from pipelines.stream.units import explode_units


def encoding_for(typ: pa.DataType) -> str:
    """The MDS encoding for an Arrow column type.

    Examples: string -> ``str``; int64 -> ``int64``; list<int32> -> ``ndarray:int32``; struct -> ``json``.
    """
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "str"
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
        return "bytes"
    if pa.types.is_integer(typ) or pa.types.is_floating(typ):
        return str(typ.to_pandas_dtype().__name__)  # int8..uint64, float16..float64: the same names in MDS
    if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and (
        pa.types.is_integer(typ.value_type) or pa.types.is_floating(typ.value_type)
    ):
        return f"ndarray:{typ.value_type.to_pandas_dtype().__name__}"
    return "json"


def infer_columns(records: Iterable[dict[str, Any]]) -> dict[str, str]:
    """MDS encodings for JSON records: ``str``, ``int64``, ``float64`` where every sampled value fits,
    ``json`` otherwise (mixed types, lists, objects, nulls, or a key some records lack).

    Example: ``[{"a": "x", "n": 1}, {"a": "y", "n": 2.5, "m": [1]}]`` -> ``{"a": "str", "n": "float64", "m": "json"}``.
    """
    kinds: dict[str, set[str]] = {}
    seen: dict[str, int] = {}
    n = 0
    for rec in records:
        n += 1
        for key, value in rec.items():
            kinds.setdefault(key, set()).add("bool" if isinstance(value, bool) else type(value).__name__)
            seen[key] = seen.get(key, 0) + 1
    out = {}
    for key, ks in kinds.items():
        if seen[key] < n:
            out[key] = "json"  # absent from some records: only json can store the null
        elif ks == {"str"}:
            out[key] = "str"
        elif ks == {"int"}:
            out[key] = "int64"
        elif ks <= {"int", "float"}:
            out[key] = "float64"
        else:
            out[key] = "json"
    return out


def _coerce(value: Any, enc: str) -> Any:
    """A JSON value as what ``MDSWriter`` expects for ``enc``; ValueError says why it cannot be."""
    if enc == "json":
        return value
    if enc == "str":
        if isinstance(value, str):
            return value
    elif enc.startswith(("int", "uint")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif enc.startswith("float"):
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif enc.startswith("ndarray"):
        dtype = enc.split(":", 1)[1] if ":" in enc else None
        try:
            return np.asarray(value, dtype=dtype)
        except (TypeError, ValueError):
            pass
    else:
        raise ValueError(f"encoding {enc!r} cannot be written from JSON records")
    raise ValueError(f"a {type(value).__name__} value does not fit encoding {enc!r}")


def _arrow_rows(table: pa.Table, columns: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Rows of an Arrow block as ``MDSWriter`` samples (list columns as numpy arrays, no per-item copies)."""
    values: dict[str, list[Any]] = {}
    for name, enc in columns.items():
        if name not in table.column_names:
            raise MDSError(f"MDS datasink: column {name!r} is not in the data (has {table.column_names})")
        col = table.column(name).combine_chunks()
        if col.null_count and enc != "json":
            raise MDSError(f"MDS datasink: column {name!r} has null values, which MDS {enc!r} cannot store; "
                           f"write it as 'json'")
        if enc.startswith("ndarray"):
            offsets = col.offsets.to_numpy()
            flat = col.values.to_numpy(zero_copy_only=False)
            if ":" in enc:
                flat = flat.astype(enc.split(":", 1)[1], copy=False)
            values[name] = [flat[offsets[i] : offsets[i + 1]] for i in range(len(col))]
        else:
            values[name] = col.to_pylist()
    for i in range(table.num_rows):
        yield {name: v[i] for name, v in values.items()}


def _record_rows(table: pa.Table, columns: dict[str, str], record_column: str,
                 locate: Callable[[int], str] | None) -> Iterator[dict[str, Any]]:
    """Rows of a block of JSON records (``record_column``) as ``MDSWriter`` samples, checked per column."""
    ids = table.column("sample_id").to_pylist() if "sample_id" in table.column_names else [None] * table.num_rows
    for sid, text in zip(ids, table.column(record_column).to_pylist(), strict=True):
        where = locate(sid) if (locate and sid is not None) else f"record {sid}"
        rec = json.loads(text)
        extra = set(rec) - set(columns)
        if extra:
            raise MDSError(f"{where}: column(s) {sorted(extra)} not among the columns chosen from the first records "
                           f"({sorted(columns)}); pass them explicitly, e.g. --columns {sorted(extra)[0]}=json")
        sample = {}
        for name, enc in columns.items():
            value = rec.get(name)
            if value is None and enc != "json":
                raise MDSError(f"{where}: column {name!r} is missing or null, which MDS {enc!r} cannot store; "
                               f"write it as json (--columns {name}=json)")
            try:
                sample[name] = _coerce(value, enc)
            except ValueError as err:
                raise MDSError(f"{where}: column {name!r}: {err} (--columns {name}=json stores any JSON value)") from None
        yield sample


SIZE_UNITS = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}


def parse_size(value: int | str) -> int:
    """A shard size limit as mosaic accepts it: bytes, or text such as ``"64mb"`` (powers of 1024)."""
    if isinstance(value, int | float):
        return int(value)
    text = value.strip().lower()
    for suffix, scale in SIZE_UNITS.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text.rstrip("b"))


class ShardWriter:
    """Writes one directory of MDS shards exactly as mosaic's ``MDSWriter`` lays them out (file names,
    shard bytes, index entries; tests/test_mds_codec.py compares the bytes with shards mosaic wrote); each
    finished file is handed to ``on_file`` (upload, then delete locally). Used as mosaic's writer is::

        with ShardWriter(out="/data/mds", columns={"text": "str", "ids": "ndarray:int32"}, compression="zstd") as w:
            w.write({"text": "hello", "ids": np.array([15496], np.int32)})

    The defaults are ``MDSWriter``'s: no compression, no hashes, 64 MiB shards.

    Shard bytes: ``uint32 n``, ``n + 1`` uint32 offsets, the JSON config, then the samples; a sample
    is the uint32 sizes of its variable-size columns followed by each column's encoded bytes.
    """

    EXTRA_BYTES_PER_SAMPLE = 4  # its offset

    def __init__(self, *, out: str, columns: dict[str, str], compression: str | None = None,
                 hashes: Iterable[str] = (), size_limit: int | str | None = 1 << 26, on_file: Callable[[str], None] | None = None) -> None:
        for name, encoding in columns.items():
            problem = encodings.encoding_problem(encoding)
            if problem:
                raise MDSError(f"MDS datasink: column {name!r} {problem}")
        problem = compression and compression_problem(compression)
        if problem:
            raise MDSError(f"MDS datasink: {problem}")
        for algo in hashes:
            if not is_hash(algo):
                raise MDSError(f"MDS datasink: unknown hash {algo!r}")
        limit = parse_size(size_limit) if size_limit else None
        if limit is not None and not 0 < limit < 2**32:
            raise MDSError(f"MDS datasink: size_limit {limit} must be between 1 and 2**32 - 1 (uint32 offsets)")
        self.out, self.on_file = out, on_file
        self.names = sorted(columns)
        self.encodings = [columns[n] for n in self.names]
        self.sizes = [encodings.encoded_size(e) for e in self.encodings]
        self.compression, self.hashes, self.size_limit = compression or None, sorted(hashes), limit
        self.config = {"version": 2, "format": "mds", "compression": self.compression, "hashes": self.hashes,
                       "size_limit": limit, "column_names": self.names, "column_encodings": self.encodings,
                       "column_sizes": self.sizes}
        self.config_data = json.dumps(self.config, sort_keys=True).encode("utf-8")
        self.shards: list[dict[str, Any]] = []
        self._samples: list[bytes] = []
        self._size = 8 + len(self.config_data)
        os.makedirs(out, exist_ok=True)

    def encode_sample(self, sample: dict[str, Any]) -> bytes:
        head, body = [], []
        for name, encoding, size in zip(self.names, self.encodings, self.sizes, strict=True):
            datum = encodings.encode(encoding, sample[name])
            if size is None:
                head.append(len(datum))
            elif size != len(datum):
                raise MDSError(f"MDS datasink: column {name!r} encodes to {len(datum)} bytes, {encoding!r} takes {size}")
            body.append(datum)
        return np.array(head, np.uint32).tobytes() + b"".join(body)

    def write(self, sample: dict[str, Any]) -> None:
        data = self.encode_sample(sample)
        size = len(data) + self.EXTRA_BYTES_PER_SAMPLE
        if self.size_limit and self._samples and self.size_limit < self._size + size:
            self.flush_shard()
        self._samples.append(data)
        self._size += size

    def _file(self, data: bytes, basename: str) -> dict[str, Any]:
        hashes = {algo: get_hash(algo, data) for algo in self.hashes}
        return {"basename": basename, "bytes": len(data), "hashes": hashes}

    def flush_shard(self) -> None:
        n = len(self._samples)
        offsets = np.array([0, *map(len, self._samples)]).cumsum().astype(np.uint32)
        offsets += 4 + 4 * (n + 1) + len(self.config_data)
        raw = np.uint32(n).tobytes() + offsets.tobytes() + self.config_data + b"".join(self._samples)
        raw_name = f"shard.{len(self.shards):05}.mds"
        raw_info, zip_info, data, name = self._file(raw, raw_name), None, raw, raw_name
        if self.compression:
            name = f"{raw_name}.{extension(self.compression)}"
            data = compress(self.compression, raw)
            zip_info = self._file(data, name)
        with open(os.path.join(self.out, name), "wb") as f:
            f.write(data)
        self.shards.append({"samples": n, "raw_data": raw_info, "zip_data": zip_info, **self.config})
        self._samples, self._size = [], 8 + len(self.config_data)
        if self.on_file is not None:
            self.on_file(name)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.finish()

    def finish(self) -> None:
        """Flush the last shard and write this directory's ``index.json`` (as ``MDSWriter`` does)."""
        if self._samples:
            self.flush_shard()
        with open(os.path.join(self.out, INDEX), "w") as f:
            json.dump({"version": 2, "shards": self.shards}, f, sort_keys=True)


class MDSDatasink(Datasink[dict]):
    """Write a Ray Dataset as MDS: ``ds.write_datasink(MDSDatasink("s3://b/out", columns))``.

    Each write task writes ``part-<task>/shard.NNNNN.mds[.zstd]`` (remote
    destinations: through a local temporary directory holding one shard at a time, uploaded with
    pyarrow and the retries of :mod:`pipelines.storage`); ``on_write_complete`` writes ``extra_files``
    and then the merged ``index.json`` (last, so a dataset without it is visibly incomplete).

    ``columns`` maps column names to MDS encodings; None infers them from each block's Arrow schema
    (:func:`encoding_for`). With ``record_column`` the blocks hold JSON records (``record`` of the
    read stage) and ``columns`` must be given; ``locate(sample_id)`` names a record in errors.
    """

    def __init__(self, path: str, columns: dict[str, str] | None = None, *, compression: str | None = "zstd",
                 hashes: Iterable[str] = ("xxh64",), size_limit: int | str = 1 << 26,
                 storage: StorageOptions | None = None, overwrite: bool = False,
                 record_column: str | None = None, locate: Callable[[int], str] | None = None,
                 extra_files: dict[str, bytes] | None = None, min_rows_per_write: int | None = None) -> None:
        if record_column and not columns:
            raise ValueError("MDSDatasink: record_column needs explicit columns")
        self.path = path.rstrip("/")
        self.columns = dict(columns) if columns else None
        self.compression = compression or None
        self.hashes = sorted(set(hashes))
        self.size_limit = size_limit
        self.storage = storage or StorageOptions.from_config(None)
        self.overwrite = overwrite
        self.record_column, self.locate = record_column, locate
        self.extra_files = dict(extra_files or {})
        self._min_rows = min_rows_per_write
        self.written: dict[str, Any] = {}  # filled by on_write_complete: rows, shards, parts

    @property
    def min_rows_per_write(self) -> int | None:
        return self._min_rows

    def get_name(self) -> str:
        return "MDS"

    # -- driver side ------------------------------------------------------------------------
    def on_write_start(self, schema: pa.Schema | None = None) -> None:
        """Refuse to mix with an existing dataset (unless ``overwrite``); fail fast on a bad bucket or credentials."""
        fs, root = filesystem_for(self.path, self.storage)
        what = f"MDS output {self.path}"
        if is_remote(self.path):
            bucket = root.split("/", 1)[0]
            info = with_retries(lambda: fs.get_file_info(bucket), what, self.storage, self.path)
            if info.type == pafs.FileType.NotFound:
                raise StorageError(f"{what}: bucket {bucket!r} does not exist")
        existing = with_retries(lambda: fs.get_file_info(f"{root}/{INDEX}"), what, self.storage, self.path)
        if existing.type != pafs.FileType.NotFound and not self.overwrite:
            raise MDSError(f"{what} already holds an MDS dataset ({INDEX}); choose another path or overwrite")
        if self.overwrite:
            with_retries(lambda: fs.delete_dir_contents(root, missing_dir_ok=True), what, self.storage, self.path)

    def on_write_complete(self, write_result: WriteResult[dict]) -> None:
        returns = sorted((r for r in write_result.write_returns if r), key=lambda r: r["task"])
        index = nested_index([(r["part"], r["shards"]) for r in returns])
        fs, root = filesystem_for(self.path, self.storage)
        for name, data in self.extra_files.items():
            _put(fs, f"{root}/{name}", data, f"{self.path}/{name}", self.storage)
        _put(fs, f"{root}/{INDEX}", json.dumps(index, sort_keys=True).encode("utf-8"), f"{self.path}/{INDEX}",
             self.storage)
        self.written = {"rows": sum(r["rows"] for r in returns), "shards": len(index["shards"]), "parts": len(returns)}

    # -- one write task ---------------------------------------------------------------------
    def write(self, blocks: Iterable[Block], ctx: Any) -> dict:
        part = f"part-{ctx.task_idx:05d}"
        fs, root = filesystem_for(self.path, self.storage)
        remote = is_remote(self.path)
        local = tempfile.mkdtemp(prefix="mds-part-") if remote else os.path.join(root, part)
        if not remote and os.path.isdir(local):  # a retried task starts over
            shutil.rmtree(local)

        def upload(basename: str) -> None:
            src = os.path.join(local, basename)
            with open(src, "rb") as f:
                data = f.read()
            _put(fs, f"{root}/{part}/{basename}", data, f"{self.path}/{part}/{basename}", self.storage)
            os.remove(src)

        writer: ShardWriter | None = None
        rows = 0
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                if self.record_column:
                    table = explode_units(table)  # read blocks hold one row per unit
                if table.num_rows == 0:
                    continue
                if self.record_column:
                    samples = _record_rows(table, self.columns or {}, self.record_column, self.locate)
                    columns = self.columns or {}
                else:
                    columns = self.columns or {f.name: encoding_for(f.type) for f in table.schema}
                    samples = _arrow_rows(table, columns)
                if writer is None:
                    writer = ShardWriter(on_file=upload if remote else None, out=local, columns=columns,
                                         compression=self.compression, hashes=self.hashes,
                                         size_limit=self.size_limit)
                for sample in samples:
                    writer.write(sample)
                    rows += 1
            if writer is None:
                return {"task": ctx.task_idx, "part": part, "shards": [], "rows": 0}
            writer.finish()
            if remote:
                upload(INDEX)
            return {"task": ctx.task_idx, "part": part, "shards": writer.shards, "rows": rows}
        finally:
            if remote:
                shutil.rmtree(local, ignore_errors=True)


def nested_index(parts: Iterable[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """One index over sub-directories' shards, each basename prefixed with its directory (what mosaic's
    ``merge_index`` writes). Example: ``[("part-00000", [{"raw_data": {"basename": "shard.00000.mds"}, ...}])]``
    -> ``{"version": 2, "shards": [{"raw_data": {"basename": "part-00000/shard.00000.mds"}, ...}]}``."""
    shards = []
    for sub, entries in parts:
        for shard in entries:
            shard = json.loads(json.dumps(shard))  # a deep copy
            for key in ("raw_data", "zip_data"):
                if shard.get(key):
                    shard[key]["basename"] = f"{sub}/{shard[key]['basename']}"
            shards.append(shard)
    return {"version": 2, "shards": shards}


def _put(fs: pafs.FileSystem, path: str, data: bytes, url: str, opts: StorageOptions) -> None:
    """Write a whole file (retried); local parents are created."""
    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(os.path.dirname(path), recursive=True)

    def put() -> None:
        with fs.open_output_stream(path) as f:
            f.write(data)

    with_retries(put, f"writing {url}", opts, url)

