"""Seeds derived in pipelines.seeds: deterministic, and distinct where the stream needs them distinct."""

from __future__ import annotations

import itertools

import numpy as np

from pipelines.seeds import file_order, stream_epoch, unit_shuffle_seed
from pipelines.sources.listing import make_sample_id
from pipelines.stream.packing import Rows, shuffle_rows


def _perm(seed: int, epoch: int, unit_id: int, n: int = 16) -> tuple[int, ...]:
    """The permutation shuffle_rows applies to ``n`` rows of one unit."""
    rows = Rows([np.array([i], np.int32) for i in range(n)], [np.zeros(1, np.int32)] * n,
                [np.zeros(1, np.int32)] * n, [np.array([i], np.int64) for i in range(n)])
    return tuple(int(r[0]) for r in shuffle_rows(rows, seed, epoch, unit_id).ids)


def test_unit_shuffle_differs_for_files_256_apart():
    """Issue 11: ids were masked to 48 bits, so file i and file i+256 shuffled their units alike."""
    for row in (0, 10000):
        assert _perm(42, 0, make_sample_id(0, row)) != _perm(42, 0, make_sample_id(256, row))
        assert _perm(42, 0, make_sample_id(3, row)) != _perm(42, 0, make_sample_id(3 + 512, row))


def test_unit_shuffle_keys_distinct_over_many_units():
    """No two of 2,400 (file, unit) pairs share a row permutation (16 rows: 16! orders, so any repeat is a bug)."""
    units = [make_sample_id(f, r) for f in range(0, 1200, 4) for r in (0, 1000, 5000, 20000, 10**6, 2**39, 17, 3)]
    perms = {_perm(7, 0, u) for u in units}
    assert len(perms) == len(units)


def test_unit_shuffle_seed_and_epoch_do_not_alias():
    """(seed, epoch) pairs map to different shuffles: seed s, epoch 1 is not seed s + stride, epoch 0."""
    u = make_sample_id(5, 0)
    for stride in (1, 1009, 1_000_003):
        assert _perm(0, 1, u) != _perm(stride, 0, u)
    assert _perm(-1, 0, u) != _perm(2**64 - 1, 1, u)
    assert unit_shuffle_seed(42, 3, u).entropy == unit_shuffle_seed(42, 3, u).entropy  # deterministic
    assert _perm(42, 3, u) == _perm(42, 3, u)


def test_file_order_is_a_seeded_permutation():
    orders = {tuple(file_order(12, 42, e)) for e in range(20)}
    assert len(orders) == 20 and all(sorted(o) == list(range(12)) for o in orders)
    assert file_order(12, 42, 3) == file_order(12, 42, 3)
    assert stream_epoch(2, 2) == 2002
    # each (epoch, pass) below the stride is its own stream epoch
    keys = [stream_epoch(e, p) for e, p in itertools.product(range(5), range(1000))]
    assert len(set(keys)) == len(keys)
