"""Where a run writes: ``run.storage_path/run.name``, a local directory or an object-store URL.

Ray Train persists checkpoints there itself; this module covers the other outputs rank 0 writes
(metrics.jsonl, TensorBoard events, the exported model, summary.json). Local runs write in place;
for ``s3://``/``gs://`` the files are written to a local staging directory and copied up with
``pyarrow.fs.copy_files`` (the same mechanism Ray Train uses for checkpoints).
"""

from __future__ import annotations

import os
import tempfile

import pyarrow.fs as pafs

from pipelines.config import Config


def is_remote(path: str) -> bool:
    """``s3://bucket/x`` -> True; ``/abs/dir``, ``runs``, ``file:///x`` -> False."""
    return "://" in path and not path.startswith("file://")


def storage_root(cfg: Config) -> str:
    """``run.storage_path`` as Ray Train wants it: a URL, or an absolute local path (relative -> cwd)."""
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
    """An S3 filesystem honouring ``storage.endpoint_url``/``region`` (None: let Ray/pyarrow infer it)."""
    if not cfg.run.storage_path.startswith("s3://") or not (cfg.storage.endpoint_url or cfg.storage.region):
        return None
    kwargs = {}
    if cfg.storage.endpoint_url:
        kwargs["endpoint_override"] = cfg.storage.endpoint_url
    if cfg.storage.region:
        kwargs["region"] = cfg.storage.region
    return pafs.S3FileSystem(**kwargs)


class OutputDir:
    """A local directory to write into that ends up at ``target`` (a local path or a URL).

    ``local`` is ``target`` itself for local runs, a staging dir otherwise; :meth:`sync` uploads.
    """

    def __init__(self, target: str, filesystem: pafs.FileSystem | None = None):
        self.target = target
        self.remote = is_remote(target)
        self.filesystem = filesystem
        self.local = tempfile.mkdtemp(prefix="pipelines-out-") if self.remote else target
        os.makedirs(self.local, exist_ok=True)

    def sync(self) -> None:
        """Copy the staging directory up (no-op for local targets)."""
        if not self.remote:
            return
        if self.filesystem is not None:
            dest = self.target.split("://", 1)[1]
            pafs.copy_files(self.local, dest, destination_filesystem=self.filesystem)
        else:
            pafs.copy_files(self.local, self.target)
