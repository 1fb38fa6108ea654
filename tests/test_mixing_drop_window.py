"""Token-weighted mixing under the default ``mix_exhausted: drop``: the 2% window claim, before and after
a source runs out (without Ray; the fake row streams of test_mixing_resume_units.py)."""

from __future__ import annotations

import numpy as np
from test_mixing_resume_units import _run, _window_shares, fake_source, opener_for

from pipelines.config import DataConfig
from pipelines.stream.mixing import Mixer, fresh_states


def test_default_policy_is_drop():
    assert DataConfig.model_fields["mix_exhausted"].default == "drop"


def test_drop_token_shares_hold_in_every_window_before_and_after_a_source_runs_out():
    rng = np.random.default_rng(1)
    # Source 2 holds ~7% of the tokens but has weight 0.2: it runs out about a third of the way in.
    sizes, ranges, weights = [12000, 4000, 2500], [(50, 400), (200, 2000), (10, 100)], [0.5, 0.3, 0.2]
    sources = [fake_source(i, rng.integers(lo, hi, size=n).tolist())
               for i, (n, (lo, hi)) in enumerate(zip(sizes, ranges, strict=True))]
    opener, _ = opener_for(sources)
    taken = _run(Mixer(weights, "tokens", "drop", 0, fresh_states(3, 0), opener))
    src = np.array([i for i, _ in taken])
    assert np.bincount(src).tolist() == sizes  # drop: every row of every source, once
    gone = int(np.flatnonzero(src == 2)[-1]) + 1  # rows taken up to source 2's last row
    assert 2000 <= gone <= len(taken) - 4000  # many windows on both sides

    before = _window_shares(taken[:gone], 3, 1000)
    assert len(before) >= 8 and np.abs(before - np.array(weights)).max() <= 0.02
    # After it: the others keep their relative weights (0.5 : 0.3 -> 0.625 / 0.375) until the next runs out.
    rest_src = src[gone:]
    next_gone = min(int(np.flatnonzero(rest_src == i)[-1]) for i in (0, 1)) + 1
    rest = taken[gone:][:next_gone]
    after = _window_shares(rest, 3, 1000)
    assert len(after) >= 8 and np.abs(after - np.array([0.625, 0.375, 0.0])).max() <= 0.02
