"""The loader: one deterministic, resumable stream of packed rows, served to every training rank.

Ray Data's ``streaming_split`` hands blocks to whichever rank asks first, so which rank trains on
which row changes run to run, and "rows seen per rank" cannot be turned back into a position. Here
one small ``DataFeeder`` actor (created by rank 0 of each worker group on its node, dying with it) iterates
the per-source datasets of :func:`pipelines.dataset.build_dataset` in order, mixes them
(:mod:`pipelines.mixing`) and cuts the result into *items*:

* a step item: the rows of one global optimizer step, ``world_size x rows_per_rank`` of them,
  rank ``r`` taking the ``r``-th slice (fewer, or none, at the end of an epoch), plus the
  :class:`~pipelines.resume.DataState` right after it;
* an epoch-end item, after the last step of an epoch.

The global row order does not depend on the world size, so a run checkpointed with 2 workers
resumes with 1 (or 1 with 2) at the same row. Ranks fetch items by index through
:class:`FeederClient`, which prefetches; the feeder prefetches too, in a thread.
``commit(item)`` returns the state to checkpoint and writes the ledger of the steps up to it.

The data path itself (reads, tokenizer actors, packing) is Ray Data, launched from the feeder.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from pipelines.config import Config, config_from_dict, dump_config
from pipelines.dataset import build_dataset, data_report
from pipelines.mixing import Mixer, Row, fresh_states
from pipelines.resume import DataState, Ledger, LedgerEntry, SourceState
from pipelines.sources import resolve_sources
from pipelines.storage import StorageOptions, filesystem_for
from pipelines.units import file_positions

logger = logging.getLogger(__name__)

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "sample_ids")


@dataclass
class Item:
    """One unit of work for all ranks: a step's rows per rank, or the end of an epoch."""

    index: int
    kind: str  # "step" | "epoch_end"
    epoch: int
    step: int  # global optimizer step this item is (step items) or follows (epoch_end)
    ranks: list[list[Row]]
    state: dict[str, Any]  # DataState after this item


def _rows_of(ds: ray.data.Dataset) -> Iterator[Row]:
    """Rows of a dataset in stream order, as plain dicts (lists of ints)."""
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
        yield from batch.to_pylist()


class StreamPlan:
    """How to open each mixed source: which ``data.datasets`` entries it reads and its weight."""

    def __init__(self, cfg: Config, split: str) -> None:
        self.cfg, self.split = cfg, split
        n = len(cfg.data.datasets) if split == "train" else 1
        if cfg.data.mix_by == "none" or n == 1 or split != "train":
            self.groups: list[list[int] | None] = [None]
            self.weights = [1.0]
        else:
            self.groups = [[i] for i in range(n)]
            self.weights = [d.weight for d in cfg.data.datasets]
        self.table = resolve_sources(cfg, split)  # listed once; files are fixed for the run
        self.datasets: list[ray.data.Dataset] = []  # every stream opened (for data_report)

    def open(self, i: int, state: SourceState) -> tuple[Iterator[Row], dict[int, int]]:
        """Rows of source ``i`` from ``state.point``, and its files' read positions."""
        point = state.point
        ds = build_dataset(self.cfg, self.split, epoch=point.epoch, start=point, datasets=self.groups[i])
        self.datasets.append(ds)
        return _rows_of(ds), file_positions(self.table, self.cfg.data.shuffle_seed, point.epoch, self.groups[i])


@ray.remote(num_cpus=0, max_concurrency=64)
class DataFeeder:
    """Serves items to ranks; see the module docstring. Cheap: it only moves rows."""

    def __init__(self, cfg_dict: dict, base_dir: str, world_size: int, rows_per_rank: int, epochs: int,
                 state: dict | None = None, ledger_root: str | None = None, prefetch_items: int = 4) -> None:
        self.cfg = config_from_dict(cfg_dict, base_dir=base_dir)
        self.world, self.k, self.epochs = world_size, rows_per_rank, epochs
        self.plan = StreamPlan(self.cfg, "train")
        restored = DataState.from_dict(state)
        self.state = restored or DataState(0, 0, fresh_states(len(self.plan.groups), 0))
        self.ledger = None
        if ledger_root:
            fs, path = filesystem_for(ledger_root, StorageOptions.from_config(self.cfg.storage))
            self.ledger = Ledger(fs, path)
            self.ledger.truncate_after(self.state.step)  # steps undone by this restore
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
        d = self.cfg.data
        return Mixer(self.plan.weights, d.mix_by if d.mix_by != "none" else "tokens", d.mix_exhausted,
                     epoch, states, self.plan.open)

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

    def report(self) -> dict:
        """Data-quality counters summed over every stream this feeder opened."""
        totals: dict[str, Any] = {"counters": {}, "examples": {}}
        for ds in self.plan.datasets:
            snap = data_report(ds)
            for k, v in snap["counters"].items():
                totals["counters"][k] = totals["counters"].get(k, 0) + v
            for k, v in snap["examples"].items():
                have = totals["examples"].setdefault(k, [])
                have.extend(v[: max(0, 5 - len(have))])
        return totals


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


def start_feeder(cfg: Config, world_size: int, rows_per_rank: int, state: dict | None,
                 ledger_root: str | None, epochs: int | None = None) -> Any:
    """Create the feeder actor on this node (rank 0 does this; it dies with rank 0's worker group).

    It is pinned to the caller's node: left to Ray's default scheduling (or a soft affinity, which
    falls back under load), the 0-CPU actor lands on any node, e.g. the head or a CPU-only tokenizer
    node, and losing that node would then also end the training stream. On rank 0's node it adds no
    failure domain of its own (tests/test_node_loss.py).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return DataFeeder.options(scheduling_strategy=here).remote(
        dump_config(cfg), cfg.base_dir, world_size, rows_per_rank,
        cfg.train.epochs if epochs is None else epochs, state, ledger_root)
