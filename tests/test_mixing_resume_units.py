"""Mixing, resume points and the ledger, without Ray (fake row streams)."""

from __future__ import annotations

import numpy as np
import pyarrow.fs as pafs
import pytest

from pipelines.sources.listing import make_sample_id
from pipelines.stream.dataset import ResumePoint
from pipelines.stream.ledger import Ledger, LedgerEntry, sample_counts
from pipelines.stream.mixing import UNIT_COLUMNS, Chunk, Mixer, fresh_states
from pipelines.stream.state import DataState, SourceState
from pipelines.stream.units import point_after


def fake_source(source: int, lengths: list[int], unit: int = 10):
    """Rows of one fake source: row j has lengths[j] tokens, one sample, units of ``unit`` rows."""
    rows = []
    for j, n in enumerate(lengths):
        u = j // unit
        rows_in_unit = min(unit, len(lengths) - u * unit)
        rows.append({
            "input_ids": [1] * n, "sample_ids": [make_sample_id(source, j)],
            "unit_id": make_sample_id(source, u * unit), "unit_start_byte": -1,
            "unit_end_row": u * unit + rows_in_unit, "unit_end_byte": -1,
            "unit_row": j - u * unit, "unit_rows": rows_in_unit,
        })
    return rows


def row_chunk(row: dict) -> Chunk:
    """A one-row chunk whose block is the row dict itself (the mixer reads only the small arrays)."""
    return Chunk([row], 0, np.array([len(row["input_ids"])], np.int64),
                 np.array([0, len(row["sample_ids"])], np.int64), np.array(row["sample_ids"], np.int64),
                 {k: np.array([row[k]], np.int64) for k in UNIT_COLUMNS})


def opener_for(sources: list[list[dict]]):
    """An opener that resumes a fake source at a ResumePoint (unit start row + rows to skip)."""
    opened = []

    def open_(i: int, state: SourceState):
        p = state.point
        start = p.row + p.skip_rows
        opened.append((i, p))
        return map(row_chunk, sources[i][start:]), {i: 0}

    return open_, opened


def _run(mixer: Mixer, limit: int | None = None):
    """``(source, row dict)`` of each row the mixer takes, one at a time."""
    out = []
    while (limit is None or len(out) < limit) and (picked := mixer.take(1)):
        out.append((picked[0].source, picked[0].chunk.block[picked[0].start]))
    return out


def _window_shares(taken: list[tuple[int, dict]], n_sources: int, window: int) -> np.ndarray:
    src = np.array([i for i, _ in taken])
    tok = np.array([len(r["input_ids"]) for _, r in taken])
    shares = []
    for a in range(0, len(taken) - window + 1, window // 4):
        t = tok[a:a + window]
        shares.append([t[src[a:a + window] == i].sum() / t.sum() for i in range(n_sources)])
    return np.array(shares)


def test_token_shares_hold_in_every_window_of_1000_rows():
    rng = np.random.default_rng(0)
    sources = [fake_source(i, rng.integers(lo, hi, size=6000).tolist())
               for i, (lo, hi) in enumerate([(50, 400), (200, 2000), (10, 60)])]
    weights = [0.6, 0.3, 0.1]
    opener, _ = opener_for(sources)
    taken = _run(Mixer(weights, "tokens", "stop", 0, fresh_states(3, 0), opener))
    shares = _window_shares(taken, 3, 1000)
    assert len(shares) >= 8  # the property is checked on many windows
    assert np.abs(shares - np.array(weights)).max() <= 0.02
    # Counted by rows the same mix would be far off: sources have very different row lengths.
    row_share = np.bincount([i for i, _ in taken], minlength=3) / len(taken)
    assert abs(row_share[1] - 0.3) > 0.1


def test_sample_shares_with_mix_by_samples():
    sources = [fake_source(i, [n] * 3000) for i, n in enumerate([10, 100])]
    opener, _ = opener_for(sources)
    taken = _run(Mixer([0.5, 0.5], "samples", "stop", 0, fresh_states(2, 0), opener))
    counts = np.bincount([i for i, _ in taken])
    assert abs(counts[0] - counts[1]) <= 1


@pytest.mark.parametrize("policy", ["stop", "cycle", "drop"])
def test_exhaustion_policies(policy):
    small, big = fake_source(0, [10] * 50), fake_source(1, [10] * 400)
    opener, opened = opener_for([small, big])
    taken = _run(Mixer([0.5, 0.5], "tokens", policy, 0, fresh_states(2, 0), opener))
    per_source = np.bincount([i for i, _ in taken], minlength=2)
    if policy == "stop":  # ends when the small one runs out: 50 + ~50 rows
        assert per_source[0] == 50 and 49 <= per_source[1] <= 51
    elif policy == "drop":  # every row of both, once
        assert per_source.tolist() == [50, 400]
        ids = [r["sample_ids"][0] for _, r in taken]
        assert len(set(ids)) == len(ids)
    else:  # cycle: the small source repeats until the big one has run out once
        assert per_source[1] == 400 and 395 <= per_source[0] <= 405
        assert sum(1 for i, _ in opened if i == 0) == 9  # 8 full passes, then a 9th opened before the end


def test_resume_mid_mix_continues_the_same_sequence():
    rng = np.random.default_rng(1)
    sources = [fake_source(i, rng.integers(20, 300, size=500).tolist(), unit=7) for i in range(3)]
    weights = [0.6, 0.3, 0.1]
    opener, _ = opener_for(sources)
    full = _run(Mixer(weights, "tokens", "drop", 0, fresh_states(3, 0), opener))
    opener2, _ = opener_for(sources)
    states = fresh_states(3, 0)
    head = _run(Mixer(weights, "tokens", "drop", 0, states, opener2), limit=333)
    # Checkpoint: the states go through their dict form, as in a checkpoint file.
    saved = DataState(0, 333, states).to_dict()
    restored = DataState.from_dict(saved)
    assert restored is not None
    opener3, opened3 = opener_for(sources)
    tail = _run(Mixer(weights, "tokens", "drop", 0, restored.sources, opener3))
    assert [r["sample_ids"] for _, r in head + tail] == [r["sample_ids"] for _, r in full]
    assert all(p.skip_rows < 7 for _, p in opened3)  # resumed inside units, not by skipping rows


def test_point_after_counts_units_and_rows_not_row_totals():
    """Regression: a position is (unit, rows of that unit), never 'N rows seen'."""
    row = {"unit_id": make_sample_id(3, 2000), "unit_start_byte": 123, "unit_end_row": 3000,
           "unit_end_byte": 456, "unit_row": 2, "unit_rows": 7}
    assert point_after(row, {3: 1}, 0) == ResumePoint(0, 1, 2000, 123, 3)
    last = dict(row, unit_row=6)
    assert point_after(last, {3: 1}, 0) == ResumePoint(0, 1, 3000, 456, 0)


def test_ledger_write_truncate_and_count(tmp_path):
    ledger = Ledger(pafs.LocalFileSystem(), str(tmp_path / "ledger"))
    ledger.write([LedgerEntry(0, s, [[[s * 10, s * 10 + 1]], [[s * 10 + 2]]]) for s in range(1, 6)])
    ledger.write([LedgerEntry(0, s, [[[s * 10]], [[]]]) for s in range(6, 9)])
    assert [e.step for e in ledger.entries(0)] == list(range(1, 9))
    ledger.truncate_after(4)
    assert [e.step for e in ledger.entries()] == [1, 2, 3, 4]
    assert sample_counts(ledger.entries()) == {v: 1 for s in range(1, 5) for v in (s * 10, s * 10 + 1, s * 10 + 2)}


@pytest.mark.parametrize("policy", ["stop", "cycle", "drop"])
def test_resume_after_every_row_continues_the_uninterrupted_stream(policy):
    """Regression (cycle): the rows taken in the current pass are part of the state; resuming right
    after a cycled source's last row of pass >= 1 used to find it "empty" and drop it from the mix."""
    sources = [fake_source(0, [10, 30, 20], unit=2), fake_source(1, [25] * 12, unit=5)]
    opener, _ = opener_for(sources)
    full = [(i, r["sample_ids"]) for i, r in _run(Mixer([0.5, 0.5], "tokens", policy, 0, fresh_states(2, 0), opener))]
    assert len(full) >= 12 if policy != "stop" else len(full) >= 5
    if policy == "cycle":  # the small source really cycles, more than once
        assert sum(1 for i, _ in full if i == 0) > 2 * len(sources[0])
    for cut in range(1, len(full)):
        opener, _ = opener_for(sources)
        states = fresh_states(2, 0)
        head = _run(Mixer([0.5, 0.5], "tokens", policy, 0, states, opener), limit=cut)
        restored = DataState.from_dict(DataState(0, cut, states).to_dict())
        opener, _ = opener_for(sources)
        tail = _run(Mixer([0.5, 0.5], "tokens", policy, 0, restored.sources, opener))
        assert [(i, r["sample_ids"]) for i, r in head + tail] == full, f"resumed after row {cut}"
