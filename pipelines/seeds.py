"""Every seed the data path derives from ``data.shuffle_seed``, in one place.

The stream is a function of the data, the config and these seeds, so they must never collide by
accident (two files, epochs or passes getting the same order) and never change silently (a resumed
run must see the same order as the run it continues). Derivations:

* file read order of a stream epoch: :func:`file_order`;
* the stream epoch of a cycle pass of a mixed source: :func:`stream_epoch`;
* the row shuffle of one packing unit: :func:`unit_shuffle_seed`;
* the eval split membership of a sample (a hash of its id, no seed): :func:`splitmix64`.
"""

from __future__ import annotations

import random

import numpy as np

__all__ = ["PASS_STRIDE", "file_order", "splitmix64", "stream_epoch", "unit_shuffle_seed"]

PASS_STRIDE = 1000  # a cycle pass p of epoch e reads in the order of stream epoch e * 1000 + p


def stream_epoch(epoch: int, passes: int) -> int:
    """The key that seeds a source's file order and row shuffle for one pass of an epoch.

    Example: epoch 2, third pass (``passes=2``) -> 2002.
    """
    return epoch * PASS_STRIDE + passes


def file_order(n_files: int, seed: int, epoch: int = 0) -> list[int]:
    """Read order of the files in a stream epoch: a seeded permutation of ``range(n_files)``."""
    order = list(range(n_files))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


U64 = (1 << 64) - 1
UNIT_SHUFFLE_DOMAIN = 0x756E6974  # "unit": keeps these streams apart from any other use of the same numbers


def unit_shuffle_seed(seed: int, epoch: int, unit_id: int) -> np.random.SeedSequence:
    """The seed of one unit's row shuffle in a stream epoch: numpy's ``SeedSequence`` hash of the
    whole ``(domain, seed, epoch, unit id)`` tuple, every word kept in full.

    Nothing is folded or masked, so distinct tuples give distinct entropy and only a hash collision
    (2**-128) could give two units the same order. (Before, ids were masked to 48 bits, so file i and
    file i+256 shuffled alike, and ``seed + 1_000_003 * epoch`` aliased seeds with epochs.)
    """
    return np.random.SeedSequence([UNIT_SHUFFLE_DOMAIN, seed & U64, epoch & U64, unit_id & U64])


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each value (uint64 in, uint64 out): a fast, well-mixed 64-bit hash."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x
