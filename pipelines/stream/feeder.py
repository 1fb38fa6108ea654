"""The feeder: one deterministic, resumable stream of packed rows, served to every training rank.

Ray Data's ``streaming_split`` hands blocks to whichever rank asks first, so which rank trains on
which row changes run to run, and "rows seen per rank" cannot be turned back into a position. Here
one small ``DataFeeder`` actor (created by rank 0 of each worker group on its node, dying with it) iterates
the per-source datasets of :func:`pipelines.stream.dataset.build_dataset` in order, mixes them
(:mod:`pipelines.stream.mixing`) and cuts the result into *items*:

* a step item: the rows of one global optimizer step, ``world_size x rows_per_rank`` of them,
  rank ``r`` taking the ``r``-th slice (fewer, or none, at the end of an epoch), plus the
  :class:`~pipelines.stream.state.DataState` right after it;
* an epoch-end item, after the last step of an epoch.

The feeder is a control plane: the packed rows stay in Ray's object store as the Arrow blocks the
packing stage wrote. The feeder reads only their small columns (row lengths, ``sample_ids``, the
``unit_*`` position columns), on the node that holds each block, and hands each rank a
:class:`RankItem`: block references and row ranges, never the tokens. Ranks fetch their slices
themselves (:mod:`pipelines.train.feed`). Worked example, 2 ranks x 2 rows, a step mixing 3 rows of
block A (source 0) and 1 row of block B::

    picks   A[5:7]  B[0:1]  A[7:8]
    rank 0  RowSlice(A, 5, 7)
    rank 1  RowSlice(B, 0, 1), RowSlice(A, 7, 8)

The global row order does not depend on the world size, so a run checkpointed with 2 workers
resumes with 1 (or 1 with 2) at the same row. Ranks fetch items by index through
:class:`FeederClient`, which prefetches, taking every ready item (up to 8) per call and fetching
the blocks of those items with one ``ray.get``, each block once; after its first calls a request waits
until a whole batch is ready, so the feeder answers one call per rank per 8 steps, not one per step.
The feeder prefetches too, in a thread, up to 16 items ahead of the slowest rank.
``commit(item)`` returns the state to checkpoint and writes the ledger of the steps up to it.
The state after an epoch's last step already says the epoch is done (the feeder looks one row
ahead), so a checkpoint taken there resumes in the next epoch, not in an empty rest of this one.

The data path itself (reads, tokenizer actors, packing) is Ray Data, launched from the feeder.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipelines.arrays import list_flat
from pipelines.config import Config, config_from_dict, dump_config
from pipelines.sources.listing import resolve_sources
from pipelines.storage import StorageOptions, filesystem_for
from pipelines.stream.dataset import all_pretokenized, build_dataset, data_report, tokenizer_pools_short
from pipelines.stream.mixing import Chunk, Mixer, Picked, fresh_states
from pipelines.stream.state import DataState, Ledger, LedgerEntry, SourceState
from pipelines.stream.units import dataset_files, file_positions

__all__ = ["BlockColumns", "DataFeeder", "Feeder", "FeederClient", "RankItem", "RowSlice", "as_arrow", "block_nodes",
           "feeder_concurrency", "fetch_blocks", "start_feeder"]

logger = logging.getLogger(__name__)

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "sample_ids")


@dataclass(frozen=True)
class RowSlice:
    """Rows ``start .. stop`` of one packed-row block: an ``ObjectRef`` of an Arrow table, or on a
    rank, once :class:`FeederClient` has fetched it, that block's :class:`BlockColumns`."""

    block: Any
    start: int
    stop: int


class BlockColumns:
    """A fetched block's list columns as numpy views (offsets, values), made once per block per rank.

    ``input_ids`` ``[[5, 9, 2], [7, 7]]`` -> offsets ``[0 3 5]``, values ``[5 9 2 7 7]``; rows 0..2 ->
    ``[array([5, 9, 2]), array([7, 7])]``, views of the object store's buffer (no copy of the tokens).
    """

    def __init__(self, table: Any) -> None:
        self.table = as_arrow(table)
        self._parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def rows(self, column: str, start: int, stop: int) -> list[np.ndarray]:
        if column not in self._parts:
            col = self.table.column(column)  # one chunk: zero-copy views (list_flat)
            self._parts[column] = list_flat(col)
        offsets, values = self._parts[column]
        o = offsets[start:stop + 1].tolist()
        return [values[x:y] for x, y in zip(o[:-1], o[1:], strict=True)]


@dataclass(frozen=True)
class RankItem:
    """What one rank gets for one item: where its rows are (``slices``, in order), not the rows."""

    index: int
    kind: str  # "step" | "epoch_end"
    epoch: int
    step: int  # global optimizer step this item is (step items) or follows (epoch_end)
    slices: tuple[RowSlice, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(s.stop - s.start for s in self.slices)

    def columns(self, names: tuple[str, ...] = ROW_COLUMNS) -> dict[str, list[np.ndarray]]:
        """This rank's rows: column -> one numpy view per row (zero-copy out of the object store)."""
        (item,), _ = fetch_blocks([self])
        slices = item.slices
        return {c: [row for s in slices for row in s.block.rows(c, s.start, s.stop)] for c in names}

    def sample_ids(self) -> list[list[int]]:
        """The sample ids of each row (tests and tools; training reads only the token columns)."""
        return [r.tolist() for r in self.columns(("sample_ids",))["sample_ids"]]


def fetch_blocks(items: list[RankItem], have: dict[Any, BlockColumns] | None = None
                 ) -> tuple[list[RankItem], dict[Any, BlockColumns]]:
    """``items`` with every block fetched: one ``ray.get`` for the distinct blocks not in ``have``
    (a block serves consecutive items, often several per response). Returns the items and the
    blocks they use, by reference."""
    have = have or {}
    refs = list(dict.fromkeys(s.block for it in items for s in it.slices if not isinstance(s.block, BlockColumns)))
    missing = [r for r in refs if r not in have]
    got = {r: have[r] for r in refs if r in have}
    if missing:
        got.update(zip(missing, map(BlockColumns, ray.get(missing)), strict=True))
    out = [replace(it, slices=tuple(s if isinstance(s.block, BlockColumns) else replace(s, block=got[s.block])
                                    for s in it.slices)) for it in items]
    return out, got


@dataclass
class Item:
    """One unit of work for all ranks: a step's row slices per rank, or the end of an epoch."""

    index: int
    kind: str  # "step" | "epoch_end"
    epoch: int
    step: int
    ranks: list[list[Picked]]
    state: dict[str, Any]  # DataState after this item
    fetched: set[int] = field(default_factory=set)

    def for_rank(self, rank: int) -> RankItem:
        return RankItem(self.index, self.kind, self.epoch, self.step,
                        tuple(RowSlice(p.chunk.block, p.chunk.offset + p.start, p.chunk.offset + p.stop)
                              for p in self.ranks[rank]))

    def ledger_entry(self) -> LedgerEntry:
        return LedgerEntry(self.epoch, self.step,
                           [[ids for p in picks for ids in p.chunk.sample_ids(p.start, p.stop)] for picks in self.ranks])


def split_ranks(picked: list[Picked], world: int, k: int) -> list[list[Picked]]:
    """Cut a step's runs of rows into ``world`` slices of ``k`` rows (the last ones shorter or empty).

    ``[A 0..3, B 0..2]``, 2 ranks x 3 rows -> rank 0 ``[A 0..3]``, rank 1 ``[B 0..2]``;
    ``[A 0..4, B 0..2]``, 2 x 3 -> ``[A 0..3]``, ``[A 3..4, B 0..2]``.
    """
    ranks: list[list[Picked]] = [[] for _ in range(world)]
    r, room = 0, k
    for p in picked:
        start = p.start
        while start < p.stop:
            n = min(room, p.stop - start)
            ranks[r].append(Picked(p.source, p.chunk, start, start + n))
            start, room = start + n, room - n
            if room == 0:
                r, room = r + 1, k
    return ranks


def as_arrow(block: Any) -> pa.Table:
    """A Ray Data block as an Arrow table (our packing stage writes Arrow: then as it is)."""
    if isinstance(block, pa.Table):
        return block
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_arrow()


@ray.remote(num_cpus=0)
def _chunk_where_it_lies(block: Any, start: int, stop: int) -> Chunk:
    """:meth:`Chunk.from_table`, run on the node that holds the block: only the small arrays travel."""
    return Chunk.from_table(as_arrow(block), None, start, stop)


def block_nodes(refs: list[Any]) -> dict[Any, list[str]]:
    """The ids of the nodes holding each block: the owner's own table first (no RPC), else the owner is
    asked. An empty list: the block is inlined (under 100 KB, it travels with its reference)."""
    from ray.experimental import get_local_object_locations, get_object_locations

    locs = get_local_object_locations(refs)
    if missing := [r for r in refs if not (locs.get(r) or {}).get("node_ids")]:
        locs.update(get_object_locations(missing))
    return {r: list((locs.get(r) or {}).get("node_ids") or []) for r in refs}


def _chunks_of(ds: ray.data.Dataset) -> Iterator[Chunk]:
    """The dataset's blocks in stream order, as chunks: references plus their small columns.

    A block in this node's object store (or inlined) is read in place, zero-copy. A block on another
    node is not pulled here: a 0-CPU task on that node reads its small columns and returns only those
    (a few KB per block), so the feeder's node (rank 0's) never receives the whole run's tokens. The
    tasks of a bundle's remote blocks are all submitted before the first is awaited.
    """
    here = ray.get_runtime_context().get_node_id()
    for bundle in ds.iter_internal_ref_bundles():
        nodes = block_nodes([entry.ref for entry in bundle.blocks])
        parts: list[tuple[Any, int, int | None, Any]] = []  # block, start, stop, pending task
        for entry, cut in zip(bundle.blocks, bundle.slices, strict=True):
            start, stop = (0, entry.metadata.num_rows) if cut is None else (cut.start_offset, cut.end_offset)
            if stop is not None and stop <= start:
                continue  # no rows: e.g. the block of a read task that yielded no unit, which has no columns
            where, task = nodes[entry.ref], None
            if where and here not in where and stop is not None and stop > start:
                far = NodeAffinitySchedulingStrategy(where[0], soft=True)
                task = _chunk_where_it_lies.options(scheduling_strategy=far).remote(entry.ref, start, stop)
            parts.append((entry.ref, start, stop, task))
        for ref, start, stop, task in parts:
            if task is not None:
                chunk = replace(ray.get(task), block=ref)
            else:
                table = as_arrow(ray.get(ref))
                if not table.num_rows:
                    continue
                chunk = Chunk.from_table(table, ref, start, table.num_rows if stop is None else stop)
            if len(chunk):
                yield chunk


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
        self._check_pools()

    def _check_pools(self) -> None:
        """Warn when the cluster cannot start one tokenizer pool per mixed source at once."""
        tokenized = [g for g in self.groups if not all_pretokenized(self.table, dataset_files(self.table, g))]
        if len(tokenized) < 2 or not ray.is_initialized():
            return
        short = tokenizer_pools_short(self.cfg.data.tokenize, len(tokenized), ray.cluster_resources())
        if short:
            logger.warning(
                "%d mixed sources stream side by side, one tokenizer pool each, but the cluster cannot start them "
                "all (%s): a pool that cannot start waits for another stream to end, and training can stall. Give "
                "the nodes more of what is short (an autoscaler may still add nodes), or lower "
                "data.tokenize.num_cpus or data.tokenize.resources.", len(tokenized), "; ".join(short))

    def open(self, i: int, state: SourceState) -> tuple[Iterator[Chunk], dict[int, int]]:
        """Chunks of source ``i`` from ``state.point``, and its files' read positions."""
        point = state.point
        ds = build_dataset(self.cfg, self.split, epoch=point.epoch, start=point, datasets=self.groups[i])
        self.datasets.append(ds)
        return _chunks_of(ds), file_positions(self.table, self.cfg.data.shuffle_seed, point.epoch, self.groups[i])


class Feeder:
    """Serves items to ranks; see the module docstring. Cheap: it moves references, not rows.

    Runs as the :data:`DataFeeder` actor. ``plan`` replaces the streams of ``data.datasets`` (the
    feeder benchmark serves rows it materialized before its clock).
    """

    def __init__(self, cfg_dict: dict, base_dir: str, world_size: int, rows_per_rank: int, epochs: int,
                 state: dict | None = None, ledger_root: str | None = None, prefetch_items: int = 16,
                 plan: StreamPlan | None = None) -> None:
        self.cfg = config_from_dict(cfg_dict, base_dir=base_dir)
        data_context = ray.data.DataContext.get_current()  # this process's streams
        data_context.enable_progress_bars = self.cfg.run.progress_bars
        data_context.print_on_execution_start = self.cfg.run.progress_bars  # Ray Data's two lines per epoch
        self.world, self.k, self.epochs = world_size, rows_per_rank, epochs
        self.plan = plan or StreamPlan(self.cfg, "train")
        restored = DataState.from_dict(state)
        self.state = restored or DataState(0, 0, fresh_states(len(self.plan.groups), 0))
        self.ledger = None
        if ledger_root:
            fs, path = filesystem_for(ledger_root, StorageOptions.from_config(self.cfg.storage))
            self.ledger = Ledger(fs, path)
            self.ledger.truncate_after(self.state.step)  # steps undone by this restore
        self.max_items = prefetch_items
        self._items: dict[int, Item] = {}  # items some rank has not fetched yet
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
        """Produce one epoch's step items and its epoch-end item; returns the next index and step.

        Each step's state is taken before looking ahead; when the look-ahead finds the epoch over,
        the step's state is the epoch-end state (``epoch_done``), so a checkpoint there resumes in
        the next epoch.
        """
        mixer = self._mixer(epoch, states)
        while picked := mixer.take(self.world * self.k):
            step += 1
            state = DataState(epoch, step, states).to_dict()
            if not mixer.ready():  # that was the epoch's last step
                state = DataState(epoch, step, states, epoch_done=True).to_dict()
            self._put(Item(index, "step", epoch, step, split_ranks(picked, self.world, self.k), state))
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
            while len(self._items) >= self.max_items:
                self._cond.wait(timeout=1.0)
            self._items[item.index] = item
            self._states[item.index] = item.state
            self._cond.notify_all()

    # ---- served to ranks
    def get(self, index: int, rank: int, most: int = 1, least: int = 1) -> list[RankItem]:
        """Items ``index, index + 1, ...`` for ``rank``: blocks until items ``index`` to
        ``index + least - 1`` are produced (fewer when the stream ends after ``index``), then also
        takes the items after them that are already produced, ``most`` in all: one call, not ``most``
        (the feeder's cost is per call). ``[]`` when the training data is over.

        ``least`` is capped at the feeder's prefetch window, which the items of the slowest rank
        always fit, so a rank waiting for a full batch never waits on itself.
        """
        least = max(1, min(least, most, self.max_items))
        with self._cond:
            while not all(i in self._items for i in range(index, index + least)):
                if index in self._items and (self._finished or self._error is not None):
                    break  # the stream ended after some of them: serve those
                if index in self._served:
                    raise KeyError(f"item {index} was already served to every rank")
                if self._error is not None:
                    raise RuntimeError(f"data feeder failed: {self._error!r}") from self._error
                if self._finished:
                    return []
                self._cond.wait(timeout=1.0)
            out: list[RankItem] = []
            while index in self._items and len(out) < most:
                out.append(self._fetched(self._items[index], rank))
                index += 1
            return out

    def _fetched(self, item: Item, rank: int) -> RankItem:
        """``rank`` takes ``item`` (under the lock); once every rank has, its block references go."""
        item.fetched.add(rank)
        if len(item.fetched) == self.world:
            del self._items[item.index]
            self._served.add(item.index)
            if item.kind == "step":
                self._pending.append(item.ledger_entry())
            self._cond.notify_all()
        return item.for_rank(rank)

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


def feeder_concurrency(world_size: int) -> int:
    """Threads the feeder actor needs: each rank keeps one (blocking) request in flight, plus commits
    and reports. Fewer would let requests for later items hold every thread while a slow rank's
    request for the item they wait on queues behind them."""
    return 2 * world_size + 8


# Threaded by default (blocking gets need it); start_feeder sizes the threads to the world.
DataFeeder = ray.remote(num_cpus=0, max_concurrency=feeder_concurrency(28))(Feeder)


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
        items. Waiting for one (the old rule) let a rank that keeps pace with the feeder get one item
        per call, as each was produced: at 64 ranks, 64 calls per step, the main cost of the feeder
        and of each rank (benchmarks/feeder_scale.py). Doubling from one keeps the first steps as
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


def start_feeder(cfg: Config, world_size: int, rows_per_rank: int, state: dict | None,
                 ledger_root: str | None, epochs: int | None = None) -> Any:
    """Create the feeder actor on this node (rank 0 does this; it dies with rank 0's worker group).

    It is pinned to the caller's node: left to Ray's default scheduling (or a soft affinity, which
    falls back under load), the 0-CPU actor lands on any node, e.g. the head or a CPU-only tokenizer
    node, and losing that node would then also end the training stream. On rank 0's node it adds no
    failure domain of its own (tests/test_node_loss.py).
    """
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return DataFeeder.options(scheduling_strategy=here, max_concurrency=feeder_concurrency(world_size)).remote(
        dump_config(cfg), cfg.base_dir, world_size, rows_per_rank,
        cfg.train.epochs if epochs is None else epochs, state, ledger_root)
