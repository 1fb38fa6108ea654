"""Filesystems for local paths and object-store URLs, through pyarrow.

``filesystem_for("s3://bucket/prefix/", storage)`` returns ``(fs, "bucket/prefix/")``. The S3 endpoint
and region come from the config's ``storage:`` section or the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``); credentials only ever come from the
environment / AWS config files, so they never enter a config, a log line or an error message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipelines.config import StorageConfig

REMOTE_SCHEMES = ("s3", "gs", "gcs")


@dataclass(frozen=True)
class StorageOptions:
    """The non-secret parts of object-store access; small and picklable for read tasks."""

    endpoint_url: str | None = None
    region: str | None = None
    retries: int = 5

    @classmethod
    def from_config(cls, cfg: StorageConfig | None) -> StorageOptions:
        cfg = cfg or StorageConfig()
        endpoint = cfg.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = cfg.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        return cls(endpoint_url=endpoint, region=region, retries=cfg.retries)


def is_remote(path: str) -> bool:
    """True for ``s3://`` / ``gs://`` URLs."""
    return urlparse(path).scheme in REMOTE_SCHEMES


def _s3(opts: StorageOptions) -> pafs.S3FileSystem:
    kwargs: dict = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=max(1, opts.retries))}
    if opts.endpoint_url:
        parsed = urlparse(opts.endpoint_url)
        kwargs["endpoint_override"] = parsed.netloc or opts.endpoint_url
        kwargs["scheme"] = parsed.scheme or "https"
    if opts.region:
        kwargs["region"] = opts.region
    return pafs.S3FileSystem(**kwargs)


def filesystem_for(path: str, opts: StorageOptions | None = None) -> tuple[pafs.FileSystem, str]:
    """Return the pyarrow filesystem for ``path`` and the path inside it."""
    opts = opts or StorageOptions()
    parsed = urlparse(path)
    if parsed.scheme == "s3":
        return _s3(opts), parsed.netloc + parsed.path
    if parsed.scheme in ("gs", "gcs"):
        return pafs.GcsFileSystem(), parsed.netloc + parsed.path
    if parsed.scheme in ("", "file"):
        local = parsed.path if parsed.scheme == "file" else path
        return pafs.LocalFileSystem(), os.path.abspath(local)
    raise ValueError(f"unsupported URL scheme {parsed.scheme!r} in {path!r} (use a local path, s3:// or gs://)")


def to_url(path: str, like: str) -> str:
    """Re-attach the scheme of ``like`` to a filesystem-internal path (for messages and ids)."""
    scheme = urlparse(like).scheme
    return f"{scheme}://{path}" if scheme in REMOTE_SCHEMES else path
