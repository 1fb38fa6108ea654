"""THE FEEDER BEFORE ITS COLUMNAR REWRITE -- kept for ``benchmarks/feeder_scale.py`` only. Not used by
the library; do not import it elsewhere.

This is ``pipelines/loader.py`` and the row-by-row ``Mixer`` of ``pipelines/stream/mixing.py`` as of commit
7368158 (before issue #10's rewrite), trimmed to what the benchmark drives: every Arrow batch becomes
Python dicts (``to_pylist``), the mixer advances row by row, each rank gets pickled lists of ints and
turns them back into numpy row by row. Its epoch-boundary and cycle bugs (#14) are left as they were.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from pipelines.stream.mixing import fresh_states, stream_epoch
from pipelines.stream.state import DataState, LedgerEntry, SourceState
from pipelines.stream.units import ResumePoint, point_after

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "sample_ids")
Row = dict[str, Any]
logger = logging.getLogger(__name__)


def _rows_of(ds: ray.data.Dataset) -> Iterator[Row]:
    """Rows of a dataset in stream order, as plain dicts (lists of ints)."""
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
        yield from batch.to_pylist()


class Mixer:
    """Interleaves source streams by weight; ``next()`` returns ``(source, row)`` or ``None`` at epoch end."""

    def __init__(self, weights: list[float], mix_by: str, exhausted: str, epoch: int,
                 states: list[SourceState], opener: Any) -> None:
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


@dataclass
class Item:
    """One unit of work for all ranks: a step's rows per rank, or the end of an epoch."""

    index: int
    kind: str  # "step" | "epoch_end"
    epoch: int
    step: int  # global optimizer step this item is (step items) or follows (epoch_end)
    ranks: list[list[Row]]
    state: dict[str, Any]  # DataState after this item


class OldFeeder:
    """The old ``DataFeeder`` body; ``plan`` (groups, weights, open -> row dicts) replaces the config."""

    def __init__(self, plan: Any, world_size: int, rows_per_rank: int, epochs: int = 1,
                 mix_by: str = "tokens", mix_exhausted: str = "stop", prefetch_items: int = 4) -> None:
        self.world, self.k, self.epochs = world_size, rows_per_rank, epochs
        self.plan, self.mix_by, self.mix_exhausted = plan, mix_by, mix_exhausted
        self.state = DataState(0, 0, fresh_states(len(self.plan.groups), 0))
        self.ledger = None
        self.max_items = prefetch_items
        self._rows: dict[int, Item] = {}  # items some rank has not fetched yet
        self._fetched: dict[int, set[int]] = {}
        self._served: set[int] = set()  # items every rank has fetched
        self._states: dict[int, dict] = {}  # state after each item, until committed
        self._pending: list[LedgerEntry] = []  # steps fetched but not yet in the ledger
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._produce, daemon=True)
        self._thread.start()

    # ---- producer
    def _mixer(self, epoch: int, states: list[SourceState]) -> Mixer:
        return Mixer(self.plan.weights, self.mix_by, self.mix_exhausted, epoch, states, self.plan.open)

    def _epoch_items(self, index: int, epoch: int, step: int, states: list[SourceState]) -> tuple[int, int]:
        """Produce one epoch's step items and its epoch-end item; returns the next index and step."""
        mixer = self._mixer(epoch, states)
        while not mixer.done:
            rows: list[Row] = []
            while len(rows) < self.world * self.k and (nxt := mixer.next()) is not None:
                rows.append({c: nxt[1][c] for c in ROW_COLUMNS})
            if not rows:
                break
            step += 1
            ranks = [rows[r * self.k:(r + 1) * self.k] for r in range(self.world)]
            self._put(Item(index, "step", epoch, step, ranks, DataState(epoch, step, states).to_dict()))
            index += 1
        end = DataState(epoch, step, states, epoch_done=True).to_dict()
        self._put(Item(index, "epoch_end", epoch, step, [[] for _ in range(self.world)], end))
        return index + 1, step

    def _produce(self) -> None:
        try:
            st = self.state
            epoch, step, index = st.epoch + int(st.epoch_done), st.step, 0
            states = st.sources if not st.epoch_done else fresh_states(len(self.plan.groups), epoch)
            while epoch < self.epochs:
                index, step = self._epoch_items(index, epoch, step, states)
                epoch += 1
                states = fresh_states(len(self.plan.groups), epoch)
        except BaseException as err:  # surfaced to every rank by get()
            logger.exception("data feeder failed")
            with self._cond:
                self._error = err
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _put(self, item: Item) -> None:
        with self._cond:
            while len(self._rows) >= self.max_items:
                self._cond.wait(timeout=1.0)
            self._rows[item.index] = item
            self._fetched[item.index] = set()
            self._states[item.index] = item.state
            self._cond.notify_all()

    # ---- served to ranks
    def get(self, index: int, rank: int) -> dict | None:
        """Item ``index`` for ``rank`` (blocks until produced); ``None`` when the training data is over."""
        with self._cond:
            while index not in self._rows:
                if index in self._served:
                    raise KeyError(f"item {index} was already served to every rank")
                if self._error is not None:
                    raise RuntimeError(f"data feeder failed: {self._error!r}") from self._error
                if self._finished and index not in self._rows:
                    return None
                self._cond.wait(timeout=1.0)
            item = self._rows[index]
            self._fetched[index].add(rank)
            if len(self._fetched[index]) == self.world:  # every rank has it: drop the rows
                del self._rows[index], self._fetched[index]
                self._served.add(index)
                if item.kind == "step":
                    self._pending.append(LedgerEntry(item.epoch, item.step,
                                                     [[r["sample_ids"] for r in rows] for rows in item.ranks]))
                self._cond.notify_all()
            return {"kind": item.kind, "epoch": item.epoch, "step": item.step, "rows": item.ranks[rank]}

    def commit(self, index: int) -> dict:
        """The data state after item ``index`` (to checkpoint); the ledger gets the steps up to it."""
        with self._cond:
            state = self._states.get(index)
            if state is None:
                raise KeyError(f"item {index} was already committed or never produced")
            for k in [k for k in self._states if k < index]:
                del self._states[k]
            done = [e for e in self._pending if e.step <= state["step"]]
            self._pending = [e for e in self._pending if e.step > state["step"]]
        if self.ledger and done:
            self.ledger.write(done)
        return state


class FeederClient:
    """A rank's view of the feeder: ``next()`` returns the next item for this rank, prefetched."""

    def __init__(self, feeder: Any, rank: int, start_index: int = 0, prefetch: int = 2) -> None:
        self.feeder, self.rank, self.index, self.prefetch = feeder, rank, start_index, prefetch
        self._futures: dict[int, Any] = {}

    def _request(self, i: int) -> None:
        if i not in self._futures:
            self._futures[i] = self.feeder.get.remote(i, self.rank)

    def next(self) -> dict | None:
        for i in range(self.index, self.index + self.prefetch + 1):
            self._request(i)
        item = ray.get(self._futures.pop(self.index))
        if item is not None:
            item["index"] = self.index
            self.index += 1
        return item


def old_columns(rows: list[dict]) -> dict[str, list[np.ndarray]]:
    """The old rank side (``pipelines/train/feed.py``): lists of ints back into numpy, row by row."""
    return {k: [np.asarray(r[k]) for r in rows] for k in ("input_ids", "labels", "position_ids")}
