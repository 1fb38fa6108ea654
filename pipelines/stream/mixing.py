"""Token-weighted mixing of several source streams into one deterministic row stream, on arrays.

Each entry of ``data.datasets`` is its own deterministic stream of packed rows (a row never mixes
sources). The mixer repeatedly takes the next row from the source that is furthest *behind* its
weight: the one with the smallest ``taken_i / weight_i``, where ``taken`` counts tokens
(``data.mix_by: tokens``) or samples (``samples``); ties go to the earlier entry. Worked example,
weights 0.6/0.3/0.1 and rows of 100 tokens each: after 10 rows the sources have 600/300/100
tokens; the cumulative error never exceeds one row, so over any window of 1,000 rows of ~2,000
tokens each the shares stay within 0.1% of the weights (the test allows 2%).

The rule is applied to whole chunks (a Ray Data block of packed rows) at once, never row by row in
Python: row ``j`` of source ``i``'s buffered rows is picked when its key
``(taken_i + tokens of rows 0..j-1) / weight_i`` is the smallest, so the picks are the merge of the
sources' (sorted) key arrays, ordered by ``(key, source)``. Worked example, weights 0.5/0.5, source 0
buffered rows of 3, 3 tokens, source 1 of 4, 1 tokens, nothing taken yet::

    keys  source 0: 0/0.5=0, 3/0.5=6 | then 12 (next chunk)   source 1: 0, 8 | then 10 (next chunk)
    merge by (key, source): (0,s0) (0,s1) (6,s0) (8,s1) (10,s1: not buffered -> fetch, then go on)

Each source's "next, not yet buffered row" takes part in the merge as a sentinel; the picks stop there
and that source's next chunk is fetched (or the source is exhausted) -- exactly when the row-by-row
rule would have asked it for a row, so the stream is the same whatever the chunk sizes.

When a source runs out before the others (``data.mix_exhausted``):

* ``stop``  - the epoch ends at once; every row of the epoch respects the weights.
* ``cycle`` - the source starts a new pass (a fresh seeded order) and mixing goes on; the epoch
  ends once every source has run out at least once, so small sources are repeated (upsampled).
* ``drop``  - the source leaves the mix and the others go on with their weights renormalised;
  the epoch ends when all have run out, so every sample is seen exactly once.

The mixer's counters and each source's resume point form :class:`~pipelines.stream.state.DataState`,
so a resumed run continues the same mix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipelines.seeds import stream_epoch
from pipelines.stream.state import SourceState
from pipelines.stream.units import ROW_UNIT_FIELDS, ResumePoint, point_after

__all__ = ["Chunk", "Mixer", "Picked", "fresh_states", "stream_epoch"]

Row = dict[str, Any]
UNIT_COLUMNS = tuple(name for name, _ in ROW_UNIT_FIELDS)  # where a row sits in its unit (pipelines.stream.units)
# open(source index, state) -> (chunks of that source from state.point, file index -> position in the read order)
Opener = Callable[[int, SourceState], tuple[Iterator["Chunk"], dict[int, int]]]

@dataclass(frozen=True)
class Chunk:
    """Consecutive packed rows of one source, described by small per-row arrays.

    The tokens stay where they are: ``block`` is an ``ObjectRef`` of a Ray Data block (an Arrow
    table; rows ``offset .. offset + len(self)`` of it), which the ranks fetch themselves.
    """

    block: Any
    offset: int
    tokens: np.ndarray  # int64 [n]: len(input_ids) of each row
    sample_offsets: np.ndarray  # int64 [n + 1]: row j's sample ids are sample_values[o[j]:o[j+1]]
    sample_values: np.ndarray  # int64
    units: dict[str, np.ndarray]  # UNIT_COLUMNS, int64 [n] each

    def __len__(self) -> int:
        return len(self.tokens)

    def counts(self, mix_by: str) -> np.ndarray:
        """What mixing counts per row: tokens, or samples."""
        return self.tokens if mix_by == "tokens" else np.diff(self.sample_offsets)

    def sample_ids(self, start: int, stop: int) -> list[list[int]]:
        """The sample ids of rows ``start .. stop`` (chunk positions), one list per row."""
        o = self.sample_offsets
        flat = self.sample_values[o[start]:o[stop]].tolist()
        cuts = (o[start:stop + 1] - o[start]).tolist()
        return [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def unit_row(self, j: int) -> Row:
        """The ``unit_*`` fields of row ``j``, as :func:`pipelines.stream.state.point_after` reads them."""
        return {k: int(v[j]) for k, v in self.units.items()}

    def tail(self, k: int) -> Chunk:
        """The chunk without its first ``k`` rows."""
        o = self.sample_offsets
        return Chunk(self.block, self.offset + k, self.tokens[k:], o[k:] - o[k], self.sample_values[o[k]:],
                     {name: v[k:] for name, v in self.units.items()})

    @classmethod
    def from_table(cls, table: Any, block: Any, start: int = 0, stop: int | None = None, first_row: int = 0) -> Chunk:
        """A chunk over rows ``start .. stop`` of an Arrow table of packed rows (the block ``block``).

        Reads only list offsets, ``sample_ids`` and the ``unit_*`` columns; the token columns are not
        touched (on the same node the table is a zero-copy view of the object store). Rows without them
        (a dataset given to the trainer: ``input_ids``, ``labels``, ``position_ids`` only) are numbered
        from ``first_row``, the stream's index of row ``start``: each is its own unit of "file 0", so
        :func:`~pipelines.stream.units.point_after` row ``r`` is row ``r + 1``, and its sample id is ``r``.
        """
        t = table.slice(start, (table.num_rows if stop is None else stop) - start)
        ids = np.asarray(t.column("input_ids").combine_chunks().offsets, dtype=np.int64)
        numbered = np.arange(first_row, first_row + t.num_rows, dtype=np.int64)
        if "sample_ids" in t.column_names:
            sids = t.column("sample_ids").combine_chunks()
            so = np.asarray(sids.offsets, dtype=np.int64)
            values = np.asarray(sids.values.to_numpy(zero_copy_only=False), dtype=np.int64)[so[0]:so[-1]].copy()
            so = so - so[0]
        else:
            so, values = np.arange(t.num_rows + 1, dtype=np.int64), numbered
        if "unit_id" in t.column_names:
            units = {k: t.column(k).to_numpy().astype(np.int64) for k in UNIT_COLUMNS}
        else:
            none, zero, one = np.full(t.num_rows, -1), np.zeros(t.num_rows, np.int64), np.ones(t.num_rows, np.int64)
            units = {"unit_id": numbered, "unit_start_byte": none, "unit_end_row": numbered + 1,
                     "unit_end_byte": none, "unit_row": zero, "unit_rows": one}
        return cls(block, start, np.diff(ids), so, values, units)


@dataclass(frozen=True)
class Picked:
    """Rows ``start .. stop`` (chunk positions) of ``chunk``, taken consecutively from source ``source``."""

    source: int
    chunk: Chunk
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


class Mixer:
    """Interleaves source streams by weight; ``take(n)`` returns the next ``n`` rows as runs of chunks.

    ``take`` returns fewer (or none) at the end of the epoch, after which ``done`` is True;
    ``ready()`` looks ahead without taking a row: whether the epoch has another row.
    """

    def __init__(self, weights: list[float], mix_by: str, exhausted: str, epoch: int,
                 states: list[SourceState], opener: Opener) -> None:
        assert len(weights) == len(states) and all(w > 0 for w in weights)
        self.weights, self.mix_by, self.policy, self.epoch = weights, mix_by, exhausted, epoch
        self.states, self.opener = states, opener
        self._iters: list[Iterator[Any] | None] = [None] * len(states)
        self._file_pos: list[dict[int, int]] = [{} for _ in states]
        self._chunks: list[Chunk | None] = [None] * len(states)
        self._pos = [0] * len(states)  # rows of the current chunk already taken
        self.active = [not (s.exhausted and exhausted == "drop") for s in states]
        self.done = False

    def _taken(self, i: int) -> int:
        s = self.states[i]
        return s.tokens if self.mix_by == "tokens" else s.samples

    def _buffered(self, i: int) -> int:
        c = self._chunks[i]
        return 0 if c is None else len(c) - self._pos[i]

    def _pick(self) -> int | None:
        live = [i for i, a in enumerate(self.active) if a]
        if not live:
            return None
        return min(live, key=lambda i: (self._taken(i) / self.weights[i], i))

    def _fetch(self, i: int) -> bool:
        """Buffer source ``i``'s next chunk; False when its stream (this pass) has run out."""
        if self._iters[i] is None:
            self._iters[i], self._file_pos[i] = self.opener(i, self.states[i])
        for chunk in self._iters[i]:  # type: ignore[union-attr]
            if len(chunk):
                self._chunks[i], self._pos[i] = chunk, 0
                return True
        self._chunks[i] = None
        return False

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
        if s.rows_in_pass == 0 and s.passes > 0:  # an empty pass: nothing to cycle
            self.active[i] = False
            return not any(self.active)
        s.passes += 1
        s.rows_in_pass = 0
        s.point = ResumePoint(epoch=stream_epoch(self.epoch, s.passes))
        self._iters[i] = None
        return False

    def ready(self) -> bool:
        """Make sure the next row to take is buffered (fetching, exhausting, cycling exactly as taking
        it would); False once the epoch is over. Takes no row and changes no counter."""
        while not self.done:
            i = self._pick()
            if i is None:
                self.done = True
            elif self._buffered(i) or self._fetch(i):
                return True
            else:
                self.done = self._exhaust(i)
        return False

    def _merge(self, need: int) -> list[tuple[int, int]]:
        """Up to ``need`` picks ``(source, rows)`` from buffered rows, stopping before any source's
        first unbuffered row; run-length encoded by source."""
        keys, srcs, idx = [], [], []
        for i, live in enumerate(self.active):
            if not live:
                continue
            m = min(self._buffered(i), need)
            counts = self._chunks[i].counts(self.mix_by)[self._pos[i]:self._pos[i] + m] if m else np.zeros(0, np.int64)
            cum = self._taken(i) + np.concatenate([[0], np.cumsum(counts)])
            last = m + 1 if m == self._buffered(i) else m  # + the sentinel: the next, unbuffered row
            keys.append(cum[:last] / self.weights[i])
            srcs.append(np.full(last, i))
            idx.append(np.arange(last))
        key, src, pos = np.concatenate(keys), np.concatenate(srcs), np.concatenate(idx)
        order = np.lexsort((pos, src, key))[:need]
        buffered = np.array([self._buffered(i) for i in range(len(self.states))])
        sentinel = pos[order] == buffered[src[order]]
        stop = int(np.argmax(sentinel)) if sentinel.any() else len(order)
        chosen = src[order[:stop]]
        if not len(chosen):
            return []
        cuts = np.flatnonzero(np.diff(chosen)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [len(chosen)]])
        return [(int(chosen[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]

    def _consume(self, i: int, rows: int) -> Picked:
        c, p = self._chunks[i], self._pos[i]
        assert c is not None and rows <= len(c) - p
        s = self.states[i]
        s.tokens += int(c.tokens[p:p + rows].sum())
        s.samples += int(c.sample_offsets[p + rows] - c.sample_offsets[p])
        s.rows_in_pass += rows
        s.point = point_after(c.unit_row(p + rows - 1), self._file_pos[i], s.point.epoch)
        self._pos[i] = p + rows
        return Picked(i, c, p, p + rows)

    def take(self, n: int) -> list[Picked]:
        """The next ``n`` rows of the mix (fewer at the epoch end), as consecutive runs of chunks."""
        out: list[Picked] = []
        need = n
        while need > 0 and self.ready():
            for i, rows in self._merge(need):
                out.append(self._consume(i, rows))
                need -= rows
        return out


def fresh_states(n: int, epoch: int) -> list[SourceState]:
    """Source states at the start of an epoch."""
    return [SourceState(point=ResumePoint(epoch=stream_epoch(epoch, 0))) for _ in range(n)]
