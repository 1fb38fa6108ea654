"""Token-weighted mixing of several source streams into one deterministic row stream.

Each entry of ``data.datasets`` is its own deterministic stream of packed rows (a row never mixes
sources). The mixer repeatedly takes the next row from the source that is furthest *behind* its
weight: the one with the smallest ``taken_i / weight_i``, where ``taken`` counts tokens
(``data.mix_by: tokens``) or samples (``samples``); ties go to the earlier entry. Worked example,
weights 0.6/0.3/0.1 and rows of 100 tokens each: after 10 rows the sources have 600/300/100
tokens; the cumulative error never exceeds one row, so over any window of 1,000 rows of ~2,000
tokens each the shares stay within 0.1% of the weights (the test allows 2%).

When a source runs out before the others (``data.mix_exhausted``):

* ``stop``  - the epoch ends at once; every row of the epoch respects the weights.
* ``cycle`` - the source starts a new pass (a fresh seeded order) and mixing goes on; the epoch
  ends once every source has run out at least once, so small sources are repeated (upsampled).
* ``drop``  - the source leaves the mix and the others go on with their weights renormalised;
  the epoch ends when all have run out, so every sample is seen exactly once.

The mixer's counters and each source's resume point form :class:`~pipelines.resume.DataState`,
so a resumed run continues the same mix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pipelines.resume import SourceState
from pipelines.seeds import stream_epoch
from pipelines.units import ResumePoint, point_after

Row = dict[str, Any]
# open(source index, state) -> (rows of that source from state.point, source index -> file position)
Opener = Callable[[int, SourceState], tuple[Iterator[Row], dict[int, int]]]

class Mixer:
    """Interleaves source streams by weight; ``next()`` returns ``(source, row)`` or ``None`` at epoch end."""

    def __init__(self, weights: list[float], mix_by: str, exhausted: str, epoch: int,
                 states: list[SourceState], opener: Opener) -> None:
        assert len(weights) == len(states) and all(w > 0 for w in weights)
        self.weights, self.mix_by, self.policy, self.epoch = weights, mix_by, exhausted, epoch
        self.states, self.opener = states, opener
        self._iters: list[Iterator[Row] | None] = [None] * len(states)
        self._file_pos: list[dict[int, int]] = [{} for _ in states]
        self.active = [not (s.exhausted and exhausted == "drop") for s in states]
        self._rows_in_pass = [0] * len(states)
        self.done = False

    def _taken(self, i: int) -> int:
        s = self.states[i]
        return s.tokens if self.mix_by == "tokens" else s.samples

    def _pick(self) -> int | None:
        live = [i for i, a in enumerate(self.active) if a]
        if not live:
            return None
        return min(live, key=lambda i: (self._taken(i) / self.weights[i], i))

    def _open(self, i: int) -> Iterator[Row]:
        if self._iters[i] is None:
            self._iters[i], self._file_pos[i] = self.opener(i, self.states[i])
        return self._iters[i]  # type: ignore[return-value]

    def _exhaust(self, i: int) -> bool:
        """Source ``i`` ran out; returns True when the epoch is over."""
        s = self.states[i]
        s.exhausted = True
        if self.policy == "stop":
            return True
        if self.policy == "drop":
            self.active[i] = False
            return not any(self.active)
        if all(st.exhausted for st in self.states):  # cycle: every source ran out once
            return True
        if self._rows_in_pass[i] == 0 and s.passes > 0:  # an empty pass: nothing to cycle
            self.active[i] = False
            return not any(self.active)
        s.passes += 1
        self._rows_in_pass[i] = 0
        s.point = ResumePoint(epoch=stream_epoch(self.epoch, s.passes))
        self._iters[i] = None
        return False

    def next(self) -> tuple[int, Row] | None:
        while not self.done:
            i = self._pick()
            if i is None:
                self.done = True
                break
            row = next(self._open(i), None)
            if row is None:
                self.done = self._exhaust(i)
                continue
            s = self.states[i]
            self._rows_in_pass[i] += 1
            s.point = point_after(row, self._file_pos[i], s.point.epoch)
            s.tokens += len(row["input_ids"])
            s.samples += len(row["sample_ids"])
            return i, row
        return None


def fresh_states(n: int, epoch: int) -> list[SourceState]:
    """Source states at the start of an epoch."""
    return [SourceState(point=ResumePoint(epoch=stream_epoch(epoch, 0))) for _ in range(n)]
