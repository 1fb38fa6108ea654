"""MDS sets for the tests: written and merged as mosaic's ``MDSWriter`` and ``merge_index`` do (the same
bytes and index, tests/test_mds_codec.py), and read back sample by sample with our reader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.fs as pafs

from pipelines.config import DatasetConfig
from pipelines.mds.reader import open_shard
from pipelines.mds.writer import ShardWriter, nested_index
from pipelines.sources.listing import SourceFile, resolve_dataset
from pipelines.storage import StorageOptions

FIXTURES = Path(__file__).parent / "fixtures" / "mds"
sys.path.insert(0, str(FIXTURES))  # samples.py: shared with the scripts that run in the mosaic venv

from samples import plain_sample  # noqa: E402

__all__ = ["FIXTURES", "merge_index", "mds_write", "plain_sample", "read_ours", "shard_files"]


def mds_write(out: Path, samples: list[dict], columns: dict[str, str], compression: str | None = None,
              hashes=("sha1", "xxh64"), size_limit: int | None = 1 << 15) -> Path:
    w = ShardWriter(out=str(out), columns=columns, compression=compression, hashes=list(hashes), size_limit=size_limit)
    for s in samples:
        w.write(s)
    w.finish()
    return out


def merge_index(root: Path) -> Path:
    """One ``index.json`` over the sub-directories of ``root``, as ``merge_index`` and our datasink write it."""
    subs = sorted(p.name for p in root.iterdir() if p.is_dir())
    parts = [(sub, json.loads((root / sub / "index.json").read_text())["shards"]) for sub in subs]
    (root / "index.json").write_text(json.dumps(nested_index(parts), sort_keys=True))
    return root


def shard_files(root: Path) -> list[SourceFile]:
    """The source files of the MDS set at ``root``, one per shard in index order (as a listing makes them)."""
    entries = resolve_dataset(DatasetConfig(path=str(root), format="mds"), "", StorageOptions())
    return [SourceFile(k, 0, path, url, fmt, size, meta) for k, (path, url, fmt, size, meta) in enumerate(entries)]


def read_ours(root: Path) -> list[dict]:
    """Every sample of the MDS set at ``root``, decoded by our reader, in index order."""
    out = []
    for file in shard_files(root):
        shard, _ = open_shard(pafs.LocalFileSystem(), file)
        out += [shard.get_item(i) for i in range(shard.samples)]
    return out
