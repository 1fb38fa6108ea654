"""Sources: resolve each dataset's path to files, and give every record a stable id.

A dataset ``path`` may be a file, a directory (all data files below it), a glob (``data/*.jsonl``)
or an ``s3://`` / ``gs://`` URL of any of those. Resolution lists metadata only; nothing is read.

Sample ids are stable from run to run::

    sample_id = (source_index << 40) | row

``source_index`` numbers the resolved files of all datasets in config order (sorted within a
dataset) and ``row`` is the 0-based record index inside the file. An MDS dataset directory resolves
to its shards, in index.json order, so there ``row`` is the sample's index inside its shard. With files
``[a.jsonl, b.jsonl]``, row 7 of ``b.jsonl`` has id ``(1 << 40) | 7 = 1099511627783``.
:func:`locate_sample` maps an id back to ``(path, row)``.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import pyarrow.fs as pafs

from pipelines.config import Config, DatasetConfig
from pipelines.storage import StorageOptions, filesystem_for, is_remote, to_url, with_retries

ROW_BITS = 40
ROW_MASK = (1 << ROW_BITS) - 1
MAX_SOURCES = 1 << (63 - ROW_BITS)

EXTENSION_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
}
GLOB_CHARS = set("*?[")


class SourceError(ValueError):
    """A dataset path that cannot be used (missing, empty glob, unknown format)."""


@dataclass(frozen=True)
class SourceFile:
    """One resolved input file (or MDS directory) with its place in the sample-id space."""

    source_index: int
    dataset_index: int
    path: str  # path inside the filesystem (no scheme)
    url: str  # what the user sees: with scheme for object stores
    format: str  # jsonl | json | parquet | text | mds
    size: int
    meta: str = ""  # format-specific JSON: for mds, the shard's index.json entry (see pipelines.mds.index)


def make_sample_id(source_index: int, row: int) -> int:
    """Encode ``(source_index, row)``; see the module docstring."""
    assert 0 <= source_index < MAX_SOURCES and 0 <= row <= ROW_MASK
    return (source_index << ROW_BITS) | row


def split_sample_id(sample_id: int) -> tuple[int, int]:
    """Decode a sample id into ``(source_index, row)``."""
    return int(sample_id) >> ROW_BITS, int(sample_id) & ROW_MASK


def _glob_root(path: str) -> str:
    """The longest leading directory of a glob that holds no glob characters."""
    while any(c in path for c in GLOB_CHARS):
        path = os.path.dirname(path)
    return path


def _local_base(path: str, base_dir: str) -> str:
    """Relative local paths: against the config file's folder first, then the cwd."""
    if is_remote(path) or os.path.isabs(path) or path.startswith("file://"):
        return path
    for root in (base_dir, os.getcwd()):
        candidate = os.path.join(root, path)
        if os.path.exists(_glob_root(candidate)):
            return candidate
    return os.path.join(base_dir, path)


def _detect_format(url: str, declared: str) -> str | None:
    if declared != "auto":
        return declared
    ext = os.path.splitext(url.rstrip("/"))[1].lower()
    return EXTENSION_FORMATS.get(ext)


def _list_dir(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return [i for i in infos if i.type == pafs.FileType.File]


def _expand(fs: pafs.FileSystem, path: str, ds: DatasetConfig) -> list[pafs.FileInfo]:
    """Expand one dataset path into file infos (a directory holding index.json is one MDS source)."""
    if any(c in path for c in GLOB_CHARS):
        root = _glob_root(path)
        root_info = fs.get_file_info(root)
        if root_info.type != pafs.FileType.Directory:
            raise SourceError(f"dataset path {ds.path!r}: directory {root!r} of the glob does not exist")
        return [i for i in _list_dir(fs, root) if fnmatch.fnmatch(i.path, path)]
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        bucket = path.split("/", 1)[0]
        if not isinstance(fs, pafs.LocalFileSystem) and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise SourceError(f"dataset path {ds.path!r}: bucket {bucket!r} does not exist")
        raise SourceError(f"dataset path {ds.path!r} does not exist (looked for {path!r})")
    if info.type == pafs.FileType.File:
        if ds.format == "mds" and os.path.basename(path) == "index.json":  # path: .../index.json
            return [pafs.FileInfo(os.path.dirname(path), type=pafs.FileType.Directory)]
        return [info]
    index = fs.get_file_info(path.rstrip("/") + "/index.json")
    if ds.format == "mds" or (ds.format == "auto" and index.type == pafs.FileType.File):
        return [pafs.FileInfo(path.rstrip("/"), type=pafs.FileType.Directory)]
    return [i for i in _list_dir(fs, path) if _detect_format(i.path, ds.format) or ds.format != "auto"]


def resolve_dataset(ds: DatasetConfig, base_dir: str, opts: StorageOptions) -> list[tuple[str, str, str, int, str]]:
    """Files of one dataset as ``(fs_path, url, format, size, meta)``, sorted by path.

    An MDS directory becomes one entry per shard, in index.json order (see :func:`pipelines.mds.index.expand_mds`).
    """
    raw = ds.path
    if raw.startswith("demo://"):
        from pipelines.demo import resolve_demo_path  # the project's own demo data, made on first use

        raw = resolve_demo_path(raw)
    location = _local_base(raw, base_dir)
    fs, inner = filesystem_for(location, opts)
    infos = sorted(with_retries(lambda: _expand(fs, inner, ds), f"dataset path {ds.path!r}", opts, location),
                   key=lambda i: i.path)
    if not infos:
        raise SourceError(f"dataset path {ds.path!r} matched no data files")
    out = []
    for info in infos:
        if info.type == pafs.FileType.Directory:
            from pipelines.mds.index import expand_mds  # MDS: index.json lists the shards

            out.extend(expand_mds(fs, info.path, to_url(info.path, location), ds, opts))
            continue
        fmt = _detect_format(info.path, ds.format)
        if fmt is None:
            raise SourceError(
                f"dataset path {ds.path!r}: cannot tell the format of {info.path!r} from its extension; "
                "set format: jsonl | json | parquet | text | mds"
            )
        out.append((info.path, to_url(info.path, location), fmt, int(info.size or 0), ""))
    return out


@dataclass(frozen=True)
class SourceTable:
    """All resolved files of a split, in sample-id order. Small: paths and sizes only."""

    files: tuple[SourceFile, ...]
    datasets: tuple[DatasetConfig, ...]
    storage: StorageOptions

    def locate(self, sample_id: int) -> tuple[str, int]:
        """``sample_id`` -> ``(url, row)`` of the record it came from."""
        source, row = split_sample_id(sample_id)
        if source >= len(self.files):
            raise KeyError(f"sample id {sample_id} names source {source}, but there are {len(self.files)} files")
        return self.files[source].url, row

    def where(self, sample_id: int) -> str:
        """A human-readable location, ``path line N`` (1-based, as editors count)."""
        url, row = self.locate(sample_id)
        fmt = self.files[split_sample_id(sample_id)[0]].format
        return f"{url} line {row + 1}" if fmt in ("jsonl", "text") else f"{url} row {row}"


def datasets_for_split(cfg: Config, split: str) -> list[DatasetConfig]:
    """The dataset entries a split reads (``eval`` with ``eval_fraction`` reads the training sources)."""
    if split == "train":
        return list(cfg.data.datasets)
    if split == "eval":
        if cfg.data.eval_datasets:
            return list(cfg.data.eval_datasets)
        if cfg.data.eval_fraction > 0:
            return list(cfg.data.datasets)
        raise SourceError("split='eval' needs data.eval_datasets or data.eval_fraction")
    raise SourceError(f"unknown split {split!r} (use 'train' or 'eval')")


def resolve_sources(cfg: Config, split: str = "train") -> SourceTable:
    """List every file of a split (metadata only) and number them for sample ids."""
    opts = StorageOptions.from_config(cfg.storage)
    datasets = datasets_for_split(cfg, split)
    files: list[SourceFile] = []
    for d_idx, ds in enumerate(datasets):
        for path, url, fmt, size, meta in resolve_dataset(ds, cfg.base_dir, opts):
            files.append(SourceFile(len(files), d_idx, path, url, fmt, size, meta))
    if len(files) >= MAX_SOURCES:
        raise SourceError(f"{len(files)} files is more than the {MAX_SOURCES} a sample id can address")
    return SourceTable(tuple(files), tuple(datasets), opts)


def locate_sample(cfg: Config, sample_id: int, split: str = "train") -> tuple[str, int]:
    """Map a ``sample_id`` from a packed row back to its source ``(file, row)``."""
    return resolve_sources(cfg, split).locate(sample_id)
