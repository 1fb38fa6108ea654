"""MDS shard files: compression and hashes, as ``index.json`` names them.

Compression is ``<family>`` or ``<family>:<level>`` (``zstd``, ``zstd:7``, ``gz:9``, ``br``, ``bz2``,
``snappy``); a compressed shard is ``shard.NNNNN.mds.<family>`` and ``index.json`` lists both its
``raw_data`` and its ``zip_data`` (name, bytes, hashes). Hashes are hex digests of the file's bytes
as stored, under hashlib's names (``sha1``, ``md5``, ``sha256``, ...) and xxhash's (``xxh64``,
``xxh3_64``, ``xxh128``, ...). Both follow MosaicML Streaming's MDS format, so a set written by
either side reads on the other; the default levels are the same as its ``MDSWriter``'s.

The compressors are the maintained packages mosaic's writer uses (``zstd``, ``python-snappy``,
``brotli``) plus the standard library (``gzip``, ``bz2``), so compressed bytes are identical too
(except ``gz``, whose header stamps the time of writing).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True)
class _Family:
    levels: range | None  # None: no levels
    default: int | None
    compress: Callable[[bytes, int | None], bytes]
    decompress: Callable[[bytes], bytes]


def _zstd_compress(data: bytes, level: int | None) -> bytes:
    import zstd

    return zstd.compress(data, level)


def _zstd_decompress(data: bytes) -> bytes:
    import zstd

    return zstd.decompress(data)


def _snappy_compress(data: bytes, level: int | None) -> bytes:
    import snappy

    return snappy.compress(data)


def _snappy_decompress(data: bytes) -> bytes:
    import snappy

    return snappy.decompress(data)


def _br_compress(data: bytes, level: int | None) -> bytes:
    import brotli

    return brotli.compress(data, quality=level)


def _br_decompress(data: bytes) -> bytes:
    import brotli

    return brotli.decompress(data)


FAMILIES = {
    "br": _Family(range(0, 12), 11, _br_compress, _br_decompress),
    "bz2": _Family(range(1, 10), 9, lambda d, level: bz2.compress(d, level), bz2.decompress),
    "gz": _Family(range(0, 10), 9, lambda d, level: gzip.compress(d, level), gzip.decompress),
    "snappy": _Family(None, None, _snappy_compress, _snappy_decompress),
    "zstd": _Family(range(1, 23), 3, _zstd_compress, _zstd_decompress),
}


def _parse(algo: str) -> tuple[_Family, int | None]:
    """``"zstd:7"`` -> (zstd, 7); ValueError names what is wrong."""
    name, _, level_text = algo.partition(":")
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown compression {algo!r} (known: {', '.join(sorted(FAMILIES))}, each optionally :level)")
    if not level_text:
        return family, family.default
    if family.levels is None or not level_text.isdigit() or int(level_text) not in family.levels:
        allowed = "no levels" if family.levels is None else f"levels {family.levels.start}-{family.levels.stop - 1}"
        raise ValueError(f"compression {algo!r}: {name} takes {allowed}")
    return family, int(level_text)


def compression_problem(algo: object) -> str | None:
    """Why ``algo`` is not a compression this reader and writer know, or None."""
    if not isinstance(algo, str):
        return f"compression {algo!r} is not a string"
    try:
        _parse(algo)
    except ValueError as err:
        return str(err)
    return None


def extension(algo: str) -> str:
    """The file name extension of a compressed shard: ``"zstd:7"`` -> ``"zstd"``."""
    _parse(algo)
    return algo.partition(":")[0]


def compress(algo: str | None, data: bytes) -> bytes:
    if not algo:
        return data
    family, level = _parse(algo)
    return family.compress(data, level)


def decompress(algo: str | None, data: bytes) -> bytes:
    if not algo:
        return data
    family, _ = _parse(algo)
    return family.decompress(data)


def _hash_functions() -> dict[str, Callable[[bytes], object]]:
    funcs: dict[str, Callable[[bytes], object]] = {}
    for name in sorted(hashlib.algorithms_guaranteed):
        if not name.startswith("shake_"):  # variable-length digests, not usable as file hashes
            funcs[name] = getattr(hashlib, name)
    for name in sorted(xxhash.algorithms_available):
        funcs[name] = getattr(xxhash, name)
    return funcs


HASHES = _hash_functions()


def is_hash(algo: object) -> bool:
    return isinstance(algo, str) and algo in HASHES


def get_hash(algo: str, data: bytes) -> str:
    """The hex digest of ``data`` under ``algo``: ``get_hash("xxh64", b"")`` -> ``"ef46db3751d8e999"``."""
    if algo not in HASHES:
        raise ValueError(f"unknown hash {algo!r} (known: {', '.join(HASHES)})")
    return HASHES[algo](data).hexdigest()
