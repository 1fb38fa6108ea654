"""MDS column encodings: one column value <-> its bytes in a shard.

Each shard column has an encoding named in ``index.json`` (``column_encodings``). Fixed-size encodings
(``int``, the numpy scalars, ``ndarray`` with a static dtype and shape) take the same bytes in every
sample and are listed in ``column_sizes``; the others are stored with a uint32 size per sample (the
shard layout is :mod:`pipelines.mds.reader`'s). The byte layouts below are MosaicML Streaming's MDS
format, as its ``MDSWriter`` writes them (checked both ways by ``tests/test_mds_codec.py`` against
shards mosaic wrote and against mosaic's own reader):

======================  ==================================================================  =========
encoding                bytes                                                               decodes to
======================  ==================================================================  =========
``str``                 UTF-8                                                               ``str``
``bytes``               as given                                                            ``bytes``
``int``                 little-endian int64                                                 ``int``
``int8`` .. ``uint64``, one little-endian value of that numpy type                          numpy scalar
``float16`` .. ``64``
``str_int``,            the value's ``str()`` in UTF-8 (arbitrary precision)                ``int``, ``float``,
``str_float``,                                                                              ``Decimal``
``str_decimal``
``json``                ``json.dumps(value)`` in UTF-8                                      JSON value
``ndarray``             ``[dtype: 1][ndim << 2 | shape width: 1][shape][values]``           ``np.ndarray``
``ndarray:DT``          ``[ndim << 2 | shape width: 1][shape][values]`` (dtype fixed)
``ndarray:DT:D1,D2``    ``[values]`` (dtype and shape fixed)
======================  ==================================================================  =========

``ndarray`` headers: the dtype byte is one of :data:`ARRAY_DTYPES`' codes; the shape byte holds the
number of dimensions (up to 63) shifted left by two and, in its low two bits, the width of each
dimension (0: uint8, 1: uint16, 2: uint32, 3: uint64, the smallest that holds the largest dimension);
the shape follows as that many unsigned values. Example: ``np.array([[1, 2, 3]], np.int32)`` under
``ndarray`` is ``21 | 08 | 01 03 | 01 00 00 00 02 00 00 00 03 00 00 00`` (int32 = 33, two uint8 dims).

Not supported, each with a clear error: ``pkl`` (unpickling runs code) and the image encodings
(``pil``, ``jpeg``, ``png``, ``jpeg_array``, ``list[...]``), which a text pipeline has no use for.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import numpy as np

# ``ndarray`` value dtypes and their header codes (bit width, +1 signed, +2 float).
ARRAY_DTYPES = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "float16": 18, "uint32": 32, "int32": 33,
                "float32": 34, "uint64": 64, "int64": 65, "float64": 66}
_DTYPE_OF_CODE = {code: name for name, code in ARRAY_DTYPES.items()}
_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")  # index = the shape byte's low two bits
SCALARS = tuple(ARRAY_DTYPES)  # the numpy scalar encodings have the same names
UNSAFE = {"pkl": "pickle runs code when it is loaded"}
IMAGE = ("pil", "jpeg", "png", "jpeg_array", "jpegarray", "list[pil]", "list[jpeg]", "list[png]")
_PLAIN = ("str", "bytes", "int", "json", "str_int", "str_float", "str_decimal", *SCALARS)


def _array_args(encoding: str) -> tuple[str | None, tuple[int, ...] | None]:
    """``ndarray[:dtype[:d1,d2,...]]`` -> (dtype or None, shape or None); ValueError if malformed."""
    parts = encoding.split(":")
    if parts[0] != "ndarray" or len(parts) > 3:
        raise ValueError(f"unknown MDS encoding {encoding!r}")
    dtype = parts[1] if len(parts) > 1 and parts[1] else None
    if dtype is not None and dtype not in ARRAY_DTYPES:
        raise ValueError(f"MDS encoding {encoding!r}: dtype {dtype!r} is not one of {sorted(ARRAY_DTYPES)}")
    shape = None
    if len(parts) == 3:
        try:
            shape = tuple(int(d) for d in parts[2].split(","))
        except ValueError:
            raise ValueError(f"MDS encoding {encoding!r}: the shape must be comma-separated integers") from None
        if not shape or min(shape) <= 0:
            raise ValueError(f"MDS encoding {encoding!r}: every dimension must be positive")
    return dtype, shape


def encoding_problem(encoding: Any) -> str | None:
    """Why ``encoding`` cannot be read or written here, or None if it can.

    Examples: ``"ndarray:int32"`` -> None; ``"pkl"`` -> ``"uses the unsafe encoding 'pkl' ..."``.
    """
    if not isinstance(encoding, str):
        return f"has an encoding that is not a string ({encoding!r})"
    if encoding in _PLAIN:
        return None
    if encoding in UNSAFE:
        return (f"uses the unsafe encoding {encoding!r} ({UNSAFE[encoding]}); re-write the dataset with a safe "
                "encoding such as json")
    if encoding in IMAGE:
        return f"uses the image encoding {encoding!r}, which this text pipeline does not decode"
    try:
        _array_args(encoding)
    except ValueError as err:
        return f"has {err}" if "unknown" in str(err) else f"has a bad encoding: {err}"
    return None


def encoded_size(encoding: str) -> int | None:
    """Bytes every value of a fixed-size encoding takes (``column_sizes``), None for variable-size ones.

    Examples: ``int`` -> 8; ``float16`` -> 2; ``ndarray:int32:2,3`` -> 24; ``ndarray:int32`` -> None.
    """
    if encoding == "int":
        return 8
    if encoding in SCALARS:
        return np.dtype(encoding).itemsize
    if encoding.startswith("ndarray"):
        dtype, shape = _array_args(encoding)
        if dtype is not None and shape is not None:
            return int(np.prod(shape)) * np.dtype(dtype).itemsize
    return None


def _shape_width(shape: tuple[int, ...]) -> int:
    if not shape:
        raise ValueError("a 0-dimensional array cannot be stored as ndarray; use a scalar encoding")
    if min(shape) <= 0:
        raise ValueError(f"an array of shape {shape} is empty; ndarray stores arrays with at least one value")
    biggest = max(shape)
    return next(k for k, bits in enumerate((8, 16, 32, 64)) if biggest < (1 << bits))


def _encode_array(encoding: str, value: Any) -> bytes:
    dtype, shape = _array_args(encoding)
    arr = np.asarray(value)
    name = arr.dtype.name
    if name not in ARRAY_DTYPES:
        raise ValueError(f"arrays of dtype {name} cannot be stored (ndarray takes {sorted(ARRAY_DTYPES)})")
    if dtype is not None and name != dtype:
        raise ValueError(f"wrong dtype: {encoding!r} takes {dtype}, got {name}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"wrong shape: {encoding!r} takes {shape}, got {arr.shape}")
    head = b"" if dtype is not None else bytes([ARRAY_DTYPES[name]])
    if shape is None:
        width = _shape_width(arr.shape)
        if arr.ndim > 63:
            raise ValueError(f"an array with {arr.ndim} dimensions cannot be stored (at most 63)")
        head += bytes([arr.ndim << 2 | width]) + np.asarray(arr.shape, _SHAPE_DTYPES[width]).tobytes()
    return head + np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()


def _decode_array(encoding: str, data: bytes) -> np.ndarray:
    dtype, shape = _array_args(encoding)
    pos = 0
    if dtype is None:
        if not data or data[0] not in _DTYPE_OF_CODE:
            raise ValueError(f"ndarray header: unknown dtype code {data[0] if data else None}")
        dtype, pos = _DTYPE_OF_CODE[data[0]], 1
    if shape is None:
        if pos >= len(data):
            raise ValueError("ndarray header: no shape byte")
        ndim, width = data[pos] >> 2, data[pos] & 3
        shape_bytes = ndim * (1 << width)
        shape = tuple(int(d) for d in np.frombuffer(data, _SHAPE_DTYPES[width], count=ndim, offset=pos + 1))
        pos += 1 + shape_bytes
    itemsize = np.dtype(dtype).itemsize
    if len(data) - pos != int(np.prod(shape)) * itemsize:
        raise ValueError(f"ndarray of {dtype} {shape} needs {int(np.prod(shape)) * itemsize} bytes, "
                         f"the sample holds {len(data) - pos}")
    return np.frombuffer(data, np.dtype(dtype).newbyteorder("<"), offset=pos).astype(dtype, copy=False).reshape(shape)


def int_array_views(encoding: str, raw: bytes, starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray] | None:
    """The 1-D integer arrays of many samples of one ``ndarray:DT`` or ``ndarray:DT:N`` column, each the bytes
    ``raw[starts[i]:ends[i]]``, decoded together: their headers are read with a few numpy operations and each
    array is a view of ``raw``, where :func:`decode` parses every sample in Python. ``None`` when the encoding or
    any sample is not of that form (the caller then decodes sample by sample, which names what is wrong).

    Example: ``ndarray:int32`` samples ``04 | 02 | 01 00 00 00 02 00 00 00`` (one dimension of 2, uint8 shape)
    -> ``[array([1, 2], dtype=int32)]``.
    """
    try:
        dtype, shape = _array_args(encoding)
    except ValueError:
        return None
    if dtype is None or np.dtype(dtype).kind not in "iu" or (shape is not None and len(shape) != 1):
        return None
    itemsize = np.dtype(dtype).itemsize
    lengths = ends - starts
    if shape is not None:  # fixed shape: the sample is the values alone
        if (lengths != shape[0] * itemsize).any():
            return None
        values_at, counts = starts, lengths // itemsize
    else:  # [ndim << 2 | width][shape][values]
        if not len(starts) or (lengths < 2).any():
            return None
        data = np.frombuffer(raw, np.uint8)
        head = data[starts]
        width = (head & 3).astype(np.int64)
        if (head >> 2 != 1).any():  # one dimension, or the general path
            return None
        dims = np.zeros(len(starts), np.uint64)
        last = len(data) - 1
        for k in range(8):  # the dimension, little-endian in 1 << width bytes
            byte = data[np.minimum(starts + 1 + k, last)].astype(np.uint64)
            dims |= np.where(k < (1 << width), byte << np.uint64(8 * k), np.uint64(0))
        values_at = starts + 1 + (1 << width)
        counts = lengths - 1 - (1 << width)
        if (counts < 0).any() or (counts % itemsize).any() or (dims != counts // itemsize).any():
            return None
        counts = counts // itemsize
    little = np.dtype(dtype).newbyteorder("<")
    return [np.frombuffer(raw, little, count=n, offset=at).astype(dtype, copy=False)
            for at, n in zip(values_at.tolist(), counts.tolist(), strict=True)]


def encode(encoding: str, value: Any) -> bytes:
    """One value as its bytes under ``encoding``; ``bytes`` values are stored as they are, whatever the
    encoding (as ``MDSWriter`` does: pre-encoded data). ValueError says why a value does not fit."""
    if isinstance(value, bytes):
        return value
    if encoding == "str":
        if not isinstance(value, str):
            raise ValueError(f"'str' takes text, got {type(value).__name__}")
        return value.encode("utf-8")
    if encoding == "int":
        return np.int64(value).tobytes()
    if encoding in SCALARS:
        return np.array(value, dtype=encoding).astype(np.dtype(encoding).newbyteorder("<")).tobytes()
    if encoding == "json":
        if isinstance(value, np.ndarray):
            value = value.tolist()
        return json.dumps(value).encode("utf-8")
    if encoding in ("str_int", "str_float", "str_decimal"):
        want = {"str_int": int, "str_float": float, "str_decimal": Decimal}[encoding]
        if not isinstance(value, want):
            raise ValueError(f"{encoding!r} takes {want.__name__}, got {type(value).__name__}")
        return str(value).encode("utf-8")
    if encoding.startswith("ndarray"):
        return _encode_array(encoding, value)
    raise ValueError(f"column encoding {encoding!r}: {encoding_problem(encoding) or 'cannot be written'}")


def decode(encoding: str, data: bytes) -> Any:
    """The value that ``data`` holds under ``encoding`` (the inverse of :func:`encode`)."""
    if encoding == "str":
        return data.decode("utf-8")
    if encoding == "bytes":
        return bytes(data)
    if encoding == "int":
        if len(data) != 8:
            raise ValueError(f"'int' takes 8 bytes, the sample holds {len(data)}")
        return int(np.frombuffer(data, "<i8")[0])
    if encoding in SCALARS:
        dtype = np.dtype(encoding)
        if len(data) != dtype.itemsize:
            raise ValueError(f"{encoding!r} takes {dtype.itemsize} bytes, the sample holds {len(data)}")
        return np.frombuffer(data, dtype.newbyteorder("<"))[0].astype(dtype)
    if encoding == "json":
        return json.loads(data.decode("utf-8"))
    if encoding == "str_int":
        return int(data.decode("utf-8"))
    if encoding == "str_float":
        return float(data.decode("utf-8"))
    if encoding == "str_decimal":
        return Decimal(data.decode("utf-8"))
    if encoding.startswith("ndarray"):
        return _decode_array(encoding, data)
    raise ValueError(f"column encoding {encoding!r}: {encoding_problem(encoding) or 'cannot be read'}")
