"""The feeder: one deterministic, resumable stream of packed rows, served to every training rank.

Ray Data's ``streaming_split`` hands blocks to whichever rank asks first, so which rank trains on
which row changes run to run, and "rows seen per rank" cannot be turned back into a position. Here
one small ``DataFeeder`` actor (created by rank 0 of each worker group on its node, dying with it) opens
the per-source datasets of a :class:`~pipelines.stream.spec.StreamSpec` (:func:`pipelines.stream.dataset.source_dataset`)
in order, mixes them (:mod:`pipelines.stream.mixing`) and cuts the result into *items*:

* a step item: the rows of one global optimizer step, ``step_rows`` of them whatever the world size,
  rank ``r`` taking the ``r``-th slice (:func:`~pipelines.stream.batch.rank_rows`; fewer, or none, at the end of an epoch), plus
  the :class:`~pipelines.stream.state.DataState` right after it;
* an epoch-end item, after the last step of an epoch.

The feeder is a control plane: the packed rows stay in Ray's object store as the Arrow blocks the
packing stage wrote, and ranks fetch their slices themselves (:mod:`pipelines.stream.blocks`,
:mod:`pipelines.stream.client`). The global row order does not depend on the world size, so a run
checkpointed with 2 workers resumes with 1 (or 1 with 2) at the same row. The feeder prefetches in a
thread, up to 16 items ahead of the slowest rank.

A pre-tokenized source (every file an MDS shard of token ids, :func:`~pipelines.stream.stages.all_pretokenized`)
is read differently: nothing is left to tokenize, so the feeder reads, checks and packs it in its own process
(:func:`~pipelines.stream.stages.iter_packed_local`, the same rows) and puts each packed block in its node's
object store (:func:`~pipelines.stream.blocks.chunks_put`). No read task waits for a worker process before the
first step, and the feeder's process does not import Ray Data (~0.65 s of its start). Checking and packing ids
is one pass over them, tens of millions of tokens per CPU second, far more than the GPUs of a cluster train
on; the price is that the feeder's node reads every pre-tokenized byte, which the tokenizing stages never send
it.

The feeder owns the data position, as a stateful loader does: ``load_state_dict`` (before the first
item) starts it from a saved position, ``resume`` does so under ``run.on_data_change``
(:mod:`pipelines.stream.resume`), ``commit(item)`` writes the ledger of the steps up to that item and
returns ``state_dict()``, the position after it, which the checkpoint stores as it is. The state after
an epoch's last step already says the epoch is done (the feeder looks one row ahead), so a checkpoint
taken there resumes in the next epoch, not in an empty rest of this one.

A dataset given to the trainer (``build_trainer(cfg, train_dataset=ds)``) is served the same way, as the one
source of the mix: its rows in its order, its position the rows taken (:meth:`Chunk.from_table`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipelines.config import Config
from pipelines.stats import StatsSink
from pipelines.storage import StorageOptions, filesystem_for
from pipelines.stream.batch import rank_rows
from pipelines.stream.blocks import ROW_COLUMNS, RankItem, RowSlice, as_list_columns, chunks_of, chunks_put
from pipelines.stream.ledger import Ledger, LedgerEntry
from pipelines.stream.mixing import Chunk, Mixer, Picked
from pipelines.stream.placement import tokenizer_pools_short
from pipelines.stream.resume import OnChange, Resumed, fresh_state, resume_state
from pipelines.stream.spec import StreamSpec, build_spec
from pipelines.stream.stages import all_pretokenized, iter_packed_local
from pipelines.stream.state import DataState, SourceState

__all__ = ["DataFeeder", "Feeder", "feeder_concurrency", "start_feeder"]

logger = logging.getLogger(__name__)


@dataclass
class Item:
    """One unit of work for all ranks: a step's row slices per rank, or the end of an epoch."""

    index: int
    kind: str  # "step" | "epoch_end"
    epoch: int
    step: int
    ranks: list[list[Picked]]
    state: DataState  # the position after this item
    fetched: set[int] = field(default_factory=set)

    def for_rank(self, rank: int) -> RankItem:
        return RankItem(self.index, self.kind, self.epoch, self.step,
                        tuple(RowSlice(p.chunk.block, p.chunk.offset + p.start, p.chunk.offset + p.stop)
                              for p in self.ranks[rank]))

    def ledger_entry(self) -> LedgerEntry:
        return LedgerEntry(self.epoch, self.step,
                           [[ids for p in picks for ids in p.chunk.sample_ids(p.start, p.stop)] for picks in self.ranks])


def split_ranks(picked: list[Picked], world: int, step_rows: int) -> list[list[Picked]]:
    """Cut a step's runs of rows into ``world`` slices of :func:`~pipelines.stream.batch.rank_rows` rows each, in order (at the end
    of an epoch the last ones are shorter or empty).

    ``[A 0..3, B 0..3]``, 6 rows over 2 ranks -> rank 0 ``[A 0..3]``, rank 1 ``[B 0..3]``;
    ``[A 0..4, B 0..2]``, 6 over 2 -> ``[A 0..3]``, ``[A 3..4, B 0..2]``; 5 over 2 -> 3 and 2 rows.
    """
    sizes = rank_rows(step_rows, world)
    ranks: list[list[Picked]] = [[] for _ in range(world)]
    r, room = 0, sizes[0]
    for p in picked:
        start = p.start
        while start < p.stop:
            while room == 0:  # a rank with no rows this step (fewer rows than ranks)
                r += 1
                room = sizes[r]
            n = min(room, p.stop - start)
            ranks[r].append(Picked(p.source, p.chunk, start, start + n))
            start, room = start + n, room - n
    return ranks


def warn_if_pools_short(spec: StreamSpec, cluster: dict[str, float]) -> None:
    """Warn when ``cluster`` cannot start one tokenizer pool per mixed source at once."""
    tokenized = [i for i in range(len(spec.sources)) if not all_pretokenized(spec.table, spec.source_files(i))]
    if len(tokenized) < 2:
        return
    short = tokenizer_pools_short(spec.placement.tokenize, len(tokenized), cluster)
    if short:
        logger.warning(
            "%d mixed sources stream side by side, one tokenizer pool each, but the cluster cannot start them "
            "all (%s): a pool that cannot start waits for another stream to end, and training can stall. Give "
            "the nodes more of what is short (an autoscaler may still add nodes), or lower "
            "data.tokenize.num_cpus or data.tokenize.resources.", len(tokenized), "; ".join(short))


class Feeder:
    """Serves items to ranks; see the module docstring. Cheap: it moves references, not rows.

    Runs as the :data:`DataFeeder` actor. ``given``: a dataset handed to the trainer, served as the one
    source of ``spec`` (whose files it then does not read).
    """

    def __init__(self, spec: StreamSpec, world_size: int, step_rows: int, epochs: int,
                 ledger_root: str | None = None, storage: StorageOptions | None = None,
                 progress_bars: bool = False, prefetch_items: int = 16, given: ray.data.Dataset | None = None) -> None:
        self.spec, self.given, self.progress_bars = spec, given, progress_bars
        self.world, self.step_rows, self.epochs = world_size, step_rows, epochs
        self.state = fresh_state(spec)
        self.ledger = Ledger(*filesystem_for(ledger_root, storage or StorageOptions())) if ledger_root else None
        self.sinks: list[StatsSink] = []  # the counters of every stream opened (for report)
        # sources read here, not by read tasks (the module docstring)
        self.read_here = [given is None and all_pretokenized(spec.table, spec.source_files(i))
                          for i in range(len(spec.sources))]
        self.max_items = prefetch_items
        self._items: dict[int, Item] = {}  # items some rank has not fetched yet
        self._served: set[int] = set()  # items every rank has fetched
        self._states: dict[int, DataState] = {}  # state after each item, until committed
        self._committed = self.state  # the state after the last committed item
        self._pending: list[LedgerEntry] = []  # steps fetched but not yet in the ledger
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._finished = False
        self._thread: threading.Thread | None = None
        if given is None and ray.is_initialized():
            warn_if_pools_short(spec, ray.cluster_resources())

    # ---- the position
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Start from ``state`` (a ``state_dict()``; ``None``: the beginning), which must be of this stream
        (else :class:`~pipelines.stream.resume.DataChangeError`). Steps after it leave the ledger."""
        resumed = resume_state(state, DataState.from_dict(state).step if state else 0, 0, self.spec, "fail",
                               "the given data state")
        self._load(resumed.state)

    def resume(self, saved: dict[str, Any] | None, step: int, epoch: int, on_change: OnChange,
               where: str) -> Resumed:
        """Start from a checkpoint's data state ``saved`` (taken at ``step`` in ``epoch``), as
        ``run.on_data_change`` (``on_change``) allows; a restart or change is recorded in the ledger. The
        position is then final: the stream starts reading now, before the first ``get``."""
        resumed = resume_state(saved, step, epoch, self.spec, on_change, where)
        if self.ledger is not None and resumed.kind == "restart":
            self.ledger.mark_restart(step, resumed.changes[0])
        elif self.ledger is not None and resumed.kind == "continue":
            self.ledger.mark_change(step, list(resumed.changes), [f.url for f in self.spec.table.files])
        self._load(resumed.state)
        with self._cond:
            self._start()
        return resumed

    def _load(self, state: DataState | None) -> None:
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the feeder's position is set before its first item, not after")
            self.state = self._committed = state or fresh_state(self.spec)
            if not self.state.fingerprint:
                self.state.fingerprint = dict(self.spec.fingerprint)
            if len(self.state.sources) == len(self.spec.sources):  # a version 2 state: name its sources
                for s, src in zip(self.state.sources, self.spec.sources, strict=True):
                    s.key, s.identity = s.key or src.key, s.identity or src.identity
        if self.ledger is not None:
            self.ledger.truncate_after(self.state.step)  # steps undone by this restore

    def state_dict(self) -> dict[str, Any]:
        """The position after the last committed item (``load_state_dict``'s before any commit)."""
        with self._cond:
            return self._committed.to_dict()

    def commit(self, index: int) -> dict[str, Any]:
        """Commit item ``index``: the ledger gets the steps up to it; returns the position after it (to checkpoint)."""
        with self._cond:
            state = self._states.get(index)
            if state is None:
                raise KeyError(f"item {index} was already committed or never produced")
            for k in [k for k in self._states if k < index]:
                del self._states[k]
            self._committed = state
            done = [e for e in self._pending if e.step <= state.step]
            self._pending = [e for e in self._pending if e.step > state.step]
        if self.ledger and done:
            self.ledger.write(done)
        return state.to_dict()

    # ---- producer
    def _open(self, i: int, state: SourceState) -> tuple[Iterator[Chunk], dict[int, int]]:
        """Chunks of source ``i`` from ``state.point``, and its files' read positions."""
        point = state.point
        if self.given is not None:
            self._ray_data_context()
            return _rows_from(chunks_of(_with_list_columns(self.given)), point.row), {0: 0}
        positions = self.spec.file_positions(point.epoch, i)
        if self.read_here[i]:
            sink = StatsSink()  # the stages run in this process: counted here, no stats actor to start
            self.sinks.append(sink)
            return chunks_put(iter_packed_local(self.spec, sink=sink, source=i, epoch=point.epoch, start=point)), positions
        # Ray Data loads where a source is tokenized: a feeder of pre-tokenized sources starts without it
        from pipelines.stream.dataset import source_dataset, stats_of

        self._ray_data_context()
        ds = source_dataset(self.spec, i, epoch=point.epoch, start=point)
        self.sinks.append(stats_of(ds))
        return chunks_of(ds), positions

    def _ray_data_context(self) -> None:
        """``run.progress_bars`` for the Ray Data streams this process runs (a given dataset's too)."""
        data_context = ray.data.DataContext.get_current()
        data_context.enable_progress_bars = self.progress_bars
        data_context.print_on_execution_start = self.progress_bars  # Ray Data's two lines per epoch

    def _mixer(self, epoch: int, states: list[SourceState]) -> Mixer:
        return Mixer([s.weight for s in self.spec.sources], self.spec.mix_by, self.spec.data.mix_exhausted,
                     epoch, states, self._open)

    def _at(self, epoch: int, step: int, states: list[SourceState], done: bool = False) -> DataState:
        return DataState(epoch, step, [SourceState(**vars(s)) for s in states], done, self.state.fingerprint)

    def _epoch_items(self, index: int, epoch: int, step: int, states: list[SourceState]) -> tuple[int, int]:
        """Produce one epoch's step items and its epoch-end item; returns the next index and step.

        Each step's state is taken before looking ahead; when the look-ahead finds the epoch over,
        the step's state is the epoch-end state (``epoch_done``), so a checkpoint there resumes in
        the next epoch.
        """
        mixer = self._mixer(epoch, states)
        while picked := mixer.take(self.step_rows):
            step += 1
            state = self._at(epoch, step, states)
            if not mixer.ready():  # that was the epoch's last step
                state = self._at(epoch, step, states, done=True)
            self._put(Item(index, "step", epoch, step, split_ranks(picked, self.world, self.step_rows), state))
            index += 1
        end = self._at(epoch, step, states, done=True)
        self._put(Item(index, "epoch_end", epoch, step, [[] for _ in range(self.world)], end))
        return index + 1, step

    def _produce(self) -> None:
        try:
            st = self.state
            epoch, step, index = st.next_epoch, st.step, 0
            # copies: the mixer advances them in place, and the loaded state is what state_dict() holds until a commit
            states = [SourceState(**vars(s)) for s in st.sources] if not st.epoch_done else fresh_state(self.spec, epoch).sources
            while epoch < self.epochs:
                index, step = self._epoch_items(index, epoch, step, states)
                epoch += 1
                states = fresh_state(self.spec, epoch).sources
        except BaseException as err:  # surfaced to every rank by get()
            logger.exception("data feeder failed")
            with self._cond:
                self._error = err
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _start(self) -> None:
        """Start producing (under the lock), once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, daemon=True)
            self._thread.start()

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
        (the feeder's cost is per call). ``[]`` when the training data is over. The first call starts
        the stream, unless :meth:`resume` did.

        ``least`` is capped at the feeder's prefetch window, which the items of the slowest rank
        always fit, so a rank waiting for a full batch never waits on itself.
        """
        least = max(1, min(least, most, self.max_items))
        with self._cond:
            self._start()
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

    def telemetry(self, index: int) -> dict[str, Any]:
        """What the trainer logs beside its losses, as of item ``index`` (the last one rank 0 took):
        ``mix_share``, each source's share of what the epoch took so far, counted in ``data.mix_by`` units
        (tokens or samples; since the resume step after a mix change), and the data-quality counters so far.
        Example: ``{"mix_share": {"alpaca": 0.61, "lima": 0.39}, "data_quality": {"records_read": 5120, ...}}``.
        """
        with self._cond:
            state = self._states.get(index, self._committed)
        unit = "samples" if self.spec.mix_by == "samples" else "tokens"
        taken = {s.key or str(i): getattr(s, unit) for i, s in enumerate(state.sources)}
        total = sum(taken.values())
        return {"mix_share": {k: v / total for k, v in taken.items()} if total else {},
                "data_quality": self.report()["counters"]}

    def report(self) -> dict:
        """Data-quality counters summed over every stream this feeder opened (none for a given dataset)."""
        totals: dict[str, Any] = {"counters": {}, "examples": {}}
        for sink in self.sinks:
            snap = sink.snapshot()
            for k, v in snap["counters"].items():
                totals["counters"][k] = totals["counters"].get(k, 0) + v
            for k, v in snap["examples"].items():
                have = totals["examples"].setdefault(k, [])
                have.extend(v[: max(0, 5 - len(have))])
        return totals


def _with_list_columns(ds: ray.data.Dataset) -> ray.data.Dataset:
    """``ds`` as is when its schema is known and its row columns are lists (a materialized or ``build_dataset``
    stream), else through :func:`~pipelines.stream.blocks.as_list_columns` (one more map stage)."""
    schema = ds.schema(fetch_if_missing=False)
    names = dict(zip(schema.names, schema.types, strict=True)) if schema is not None else None
    if names is not None and all(pa.types.is_list(names[c]) for c in ROW_COLUMNS if c in names):
        return ds
    return ds.map_batches(as_list_columns, batch_size=None, batch_format="pyarrow")


def _rows_from(chunks: Iterator[Chunk], first: int) -> Iterator[Chunk]:
    """``chunks`` without the stream's first ``first`` rows (a given dataset resumed ``first`` rows in)."""
    seen = 0
    for chunk in chunks:
        if seen + len(chunk) > first:
            yield chunk.tail(max(0, first - seen))
        seen += len(chunk)


def feeder_concurrency(world_size: int) -> int:
    """Threads the feeder actor needs: each rank keeps one (blocking) request in flight, plus commits
    and reports. Fewer would let requests for later items hold every thread while a slow rank's
    request for the item they wait on queues behind them."""
    return 2 * world_size + 8


# Threaded by default (blocking gets need it); start_feeder sizes the threads to the world.
DataFeeder = ray.remote(num_cpus=0, max_concurrency=feeder_concurrency(28))(Feeder)


def start_feeder(spec: StreamSpec | Config, world_size: int, step_rows: int, state: dict | None = None,
                 ledger_root: str | None = None, epochs: int | None = None, *, storage: StorageOptions | None = None,
                 progress_bars: bool = False, given: ray.data.Dataset | None = None) -> Any:
    """Create the feeder actor on this node (rank 0 does this; it dies with rank 0's worker group), from
    ``state`` (a ``state_dict()``; see :meth:`Feeder.load_state_dict`) when given. ``spec`` may be a config:
    its training spec is built here (and ``epochs``, ``storage``, ``progress_bars`` default to its own).

    It is pinned to the caller's node: left to Ray's default scheduling (or a soft affinity, which
    falls back under load), the 0-CPU actor lands on any node, e.g. the head or a CPU-only tokenizer
    node, and losing that node would then also end the training stream. On rank 0's node it adds no
    failure domain of its own (tests/test_node_loss.py).
    """
    if isinstance(spec, Config):
        cfg = spec
        spec = build_spec(cfg, "train")
        epochs = cfg.train.epochs if epochs is None else epochs
        storage = storage or StorageOptions.from_config(cfg.storage)
        progress_bars = progress_bars or cfg.run.progress_bars
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    feeder = DataFeeder.options(scheduling_strategy=here, max_concurrency=feeder_concurrency(world_size)).remote(
        spec, world_size, step_rows, 1 if epochs is None else epochs, ledger_root, storage, progress_bars,
        given=given)
    if state is not None:
        ray.get(feeder.load_state_dict.remote(state))
    return feeder

