"""MosaicML MDS datasets: the index (``index.json``), checked up front, and one source file per shard.

An MDS dataset is a directory with ``index.json`` and shard files. The index lists every shard with
its columns, compression and hashes; a *nested* index (what ``merge_index`` and
:class:`pipelines.mds.writer.MDSDatasink` write) names shards in sub-directories::

    s3://bucket/corpus/index.json       {"version": 2, "shards": [{"raw_data": {"basename":
                                          "part-00000/shard.00000.mds", ...}, "zip_data": {...
    s3://bucket/corpus/part-00000/shard.00000.mds.zstd

Resolution (``format: mds``, or ``auto`` on a directory holding ``index.json``) reads the index and
turns every shard into one source file (:func:`expand_mds`); reading them is :mod:`pipelines.mds.reader`,
writing :mod:`pipelines.mds.writer`; the encodings, compressions and hashes are :mod:`pipelines.mds.encodings`'s
and :mod:`pipelines.mds.compression`'s.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pyarrow.fs as pafs

from pipelines.config import DatasetConfig
from pipelines.mds import encodings
from pipelines.mds.compression import compression_problem
from pipelines.storage import StorageOptions, filesystem_for, with_retries

INDEX = "index.json"
TOKENIZED_META = "tokenized.json"  # written by convert.py --tokenize, next to index.json
# When an index lists several hashes, the first of these present is verified (fast ones first).
HASH_PREFERENCE = ("xxh3_64", "xxh64", "xxh128", "xxh3_128", "xxh32", "md5", "sha1", "sha256", "sha512")
# Columns that hold token ids; a ``bytes`` value there is int64 ids (llm-foundry's legacy default).
TOKEN_COLUMNS = ("input_ids", "labels", "tokens")
# A shard with one of these is pre-tokenized: its records skip formatting and tokenizing
# (``tokens`` is llm-foundry's concat-tokens column, read as ``input_ids``).
ID_COLUMNS = ("input_ids", "tokens")


def shard_holds_token_ids(meta: str) -> bool:
    """Whether a shard source file's ``meta`` (its index.json entry, see :func:`expand_mds`) lists an id column."""
    columns = json.loads(meta)["shard"].get("column_names") or []
    return any(c in columns for c in ID_COLUMNS)


def shard_raw_bytes(meta: str) -> int:
    """A shard's size uncompressed (its index entry's ``raw_data`` bytes), from a source file's ``meta``.

    Proportional to the tokens of an id-column shard, where the file's own size is that of its zstd data.
    """
    return int(json.loads(meta)["shard"]["raw_data"].get("bytes", 0))


class MDSError(ValueError):
    """An MDS dataset that cannot be used; the message names the dataset and the shard."""



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


def shard_name(shard: dict[str, Any]) -> str:
    info = shard.get("zip_data") or shard.get("raw_data") or {}
    return str(info.get("basename", "?"))


def check_shard_entry(shard: Any, label: str) -> None:
    """The checks a shard's reader would fail on later, made up front with a clear message."""
    if not isinstance(shard, dict) or not isinstance(shard.get("raw_data"), dict):
        raise MDSError(f"{label}: not an MDS shard entry (no raw_data)")
    label = f"{label} ({shard_name(shard)})"
    if shard.get("format") != "mds":
        raise MDSError(f"{label}: shard format {shard.get('format')!r} is not supported (only 'mds')")
    names, column_encodings = shard.get("column_names"), shard.get("column_encodings")
    if not isinstance(names, list) or not isinstance(column_encodings, list) or len(names) != len(column_encodings):
        raise MDSError(f"{label}: column_names and column_encodings are missing or differ in length")
    for name, enc in zip(names, column_encodings, strict=True):
        problem = encodings.encoding_problem(enc)
        if problem:
            raise MDSError(f"{label}: column {name!r} {problem}")
    problem = shard.get("compression") and compression_problem(shard["compression"])
    if problem:
        raise MDSError(f"{label}: {problem}")
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


def read_tokenized_meta(url: str, opts: StorageOptions) -> dict[str, Any] | None:
    """The ``tokenized.json`` of the MDS dataset at ``url``, or None if it has none."""
    fs, root = filesystem_for(url, opts)
    raw = _read_small(fs, f"{root}/{TOKENIZED_META}", f"{url}/{TOKENIZED_META}",
                      f"MDS dataset {url}: reading {TOKENIZED_META}", opts)
    return None if raw is None else json.loads(raw)
