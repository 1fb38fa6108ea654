"""Reading MDS shards (``format: mds``): fetched whole, checked, decoded in memory, streamed as records.

A read task fetches each shard (retried, size- and hash-checked against ``index.json``), decompresses
and decodes it (:mod:`pipelines.mds.encodings`) and streams the samples on as JSON records; nothing touches
local disk. Sample ids are ``(shard's source index << 40) | sample index in the shard``, stable while
the index is unchanged. Column values become JSON: numpy arrays become lists, numpy scalars numbers,
``bytes`` UTF-8 text.

**Pre-tokenized shards** hold ``input_ids`` (optionally ``labels``), or llm-foundry's concat-tokens
``tokens`` column (``ndarray``, or legacy ``bytes`` of int64); their records skip formatting and
tokenization. When every file of a stream is one, :func:`read_mds_ids` yields the id arrays themselves
(:class:`pipelines.sources.records.TokenRecord`) for id-column blocks; otherwise :func:`read_mds` writes them
into the JSON record as base64 (see :class:`pipelines.tokenize.stage.Tokenizer`). A set written by ``ray_jobs/convert.py
--tokenize`` carries ``tokenized.json`` next to ``index.json``; :func:`check_tokenized_sources`
refuses it under a different tokenizer.
"""

from __future__ import annotations

import decimal
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from pipelines.config import ModelConfig
from pipelines.mds import encodings
from pipelines.mds.compression import decompress, get_hash, is_hash
from pipelines.mds.index import (
    HASH_PREFERENCE,
    TOKEN_COLUMNS,
    TOKENIZED_META,
    MDSError,
    read_tokenized_meta,
    shard_name,
)
from pipelines.sources.listing import SourceFile, SourceTable
from pipelines.sources.records import TokenRecord, as_token_ids, pack_array
from pipelines.storage import StorageOptions, with_retries
from pipelines.stream.units import Cursor
from pipelines.tokenize.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)


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
    label = f"MDS dataset {meta['root']}: shard {shard_name(shard)}"
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


class MemoryShard:
    """An MDS shard held in memory, decoded sample by sample.

    Layout (all integers little-endian uint32)::

        [n: samples][n + 1 offsets of the samples from the start of the file][JSON config][samples]
        sample = [size of each variable-size column][each column's encoded bytes, in column order]

    Fixed-size columns (``column_sizes``) carry no size. Example: columns ``text: str`` and ``n: int``,
    sample ``{"text": "hi", "n": 7}`` -> ``02000000 6869 0700000000000000``.
    """

    def __init__(self, raw: bytes, offsets: np.ndarray, names: list[str], encodings: list[str],
                 sizes: list[int | None]) -> None:
        self.raw, self.offsets = raw, offsets
        self.samples = len(offsets) - 1
        self.columns = list(zip(names, encodings, sizes, strict=True))

    @classmethod
    def from_bytes(cls, shard: dict[str, Any], raw: bytes, label: str) -> MemoryShard:
        """Check the shard header against the index and wrap ``raw``."""
        if len(raw) < 4:
            raise MDSError(f"{label}: shard too short ({len(raw)} bytes) to hold an MDS header")
        n = int(np.frombuffer(raw, np.uint32, count=1)[0])
        if n != shard["samples"] or len(raw) < 4 * (n + 2):
            raise MDSError(f"{label}: shard header says {n} samples, index.json says {shard['samples']}")
        offsets = np.frombuffer(raw, np.uint32, count=n + 1, offset=4).astype(np.int64)
        if offsets[-1] != len(raw) or (np.diff(offsets) < 0).any():
            raise MDSError(f"{label}: corrupt sample offsets (ends at {offsets[-1]}, shard has {len(raw)} bytes)")
        names, encs = shard["column_names"], shard["column_encodings"]
        sizes = shard.get("column_sizes") or [encodings.encoded_size(e) for e in encs]
        return cls(raw, offsets, names, encs, sizes)

    def get_item(self, idx: int, only: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Sample ``idx`` decoded, e.g. ``{"text": "...", "tokens": array([...])}``;
        with ``only``, just those columns (the others are skipped, not decoded)."""
        data = self.raw[self.offsets[idx] : self.offsets[idx + 1]]
        pos, sizes = 0, []
        for _, _, size in self.columns:
            if not size:
                size = int(np.frombuffer(data, np.uint32, count=1, offset=pos)[0])
                pos += 4
            sizes.append(size)
        sample = {}
        for (name, enc, _), size in zip(self.columns, sizes, strict=True):
            if pos + size > len(data):
                raise ValueError(f"column {name!r} runs past the end of the sample ({pos + size} > {len(data)} bytes)")
            if only is None or name in only:
                sample[name] = encodings.decode(enc, data[pos : pos + size])
            pos += size
        return sample

    def token_views(self) -> tuple[str, list[np.ndarray]] | None:
        """A shard of one token column (llm-foundry's concat-tokens ``tokens: ndarray:int32``, or ``input_ids``)
        as ``(column, one int array per sample)``, decoded together (:func:`encodings.int_array_views`); ``None``
        for any other shard, or one a sample of which is not of that form (:meth:`get_item` then names it)."""
        if len(self.columns) != 1 or self.columns[0][0] not in ("tokens", "input_ids") or not self.samples:
            return None
        name, enc, size = self.columns[0]
        starts, ends = self.offsets[:-1], self.offsets[1:]
        if not size:  # a variable-size column: its uint32 size first
            sizes = np.frombuffer(self.raw, np.uint8)[(starts[:, None] + np.arange(4)).ravel()].view("<u4")
            if (sizes != ends - starts - 4).any():
                return None
            starts = starts + 4
        views = encodings.int_array_views(enc, self.raw, starts, ends)
        return None if views is None else (name, views)


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


def open_shard(fs: pafs.FileSystem, file: SourceFile) -> tuple[MemoryShard, str]:
    """A shard source file fetched, checked and wrapped, and its label for messages."""
    meta = json.loads(file.meta)
    shard = meta["shard"]
    label = f"MDS dataset {meta['root']}: shard {shard_name(shard)}"
    return MemoryShard.from_bytes(shard, fetch_shard(fs, file), label), label


def read_mds(fs: pafs.FileSystem, file: SourceFile, bad: Callable[[str, str], None],
             cursor: Cursor | None = None) -> Iterator[tuple[int, str, int, int]]:
    """The reader for ``format: mds``: one shard (``file``) -> ``(row, JSON record, -1, -1)`` per sample.

    Resuming at ``cursor.row`` decodes from that sample on (the shard is fetched whole either way).
    """
    reader, label = open_shard(fs, file)
    for row in range(cursor.row if cursor else 0, reader.samples):
        try:
            rec = sample_to_record(reader.get_item(row))
            for col in TOKEN_COLUMNS:  # compact: base64 of the raw ids (pipelines.sources.records)
                if isinstance(rec.get(col), np.ndarray) and rec[col].dtype.kind in "iu" and rec[col].ndim == 1:
                    rec[col] = pack_array(rec[col])
            text = json.dumps(rec, ensure_ascii=False, default=_jsonable)
        except Exception as err:  # a value that does not decode, or one with no JSON form
            bad(f"{label} row {row}", f"cannot decode the sample: {err}")
            continue
        yield row, text, -1, -1


def read_mds_ids(fs: pafs.FileSystem, file: SourceFile, bad: Callable[[str, str], None],
                 cursor: Cursor | None = None) -> Iterator[tuple[int, TokenRecord, int, int]]:
    """The reader for id-column blocks (every file pre-tokenized): one shard -> ``(row, TokenRecord, -1, -1)``.

    Only the id columns are decoded (``input_ids`` or ``tokens``, and ``labels``); labels are the
    ids where the shard has none. A shard of one token column (llm-foundry's layout) is decoded in one pass
    (:meth:`MemoryShard.token_views`); any other, sample by sample. A sample whose ids are not a flat integer
    array is reported as undecodable, as :func:`read_mds` reports one it cannot decode.
    """
    reader, label = open_shard(fs, file)
    first = cursor.row if cursor else 0
    decoded = reader.token_views()
    if decoded is not None:  # one token column, every sample well formed: no per-sample parsing
        _, views = decoded
        for row in range(first, reader.samples):
            try:
                ids = as_token_ids(views[row], "input_ids")
            except ValueError as err:  # ids beyond int32
                bad(f"{label} row {row}", f"cannot decode the sample: {err}")
                continue
            yield row, TokenRecord(ids, ids), -1, -1
        return
    for row in range(first, reader.samples):
        try:
            rec = sample_to_record(reader.get_item(row, only=TOKEN_COLUMNS))
            ids = as_token_ids(rec["input_ids"], "input_ids")
            labels = as_token_ids(rec["labels"], "labels") if rec.get("labels") is not None else ids
        except Exception as err:  # a value that does not decode, or ids that are not ids
            bad(f"{label} row {row}", f"cannot decode the sample: {err}")
            continue
        yield row, TokenRecord(ids, labels), -1, -1


def _mds_roots(table: SourceTable) -> dict[str, tuple[int, list[str]]]:
    """MDS dataset URL -> (dataset index, column names of its first shard)."""
    roots: dict[str, tuple[int, list[str]]] = {}
    for f in table.files:
        if f.format == "mds" and f.meta:
            meta = json.loads(f.meta)
            roots.setdefault(meta["root"], (f.dataset_index, list(meta["shard"].get("column_names", []))))
    return roots


def check_tokenized_sources(model: ModelConfig, table: SourceTable) -> None:
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
                            url, TOKENIZED_META, model.tokenizer_path)
            continue
        mine = mine or tokenizer_fingerprint(model)
        theirs = made.get("tokenizer") or {}
        if theirs.get("sha256") != mine["sha256"]:
            raise MDSError(
                f"MDS dataset {url} was tokenized with tokenizer {theirs.get('name')!r} "
                f"(tokenizer.json sha256 {str(theirs.get('sha256'))[:12]}), but model.tokenizer is {mine['name']!r} "
                f"(sha256 {mine['sha256'][:12]}); re-run ray_jobs/convert.py --tokenize with this tokenizer, "
                "or set model.tokenizer to the one the set was made with"
            )
