"""Where a run writes: ``run.storage_path/run.name``, a local directory or an object-store URL.

One storage layer: the filesystems, endpoint handling (``storage.endpoint_url`` with its scheme),
retries and :func:`~pipelines.storage.is_remote` all come from :mod:`pipelines.storage`, the same
code that reads the data and writes the ledger. This module only names the run's places:

* :func:`run_dir` -- ``<storage root>/<run.name>``, the URL everything of a run lives under;
* :func:`ray_storage` -- what ``ray.train.RunConfig`` gets: ``(storage_path, storage_filesystem)``.
  With a filesystem, Ray Train wants a path *inside* it (``runs/r``), not a URL
  (``s3://runs/r``): pyarrow's S3 filesystem rejects URLs (``Expected an S3 object path of the form
  'bucket/key...'``);
* :class:`OutputDir` -- rank 0's other outputs (metrics.jsonl, TensorBoard events, the exported model,
  summary.json): written in place locally, or into a staging directory that :meth:`OutputDir.sync`
  copies up with ``pyarrow.fs.copy_files`` (the mechanism Ray Train uses for checkpoints).
"""

from __future__ import annotations

import os
import tempfile

import pyarrow.fs as pafs

from pipelines.config import Config
from pipelines.storage import StorageOptions, filesystem_for, is_remote, with_retries

__all__ = ["OutputDir", "is_remote", "ray_storage", "run_dir", "storage_filesystem", "storage_root"]


def storage_root(cfg: Config) -> str:
    """``run.storage_path`` as a URL, or an absolute local path (relative -> cwd)."""
    path = cfg.run.storage_path
    if is_remote(path):
        return path.rstrip("/")
    if path.startswith("file://"):
        path = path[len("file://"):]
    return os.path.abspath(os.path.expanduser(path))


def run_dir(cfg: Config) -> str:
    """``<storage root>/<run.name>``: Ray Train's experiment directory, shared by everything a run writes."""
    return f"{storage_root(cfg)}/{cfg.run.name}"


def storage_filesystem(cfg: Config) -> pafs.FileSystem | None:
    """The filesystem of a remote run directory (None for local runs)."""
    root = storage_root(cfg)
    return filesystem_for(root, StorageOptions.from_config(cfg.storage))[0] if is_remote(root) else None


def ray_storage(cfg: Config) -> tuple[str, pafs.FileSystem | None]:
    """``(storage_path, storage_filesystem)`` for ``ray.train.RunConfig``: a bare path with its filesystem.

    ``s3://runs/r`` with ``storage.endpoint_url`` -> ``("runs/r", S3FileSystem(endpoint))``;
    ``/abs/runs`` -> ``("/abs/runs", None)``.
    """
    root = storage_root(cfg)
    if not is_remote(root):
        return root, None
    fs, inner = filesystem_for(root, StorageOptions.from_config(cfg.storage))
    return inner.rstrip("/"), fs


class OutputDir:
    """A local directory to write into that ends up at ``target`` (a local path or a URL).

    ``local`` is ``target`` itself for local runs, a staging dir otherwise; :meth:`sync` uploads
    (with ``storage.retries``).
    """

    def __init__(self, target: str, storage: StorageOptions | None = None):
        self.target = target
        self.remote = is_remote(target)
        self.storage = storage or StorageOptions()
        self.local = tempfile.mkdtemp(prefix="pipelines-out-") if self.remote else target
        os.makedirs(self.local, exist_ok=True)

    def sync(self) -> None:
        """Copy the staging directory up (no-op for local targets)."""
        if not self.remote:
            return
        fs, dest = filesystem_for(self.target, self.storage)
        with_retries(lambda: pafs.copy_files(self.local, dest, destination_filesystem=fs),
                     f"uploading {self.target}", self.storage, self.target)
