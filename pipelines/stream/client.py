"""A rank's view of the feeder: :class:`FeederClient` fetches this rank's items, a batch of steps per call."""

from __future__ import annotations

from collections import deque
from typing import Any

import ray

# A rank fetches Ray Data's blocks; in a process where Ray Data was never imported, fetching them cost about
# 4x the CPU at 64 ranks (docs/benchmark_analysis.md, B8). Ray Train's workers import it; bare actors did not.
import ray.data  # noqa: F401

from pipelines.stream.blocks import BlockColumns, RankItem, fetch_blocks

__all__ = ["FeederClient"]


class FeederClient:
    """A rank's view of the feeder: ``next()`` returns the next :class:`RankItem` for this rank.

    It keeps one request in flight, for the items after those it holds; each request takes up to
    ``batch`` items, and waits until :meth:`_least` of them are ready: one actor call per ``batch``
    steps. The blocks of a response are fetched with one ``ray.get`` (a block the previous response
    used is kept, not fetched again), so a rank fetches each block once, not once per step.
    """

    def __init__(self, feeder: Any, rank: int, start_index: int = 0, batch: int = 8) -> None:
        self.feeder, self.rank, self.index, self.batch = feeder, rank, start_index, batch
        self._ready: deque[RankItem] = deque()  # items index, index + 1, ... already here
        self._pending: Any = None  # the request for the items after them
        self._blocks: dict[Any, BlockColumns] = {}  # the blocks of the last response
        self._over = False
        self._start = start_index

    def _least(self, first: int) -> int:
        """How many items a request waits for: as many as the rank has received, up to ``batch``.

        Worked example, ``batch`` 8, the feeder never ahead: requests wait for 1, 1, 2, 4, 8, 8, ...
        items. Waiting for one would let a rank that keeps pace with the feeder get one item per call, as
        each was produced: at 64 ranks, 64 calls per step, the main cost of the feeder and of each rank
        (docs/design.md, "Placement and timing notes"). Doubling from one keeps the first steps as
        quick as before while the stream is still starting. The wait cannot deadlock: the feeder caps
        it at its window, which always holds the slowest rank's next items.
        """
        return max(1, min(self.batch, first - self._start))

    def _request(self) -> None:
        if self._pending is None and not self._over:
            first = self.index + len(self._ready)
            self._pending = self.feeder.get.remote(first, self.rank, self.batch, self._least(first))

    def next(self) -> RankItem | None:
        self._request()
        if not self._ready and self._pending is not None:
            items, self._pending = ray.get(self._pending), None
            self._over = not items
            items, self._blocks = fetch_blocks(items, self._blocks)
            self._ready.extend(items)
        if not self._ready:
            return None
        item = self._ready.popleft()
        assert item.index == self.index, (item.index, self.index)
        self.index += 1
        self._request()  # the next items load while this one trains
        return item
