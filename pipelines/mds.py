"""MosaicML MDS shards as a source and a sink of the pipeline, locally or on object storage.

An MDS dataset is a directory with ``index.json`` and shard files. The index lists every shard with
its columns, compression and hashes; a *nested* index (what ``merge_index`` and
:class:`MDSDatasink` write) names shards in sub-directories::

    s3://bucket/corpus/index.json       {"version": 2, "shards": [{"raw_data": {"basename":
                                          "part-00000/shard.00000.mds", ...}, "zip_data": {...
    s3://bucket/corpus/part-00000/shard.00000.mds.zstd

**Reading** (``format: mds``, or ``auto`` on a directory holding ``index.json``): resolution reads the
index and turns every shard into one :class:`~pipelines.sources.SourceFile` (its index entry rides
along in ``SourceFile.meta``), so read tasks own groups of whole shards and sample ids are
``(shard's source index << 40) | sample index in the shard``, stable while the index is unchanged.
A read task fetches each shard into memory (retried, size- and hash-checked), decompresses and
decodes it with mosaic's own code (``streaming.base.compression``, ``MDSReader.decode_sample``) and
streams the samples on as JSON records; nothing touches local disk. Column values become JSON:
numpy arrays become lists, numpy scalars numbers, ``bytes`` UTF-8 text.

**Pre-tokenized shards** hold ``input_ids`` (optionally ``labels``), or llm-foundry's
concat-tokens ``tokens`` column (``ndarray``, or legacy ``bytes`` of int64); their records skip
formatting and tokenization (see :class:`pipelines.tokenize.Tokenizer`). A set written by
``ray_jobs/convert.py --tokenize`` carries ``tokenized.json`` next to ``index.json``;
:func:`check_tokenized_sources` refuses it under a different tokenizer.

**Writing**: :class:`MDSDatasink` writes a Ray Dataset in parallel, one ``part-NNNNN/`` sub-directory
of shards per write task (mosaic's ``MDSWriter``), then one merged ``index.json``, which mosaic's
``StreamingDataset`` reads.
"""

from __future__ import annotations

import dataclasses
import decimal
import hashlib
import inspect
import json
import logging
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
from streaming.base.compression import decompress, is_compression
from streaming.base.format.mds.encodings import is_mds_encoding, is_mds_encoding_safe
from streaming.base.format.mds.reader import MDSReader
from streaming.base.format.mds.writer import MDSWriter
from streaming.base.hashing import get_hash, is_hash

from pipelines.config import Config, DatasetConfig, ModelConfig
from pipelines.datasource import BadHandler, Cursor, Record, register_reader
from pipelines.sources import SourceFile, SourceTable
from pipelines.storage import StorageError, StorageOptions, filesystem_for, is_remote, with_retries

INDEX = "index.json"
TOKENIZED_META = "tokenized.json"  # written by convert.py --tokenize, next to index.json
# When an index lists several hashes, the first of these present is verified (fast ones first).
HASH_PREFERENCE = ("xxh3_64", "xxh64", "xxh128", "xxh3_128", "xxh32", "md5", "sha1", "sha256", "sha512")
# Columns that hold token ids; a ``bytes`` value there is int64 ids (llm-foundry's legacy default).
TOKEN_COLUMNS = ("input_ids", "labels", "tokens")
_READER_ARGS = set(inspect.signature(MDSReader.__init__).parameters) - {"self", "dirname", "split"}

log = logging.getLogger(__name__)


class MDSError(ValueError):
    """An MDS dataset that cannot be used; the message names the dataset and the shard."""


# --------------------------------------------------------------------------- the index


def _read_small(fs: pafs.FileSystem, path: str, url: str, what: str, opts: StorageOptions) -> bytes | None:
    """A small file's bytes (index.json, tokenized.json), or None when it does not exist."""

    def get() -> bytes | None:
        try:
            with fs.open_input_stream(path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    return with_retries(get, what, opts, url)


def load_index(fs: pafs.FileSystem, root: str, url: str, label: str, opts: StorageOptions) -> dict[str, Any]:
    """Parse and check ``root/index.json``; every problem raises :class:`MDSError` naming ``label``."""
    raw = _read_small(fs, f"{root}/{INDEX}", f"{url}/{INDEX}", f"{label}: reading {INDEX}", opts)
    if raw is None:
        raise MDSError(f"{label}: no {INDEX} in {url} (not an MDS dataset directory; for format: mds the path "
                       f"must be the directory that holds {INDEX}; sub-directories written separately can be "
                       "joined with mosaic's streaming.base.util.merge_index)")
    try:
        index = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MDSError(f"{label}: {url}/{INDEX} is not valid JSON ({err})") from None
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise MDSError(f"{label}: {url}/{INDEX} is not an MDS index (expected an object with a 'shards' list)")
    if index.get("version") != 2:
        raise MDSError(f"{label}: {url}/{INDEX} has version {index.get('version')!r}; MDS index version 2 is supported")
    for k, shard in enumerate(index["shards"]):
        check_shard_entry(shard, f"{label}: {INDEX} shard {k}")
    return index


def _shard_name(shard: dict[str, Any]) -> str:
    info = shard.get("zip_data") or shard.get("raw_data") or {}
    return str(info.get("basename", "?"))


def check_shard_entry(shard: Any, label: str) -> None:
    """The checks mosaic's reader would fail on later, made up front with a clear message."""
    if not isinstance(shard, dict) or not isinstance(shard.get("raw_data"), dict):
        raise MDSError(f"{label}: not an MDS shard entry (no raw_data)")
    label = f"{label} ({_shard_name(shard)})"
    if shard.get("format") != "mds":
        raise MDSError(f"{label}: shard format {shard.get('format')!r} is not supported (only 'mds')")
    names, encodings = shard.get("column_names"), shard.get("column_encodings")
    if not isinstance(names, list) or not isinstance(encodings, list) or len(names) != len(encodings):
        raise MDSError(f"{label}: column_names and column_encodings are missing or differ in length")
    for name, enc in zip(names, encodings, strict=True):
        try:
            known = is_mds_encoding(enc)
        except (KeyError, ValueError, TypeError):
            known = False
        if not known:
            raise MDSError(f"{label}: column {name!r} has unknown MDS encoding {enc!r}")
        if not is_mds_encoding_safe(enc):
            raise MDSError(f"{label}: column {name!r} uses the unsafe encoding {enc!r} (pickle runs code on load); "
                           "re-write the dataset with a safe encoding")
    if shard.get("compression") and not is_compression(shard["compression"]):
        raise MDSError(f"{label}: unknown compression {shard['compression']!r}")
    if shard.get("compression") and not shard.get("zip_data"):
        raise MDSError(f"{label}: compression {shard['compression']!r} but no zip_data entry")
    if not isinstance(shard.get("samples"), int) or shard["samples"] < 0:
        raise MDSError(f"{label}: missing or bad sample count")


def expand_mds(fs: pafs.FileSystem, root: str, url: str, ds: DatasetConfig,
               opts: StorageOptions) -> list[tuple[str, str, str, int, str]]:
    """One ``(fs_path, url, "mds", size, meta)`` per shard of the MDS dataset at ``root``, in index order.

    ``meta`` is JSON: the shard's index entry, the dataset URL (for messages) and the storage
    options (for retries). Example: ``s3://b/c`` with two shards ->
    ``[("b/c/shard.00000.mds.zstd", "s3://b/c/shard.00000.mds.zstd", "mds", 1234, '{...}'), ...]``.
    """
    label = f"MDS dataset {url}"
    index = load_index(fs, root, url, label, opts)
    if not index["shards"]:
        raise MDSError(f"{label}: {INDEX} lists no shards")
    storage = dataclasses.asdict(opts)
    out = []
    for shard in index["shards"]:
        info = shard.get("zip_data") or shard["raw_data"]
        meta = json.dumps({"root": url, "shard": shard, "storage": storage}, sort_keys=True)
        out.append((f"{root}/{info['basename']}", f"{url}/{info['basename']}", "mds", int(info.get("bytes", 0)), meta))
    return out


# --------------------------------------------------------------------------- reading one shard


def _verify_hash(data: bytes, info: dict[str, Any], label: str) -> None:
    """Check one listed hash (the fastest known one) of the bytes as fetched."""
    hashes = info.get("hashes") or {}
    algo = next((a for a in HASH_PREFERENCE if a in hashes), None) or next((a for a in sorted(hashes) if is_hash(a)), None)
    if algo is None:
        return
    got = get_hash(algo, data)
    if got != hashes[algo]:
        raise MDSError(f"{label}: {algo} hash mismatch (index.json says {hashes[algo]}, the file hashes to {got}); "
                       "the shard is corrupt or was replaced")


def _fetch(fs: pafs.FileSystem, path: str, expected: int, label: str) -> bytes:
    """The whole file; a short read (connection cut) raises OSError so the caller retries."""
    try:
        f = fs.open_input_file(path)
    except FileNotFoundError:
        raise MDSError(f"{label}: listed in index.json but missing ({path})") from None
    with f:
        size = f.size()
        if expected and size != expected:
            raise MDSError(f"{label}: the file is {size} bytes but index.json says {expected} (truncated or overwritten)")
        data = f.read()
    if len(data) != size:
        raise OSError(f"short read: {len(data)} of {size} bytes (connection cut?)")
    return data


def fetch_shard(fs: pafs.FileSystem, file: SourceFile) -> bytes:
    """A shard's uncompressed bytes: fetched (with retries), hash-verified and decompressed in memory."""
    meta = json.loads(file.meta)
    shard, opts = meta["shard"], StorageOptions(**meta["storage"])
    label = f"MDS dataset {meta['root']}: shard {_shard_name(shard)}"
    zip_info, raw_info = shard.get("zip_data"), shard["raw_data"]
    info = zip_info or raw_info
    data = with_retries(lambda: _fetch(fs, file.path, int(info.get("bytes", 0)), label), f"{label}: fetching", opts, file.url)
    _verify_hash(data, info, label)
    if zip_info:
        try:
            data = decompress(shard["compression"], data)
        except Exception as err:  # zstd/gzip/... each raise their own error types
            raise MDSError(f"{label}: cannot decompress ({shard['compression']}): {err}") from None
    if len(data) != raw_info.get("bytes", len(data)):
        raise MDSError(f"{label}: decompressed to {len(data)} bytes but index.json says {raw_info['bytes']}")
    return data


class MemoryShard(MDSReader):
    """mosaic's ``MDSReader`` over a shard held in memory: ``get_sample_data`` slices the buffer
    (mosaic's reads the same offsets table from a local file); decoding is mosaic's own."""

    raw: bytes = b""
    offsets: np.ndarray

    @classmethod
    def from_bytes(cls, shard: dict[str, Any], raw: bytes, label: str) -> MemoryShard:
        """Check the shard header against the index and wrap ``raw`` (layout: n, n+1 offsets, config, samples)."""
        reader = cls.from_json("", None, {k: v for k, v in shard.items() if k in _READER_ARGS | {"version", "format"}})
        if len(raw) < 4:
            raise MDSError(f"{label}: shard too short ({len(raw)} bytes) to hold an MDS header")
        n = int(np.frombuffer(raw, np.uint32, count=1)[0])
        if n != shard["samples"] or len(raw) < 4 * (n + 2):
            raise MDSError(f"{label}: shard header says {n} samples, index.json says {shard['samples']}")
        offsets = np.frombuffer(raw, np.uint32, count=n + 1, offset=4).astype(np.int64)
        if offsets[-1] != len(raw) or (np.diff(offsets) < 0).any():
            raise MDSError(f"{label}: corrupt sample offsets (ends at {offsets[-1]}, shard has {len(raw)} bytes)")
        reader.raw, reader.offsets = raw, offsets
        return reader

    def get_sample_data(self, idx: int) -> bytes:
        return self.raw[self.offsets[idx] : self.offsets[idx + 1]]


def _token_array(value: Any, column: str) -> Any:
    """A token column as a numpy array; legacy ``bytes`` hold int64 ids (llm-foundry's default)."""
    if isinstance(value, bytes | bytearray):
        if len(value) % 8:
            raise ValueError(f"column {column!r}: {len(value)} bytes is not a whole number of int64 token ids")
        return np.frombuffer(value, np.int64)
    return value


def sample_to_record(sample: dict[str, Any]) -> dict[str, Any]:
    """Map a decoded MDS sample to the pipeline's record: llm-foundry's ``tokens`` becomes ``input_ids``.

    Example: ``{"tokens": array([464, 2068], dtype=int32)}`` -> ``{"input_ids": array([464, 2068])}``.
    """
    rec = dict(sample)
    if "input_ids" not in rec and "tokens" in rec:
        rec["input_ids"] = rec.pop("tokens")
    for col in TOKEN_COLUMNS:
        if col in rec:
            rec[col] = _token_array(rec[col], col)
    return rec


def _jsonable(obj: Any) -> Any:
    """``json.dumps`` default: numpy values, UTF-8 bytes and decimals; anything else is an error."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes | bytearray):
        try:
            return obj.decode("utf-8")
        except UnicodeDecodeError:
            raise TypeError(f"{len(obj)} bytes that are not UTF-8 text") from None
    if isinstance(obj, decimal.Decimal):
        return str(obj)
    raise TypeError(f"a {type(obj).__name__} value, which has no JSON form")


def read_mds(fs: pafs.FileSystem, file: SourceFile, text_field: str, bad: BadHandler,
             cursor: Cursor | None = None) -> Iterator[Record]:
    """The reader for ``format: mds``: one shard (``file``) -> ``(row, JSON record, -1, -1)`` per sample.

    Resuming at ``cursor.row`` decodes from that sample on (the shard is fetched whole either way).
    """
    meta = json.loads(file.meta)
    shard = meta["shard"]
    label = f"MDS dataset {meta['root']}: shard {_shard_name(shard)}"
    reader = MemoryShard.from_bytes(shard, fetch_shard(fs, file), label)
    for row in range(cursor.row if cursor else 0, shard["samples"]):
        try:
            rec = sample_to_record(reader.get_item(row))
            text = json.dumps(rec, ensure_ascii=False, default=_jsonable)
        except Exception as err:  # a value mosaic cannot decode, or one with no JSON form
            bad(f"{label} row {row}", f"cannot decode the sample: {err}")
            continue
        yield row, text, -1, -1


register_reader("mds", read_mds)


# --------------------------------------------------------------------------- tokenized sets


def tokenizer_sha256(hf: Any) -> str:
    """sha256 of the tokenizer's ``tokenizer.json`` as the tokenizers library writes it, with truncation
    and padding cleared (the pipeline never uses them), so equal tokenizers hash equal whatever the file's
    formatting: GPT-2's upstream file (truncation 50) and its cleaned copy give the same hash."""
    from tokenizers import Tokenizer as RustTokenizer

    backend = RustTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


def tokenizer_fingerprint(model: ModelConfig) -> dict[str, str]:
    """``{"name": <as configured>, "sha256": <tokenizer_sha256>}`` of the configured tokenizer."""
    from pipelines.tokenize import load_tokenizer

    return {"name": model.tokenizer_path, "sha256": tokenizer_sha256(load_tokenizer(model))}


def _mds_roots(table: SourceTable) -> dict[str, tuple[int, list[str]]]:
    """MDS dataset URL -> (dataset index, column names of its first shard)."""
    roots: dict[str, tuple[int, list[str]]] = {}
    for f in table.files:
        if f.format == "mds" and f.meta:
            meta = json.loads(f.meta)
            roots.setdefault(meta["root"], (f.dataset_index, list(meta["shard"].get("column_names", []))))
    return roots


def read_tokenized_meta(url: str, opts: StorageOptions) -> dict[str, Any] | None:
    """The ``tokenized.json`` of the MDS dataset at ``url``, or None if it has none."""
    fs, root = filesystem_for(url, opts)
    raw = _read_small(fs, f"{root}/{TOKENIZED_META}", f"{url}/{TOKENIZED_META}",
                      f"MDS dataset {url}: reading {TOKENIZED_META}", opts)
    return None if raw is None else json.loads(raw)


def check_tokenized_sources(cfg: Config, table: SourceTable) -> None:
    """Refuse a pre-tokenized MDS set made with another tokenizer than ``model.tokenizer``, naming both.

    Sets without ``tokenized.json`` (llm-foundry's) cannot be checked: a warning says so, and the
    tokenizer actors still reject ids outside the vocabulary.
    """
    mine: dict[str, str] | None = None
    for url, (_, columns) in _mds_roots(table).items():
        made = read_tokenized_meta(url, table.storage)
        if made is None:
            if set(columns) & set(TOKEN_COLUMNS):
                log.warning("MDS dataset %s holds token ids but no %s: cannot check it was tokenized with %r",
                            url, TOKENIZED_META, cfg.model.tokenizer_path)
            continue
        mine = mine or tokenizer_fingerprint(cfg.model)
        theirs = made.get("tokenizer") or {}
        if theirs.get("sha256") != mine["sha256"]:
            raise MDSError(
                f"MDS dataset {url} was tokenized with tokenizer {theirs.get('name')!r} "
                f"(tokenizer.json sha256 {str(theirs.get('sha256'))[:12]}), but model.tokenizer is {mine['name']!r} "
                f"(sha256 {mine['sha256'][:12]}); re-run ray_jobs/convert.py --tokenize with this tokenizer, "
                "or set model.tokenizer to the one the set was made with"
            )


# --------------------------------------------------------------------------- writing


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


class _PartWriter(MDSWriter):
    """``MDSWriter`` that hands every finished shard file to ``on_file`` (upload, then delete locally)."""

    def __init__(self, *, on_file: Callable[[str], None] | None, **kwargs: Any) -> None:
        self._on_file = on_file
        super().__init__(**kwargs)

    def flush_shard(self) -> None:
        super().flush_shard()
        if self._on_file is not None:
            info = self.shards[-1]
            self._on_file((info.get("zip_data") or info["raw_data"])["basename"])


class MDSDatasink(Datasink[dict]):
    """Write a Ray Dataset as MDS: ``ds.write_datasink(MDSDatasink("s3://b/out", columns))``.

    Each write task writes ``part-<task>/shard.NNNNN.mds[.zstd]`` with mosaic's ``MDSWriter`` (remote
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
        shards = []
        for r in returns:
            for shard in r["shards"]:
                shard = json.loads(json.dumps(shard))  # a deep copy
                for key in ("raw_data", "zip_data"):
                    if shard.get(key):
                        shard[key]["basename"] = f"{r['part']}/{shard[key]['basename']}"
                shards.append(shard)
        fs, root = filesystem_for(self.path, self.storage)
        for name, data in self.extra_files.items():
            _put(fs, f"{root}/{name}", data, f"{self.path}/{name}", self.storage)
        index = json.dumps({"version": 2, "shards": shards}, sort_keys=True).encode("utf-8")
        _put(fs, f"{root}/{INDEX}", index, f"{self.path}/{INDEX}", self.storage)
        self.written = {"rows": sum(r["rows"] for r in returns), "shards": len(shards), "parts": len(returns)}

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

        writer: _PartWriter | None = None
        rows = 0
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                if table.num_rows == 0:
                    continue
                if self.record_column:
                    samples = _record_rows(table, self.columns or {}, self.record_column, self.locate)
                    columns = self.columns or {}
                else:
                    columns = self.columns or {f.name: encoding_for(f.type) for f in table.schema}
                    samples = _arrow_rows(table, columns)
                if writer is None:
                    writer = _PartWriter(on_file=upload if remote else None, out=local, columns=columns,
                                         compression=self.compression, hashes=self.hashes,
                                         size_limit=self.size_limit, exist_ok=True, max_workers=1)
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


def _put(fs: pafs.FileSystem, path: str, data: bytes, url: str, opts: StorageOptions) -> None:
    """Write a whole file (retried); local parents are created."""
    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(os.path.dirname(path), recursive=True)

    def put() -> None:
        with fs.open_output_stream(path) as f:
            f.write(data)

    with_retries(put, f"writing {url}", opts, url)
