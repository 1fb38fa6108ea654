"""Filesystems for local paths and object-store URLs, through pyarrow.

``filesystem_for("s3://bucket/prefix/", storage)`` returns ``(fs, "bucket/prefix/")``. The S3 endpoint
and region come from the config's ``storage:`` section or the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``); credentials only ever come from the
environment / AWS config files, so they never enter a config, a log line or an error message.

Retries come in two layers. The S3 client retries each request a few times
(``S3_CLIENT_ATTEMPTS``, pyarrow's ``AwsStandardS3RetryStrategy``: 503 SlowDown, 5xx, refused
connections). :func:`with_retries` wraps whole operations (list a dataset, fetch a shard) and retries
them ``storage.retries`` times with exponential backoff, which also covers what the client cannot
retry, such as a connection cut halfway through a response body. Errors that retrying cannot fix (no
such bucket, missing key, access denied) fail at once with a clear :class:`StorageError`::

    url = "s3://b/ds/shard.00000.mds"
    data = with_retries(lambda: fs.open_input_file(path).read(), f"reading {url}", opts, url)
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipelines.config import StorageConfig

REMOTE_SCHEMES = ("s3", "gs", "gcs")
S3_CLIENT_ATTEMPTS = 3  # per request, inside pyarrow; the outer layer is storage.retries
RETRY_BACKOFF_S = 0.5  # first outer-retry wait; doubles each retry ...
RETRY_BACKOFF_MAX_S = 8.0  # ... up to this
# Values of these variables are replaced by "***" in every message this module builds.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")

log = logging.getLogger(__name__)
T = TypeVar("T")


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


@functools.lru_cache(maxsize=8)
def _s3(opts: StorageOptions) -> pafs.S3FileSystem:
    """One client per process and options, so connections are reused from shard to shard."""
    kwargs: dict = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_CLIENT_ATTEMPTS)}
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


# --------------------------------------------------------------------------- errors and retries


class StorageError(OSError):
    """A storage operation that failed for good; the message names the URL and never a credential."""


def redact(text: str) -> str:
    """``text`` with credential values and ``user:password@`` parts of URLs replaced by ``***``.

    Example: with ``AWS_SECRET_ACCESS_KEY=abc123``, ``"sig abc123"`` -> ``"sig ***"``.
    """
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1***@", text)


def endpoint_name(opts: StorageOptions) -> str:
    """The endpoint for messages (no credentials): the override, or AWS's default for the region."""
    return redact(opts.endpoint_url) if opts.endpoint_url else f"the AWS S3 endpoint (region {opts.region or 'default'})"


# (marker in pyarrow's / the AWS SDK's message, kind). Kinds: no_bucket, denied, missing -> fail at
# once; transient -> retry. Anything unmatched is retried too (bounded), unless it is a FileNotFoundError.
_MARKERS = [
    ("NO_SUCH_BUCKET", "no_bucket"),
    ("NoSuchBucket", "no_bucket"),
    ("INVALID_ACCESS_KEY_ID", "denied"),
    ("SIGNATURE_DOES_NOT_MATCH", "denied"),
    ("ACCESS_DENIED", "denied"),
    ("AccessDenied", "denied"),
    ("InvalidAccessKeyId", "denied"),
    ("SignatureDoesNotMatch", "denied"),
    ("EXPIRED_TOKEN", "denied"),
    ("HTTP status 403", "denied"),
    ("NO_SUCH_KEY", "missing"),
    ("NoSuchKey", "missing"),
    ("HTTP status 404", "missing"),
]


def classify(err: BaseException) -> str:
    """``no_bucket`` | ``denied`` | ``missing`` (permanent) or ``transient`` (worth retrying)."""
    if isinstance(err, FileNotFoundError):
        return "missing"
    text = str(err)
    for marker, kind in _MARKERS:
        if marker in text:
            return kind
    return "transient"


def _short(err: BaseException) -> str:
    """The useful part of an SDK message: drops request ids, keeps operation and reason."""
    text = re.sub(r"\s*\(Request ID: [^)]*\)", "", str(err)).strip()
    return redact(text[:400])


def reason(err: BaseException, opts: StorageOptions, url: str = "") -> str:
    """Why a storage operation failed, in one credential-free phrase."""
    kind = classify(err)
    where = endpoint_name(opts)
    if kind == "no_bucket":
        bucket = urlparse(url).netloc if url else "?"
        return f"bucket {bucket!r} does not exist at {where}"
    if kind == "denied":
        return (f"access denied by {where}; check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                f"AWS_PROFILE or the instance role) and the bucket policy ({_short(err)})")
    if kind == "missing":
        return f"not found ({_short(err)})"
    if "NETWORK_CONNECTION" in str(err) or "curlCode: 7" in str(err):
        return f"could not connect to {where} ({_short(err)})"
    return _short(err)


def with_retries(fn: Callable[[], T], what: str, opts: StorageOptions, url: str,
                 retry_on: tuple[type[BaseException], ...] = (OSError,)) -> T:
    """``fn()`` on ``url``, retried ``opts.retries`` times with backoff on transient object-store errors.

    Permanent errors (see :func:`classify`) raise :class:`StorageError` at once, and so does any
    error on a local path (retrying a local disk does not help). After the last retry the message
    says how many were made, e.g.
    ``reading s3://b/x: failed after 5 retries: could not connect to http://127.0.0.1:9 (...)``.
    """
    limit = opts.retries if is_remote(url) else 0
    attempt = 0
    while True:
        try:
            return fn()
        except StorageError:
            raise
        except retry_on as err:
            kind = classify(err)
            if kind != "transient" or limit == 0:
                raise StorageError(redact(f"{what}: {reason(err, opts, url)}")) from None
            if attempt >= limit:
                raise StorageError(redact(f"{what}: failed after {limit} retries: {reason(err, opts, url)}")) from None
            wait = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2**attempt)
            attempt += 1
            log.warning("%s: transient error, retry %d/%d in %.1fs: %s", redact(what), attempt, limit, wait, _short(err))
            time.sleep(wait)
