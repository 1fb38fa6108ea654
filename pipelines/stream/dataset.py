"""``build_dataset``: the stages of one stream wired into a lazy, streaming ``ray.data.Dataset`` of packed rows.

    read tasks (whole files, seeded order)   ->  tokenizer (CPU): tokenize, then pack
    one block per unit, one row per unit:        each unit -> input_ids, labels, position_ids,
    sample_ids, records (lists)                  sample_ids (+ unit_* columns), one row per packed row

Everything comes from a :class:`~pipelines.stream.spec.StreamSpec`: the files, the options and the
placement (:mod:`pipelines.stream.placement`). The tokenizer runs in a pool of actors, or inside the read
tasks (:func:`read_task_stage`: no actor to start, a unit's records never cross the object store, and the
tokenizer keeps encoding from one unit to the next). A set that is all token ids (pre-tokenized MDS)
always takes the second way: its read blocks hold the ids as Arrow list columns, and their check
(:class:`pipelines.tokenize.pretokenized.IdChecker`) and packing run inside the read tasks.

A *unit* is ``pack_buffer_size`` consecutive records of one file (see :mod:`pipelines.stream.units`); it
is packed on its own, so the rows are a function of the data and the config, and a resume point is
"file, unit, rows done". A unit is one row until it is packed, so Ray Data can hand each unit on as
soon as it is read (``READ_BLOCK_BYTES``) without ever cutting one; packing runs right after
tokenizing, in the same process, so a unit's tokens never travel between processes unpacked.

Nothing is read until the dataset is iterated: building it starts one tiny counters actor. Memory is
bounded by Ray Data's streaming backpressure and the buffer sizes (``data.tokenize.batch_size``,
``data.pack_buffer_size``), not by the size of the data. Why each default is what it is, with the
measurements: docs/design.md, "Placement".
"""

from __future__ import annotations

import logging
import math
import os
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from pipelines.config import Config, DataConfig, ModelConfig
from pipelines.sources.datasource import ReadOptions, ShardDatasource, read_files
from pipelines.sources.listing import SourceTable
from pipelines.stats import StatsSink, stats_sink
from pipelines.stream.packing import PACKED_SCHEMA, Packer, PackOptions
from pipelines.stream.placement import Placement
from pipelines.stream.spec import StreamSpec, build_spec
from pipelines.stream.units import READ_BLOCK_BYTES, ResumePoint
from pipelines.tokenize.pretokenized import IdChecker, tokenizer_vocab_size
from pipelines.tokenize.stage import Tokenizer, imports_transformers, rust_thread_env

log = logging.getLogger(__name__)

__all__ = ["ResumePoint", "all_pretokenized", "build_dataset", "data_report", "iter_packed_local", "source_dataset", "stats_of"]

# A pre-tokenized stream gets a read task per this many bytes of shard data (uncompressed), and no more
# than run at once (one per CPU). Each task beside the first waits for a worker process of its own, and a
# cold cluster's start outlasts a small stream's share (docs/design.md, "Placement").
ID_BYTES_PER_READ_TASK = 128 << 20

# The counters of each dataset this module built (data_report), by dataset; an entry goes with its dataset.
_SINKS: weakref.WeakKeyDictionary[ray.data.Dataset, StatsSink] = weakref.WeakKeyDictionary()


def id_read_tasks(table: SourceTable, files: list[int]) -> int:
    """Read tasks worth starting for a pre-tokenized stream over ``files``: one per
    :data:`ID_BYTES_PER_READ_TASK` of their shards' uncompressed data, at least one.

    Example: 13 shards of 4.2 MB (12.8 M tokens) -> 1; 300 MB of shards -> 3 (``build_dataset`` then caps
    it at one per CPU).
    """
    from pipelines.mds.index import shard_raw_bytes  # MDS modules load where MDS is read

    raw = sum(shard_raw_bytes(table.files[i].meta) for i in files)
    return max(1, math.ceil(raw / ID_BYTES_PER_READ_TASK))


def tokenizer_env(threads: int) -> dict[str, str]:
    """Environment of the tokenizer actors: bounded Rust threads (:func:`pipelines.tokenize.stage.rust_thread_env`),
    and transformers without torch (``USE_TORCH=0``: importing torch costs seconds and ~1 GB per actor, and
    tokenizing never needs it).

    The actors set it in their constructor (``Tokenizer(env=...)``), before anything loads, rather than
    through a ``runtime_env``: an actor with an environment of its own needs a new worker process, started
    through Ray's runtime-env agent, while one without can take an idle worker that is already up. For the
    read tasks see :func:`read_task_stage`.
    """
    return {**rust_thread_env(threads), "USE_TORCH": "0"}


def _read_options(spec: StreamSpec, order: list[int]) -> ReadOptions:
    """How an epoch's stream over ``order`` (indices into ``spec.table.files``, in read order) is read.

    Decided from the whole epoch, never from where a resumed run starts: id-column blocks measure a
    unit's size in id bytes, JSON blocks in record text, so a resumed stream must read as the first did.
    """
    d, table = spec.data, spec.table
    return ReadOptions(
        storage=table.storage,
        on_bad_record=d.on_bad_record,
        text_fields=tuple(ds.text_field for ds in table.datasets),
        eval_fraction=d.eval_fraction if not d.eval_datasets else 0.0,
        split=spec.split,
        unit_size=spec.unit_size,
        first_unit_source=order[0] if order else -1,
        token_ids=all_pretokenized(table, order),
    )


def _pack_options(data: DataConfig, epoch: int) -> PackOptions:
    return PackOptions(data.packing, data.sequence_len, data.oversize, data.shuffle_seed, epoch)


class TokenizeAndPack:
    """The tokenizer actors' callable in :func:`build_dataset`: blocks of whole units -> packed rows."""

    def __init__(self, data: DataConfig, model: ModelConfig, table: SourceTable, sink: StatsSink, threads: int,
                 pack: PackOptions, env: Mapping[str, str] | None = None) -> None:
        self.tokenizer = Tokenizer(data, model, table, sink, threads, env)
        self.packer = Packer(pack, sink, table)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.packer(self.tokenizer(batch))

    def stream(self, blocks: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """``map(self, blocks)``, each block packed while the next one encodes (:meth:`Tokenizer.stream`)."""
        return map(self.packer, self.tokenizer.stream(blocks))


# The columns of a tokenized set as ``ray_jobs/convert.py --tokenize`` writes it (:class:`TokenizeToStore`).
STORED_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
                           ("source_sample_id", pa.int64())])


def stored_columns(batch: pa.Table) -> pa.Table:
    """Tokenizer output -> the columns a tokenized set stores (:data:`STORED_SCHEMA`); the records the
    tokenizer skipped (empty rows, counted by it) are left out."""
    batch = batch.filter(pc.greater(pc.list_value_length(batch.column("input_ids")), 0))
    return pa.Table.from_arrays([batch.column("input_ids"), batch.column("labels"), batch.column("sample_id")],
                                schema=STORED_SCHEMA)


class TokenizeToStore:
    """``ray_jobs/convert.py --tokenize``'s stage: blocks of whole units -> :func:`stored_columns` of their
    tokenized records, not packed (a training run packs them for its own ``sequence_len``)."""

    def __init__(self, data: DataConfig, model: ModelConfig, table: SourceTable, sink: StatsSink, threads: int,
                 env: Mapping[str, str] | None = None) -> None:
        self.tokenizer = Tokenizer(data, model, table, sink, threads, env)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return stored_columns(self.tokenizer(batch))

    def stream(self, blocks: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """``map(self, blocks)``, each block's columns cut while the next one encodes (:meth:`Tokenizer.stream`)."""
        return map(stored_columns, self.tokenizer.stream(blocks))


class CheckAndPack:
    """The pre-tokenized stage: id-column blocks of whole units -> packed rows (no tokenizer runs)."""

    def __init__(self, data: DataConfig, model: ModelConfig, table: SourceTable, sink: StatsSink,
                 pack: PackOptions, vocab_size: int) -> None:
        self.checker = IdChecker(data, model, table, sink, vocab_size)
        self.packer = Packer(pack, sink, table)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.packer(self.checker(batch))

    def stream(self, blocks: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """``map(self, blocks)``."""
        return map(self, blocks)


# The stages running inside a read worker (CheckAndPack, TokenizeAndPack), one per dataset built: Ray reuses
# read workers, and a mixed run's per-source datasets share them; the oldest go past _IN_WORKER_KEEP.
_IN_WORKER: OrderedDict[str, CheckAndPack | TokenizeAndPack] = OrderedDict()
_IN_WORKER_KEEP = 8


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (its kwargs are a dict)
class InReadTask:
    """A stage run inside the read tasks, on the stream of unit blocks each task reads
    (``ShardDatasource(stage=...)``): no actor to start, and a unit's records never leave the task.

    It is built once per worker process and ``key`` (one key per dataset built), and it sees the task's
    blocks as one stream, so the tokenizer keeps encoding across units (:meth:`Tokenizer.stream`).
    Small to pickle: configs and the file table; the tokenizer loads in the worker.

    ``env`` is the stage's environment. ``isolated``: the read tasks get it as their ``runtime_env``
    (:func:`read_task_args`), so they run in workers of their own. Otherwise it is set in the worker's process
    for each stream and restored when the stream ends, so the worker Ray hands on afterwards has the
    environment it had (see :func:`read_task_stage`).
    """

    key: str
    stage: type[CheckAndPack | TokenizeAndPack | TokenizeToStore]
    kwargs: dict[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)
    isolated: bool = False

    def __call__(self, blocks: Iterator[pa.Table]) -> Iterator[pa.Table]:
        local = {} if self.isolated else dict(self.env)
        saved = {k: os.environ.get(k) for k in local}
        os.environ.update(local)
        try:
            stage = _IN_WORKER.get(self.key)
            if stage is None:
                stage = _IN_WORKER[self.key] = self.stage(**self.kwargs)
                while len(_IN_WORKER) > _IN_WORKER_KEEP:
                    _IN_WORKER.popitem(last=False)
            _IN_WORKER.move_to_end(self.key)
            yield from stage.stream(blocks)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def read_task_args(place: Placement, stage: InReadTask | None) -> dict[str, Any]:
    """Ray remote arguments of :func:`build_dataset`'s read tasks, given their :func:`read_task_stage`. Where
    the tokenizer runs in them they reserve what a tokenizer actor would, and an ``isolated`` stage's
    environment is their ``runtime_env``."""
    if stage is None or stage.stage is CheckAndPack:
        return {"num_cpus": place.read_num_cpus}
    tok = place.tokenize
    args: dict[str, Any] = {"num_cpus": tok.num_cpus}
    if tok.resources:  # not ``None`` where there are none: Ray Data's fusion check reads it as a dict
        args["resources"] = dict(tok.resources)
    if stage.isolated:
        args["runtime_env"] = {"env_vars": dict(stage.env)}
    return args


def all_pretokenized(table: SourceTable, files: list[int]) -> bool:
    """Whether every file in ``files`` is an MDS shard with a token id column (``input_ids`` or ``tokens``).

    Such a stream is read as id columns (``ReadOptions.token_ids``); its samples only need their ids
    checked and packed (no tokenizer runs), so that stage runs inside the read tasks: no actor to
    start, and the ids never leave the task that read them.
    """
    from pipelines.mds.index import shard_holds_token_ids

    def has_ids(i: int) -> bool:
        f = table.files[i]
        return f.format == "mds" and bool(f.meta) and shard_holds_token_ids(f.meta)

    return bool(files) and all(has_ids(i) for i in files)


def read_task_stage(spec: StreamSpec, sink: StatsSink, pack: PackOptions, token_ids: bool) -> InReadTask | None:
    """The packing stage to run inside :func:`build_dataset`'s read tasks, or None where it runs in a tokenizer
    actor pool (:func:`tokenizer_stage`; ``spec.placement.where``).

    Id-column blocks (``token_ids``, see :func:`all_pretokenized`) are always checked and packed in the read
    tasks (:class:`CheckAndPack`); ``data.tokenize`` then places nothing. The read tasks take
    :func:`read_task_args`: where the tokenizer runs in them, what an actor of the pool would reserve.

    The tokenizer's environment, where it runs in the read tasks:

    - It loads the transformers tokenizer (:func:`pipelines.tokenize.stage.imports_transformers`):
      :func:`tokenizer_env`, as the tasks' ``runtime_env`` (``isolated``). ``USE_TORCH=0`` must be set before
      transformers is imported and holds for the process from then on, so the tasks take workers of their
      own: a shared worker with it could later become a train worker that cannot see torch.
    - It loads ``tokenizers`` alone (Alpaca or completion text with a plain tokenizer.json): only the Rust
      threads (:func:`pipelines.tokenize.stage.rust_thread_env`), set in the shared worker's process for each
      stream and restored after it. Ray can then hand the tasks idle workers that are already up, rather
      than start workers through its runtime-env agent. The Rust thread pool is the process's: it is built,
      with that size, at the first parallel encode and stays. (A tokenizer whose EOS token proves missing
      from its vocabulary when loaded still falls back to transformers there, with torch visible: slower to
      start, same tokens.)
    """
    kwargs: dict[str, Any] = {"data": spec.data, "model": spec.model, "table": spec.table, "sink": sink,
                              "pack": pack}
    if token_ids:
        log.info("every source is pre-tokenized MDS: ids are checked and packed in the read tasks "
                 "(no tokenizer actors; data.tokenize is not used)")
        return InReadTask(uuid.uuid4().hex, CheckAndPack, {**kwargs, "vocab_size": tokenizer_vocab_size(spec.model)})
    if spec.placement.where != "read_tasks":
        return None
    return tokenizer_in_read_tasks(TokenizeAndPack, kwargs, spec.placement.threads)


def tokenizer_in_read_tasks(stage: type[TokenizeAndPack | TokenizeToStore], kwargs: dict[str, Any],
                            threads: int) -> InReadTask:
    """A tokenizer ``stage`` to run in the read tasks, ``threads`` Rust threads each, with the environment
    :func:`read_task_stage` explains (``kwargs`` hold the stage's ``model`` and ``table``)."""
    kwargs = {**kwargs, "threads": threads}
    if imports_transformers(kwargs["model"], kwargs["table"]):
        return InReadTask(uuid.uuid4().hex, stage, kwargs, tokenizer_env(threads), isolated=True)
    return InReadTask(uuid.uuid4().hex, stage, kwargs, rust_thread_env(threads))


def tokenizer_stage(ds: ray.data.Dataset, spec: StreamSpec, sink: StatsSink,
                    pack: PackOptions | None = None) -> ray.data.Dataset:
    """``ds`` (unit blocks) through a pool of tokenizer actors: tokenized records, or with ``pack`` packed
    rows (:class:`TokenizeAndPack`). Where the tokenizer runs in the read tasks instead, see
    :func:`read_task_stage`."""
    place = spec.placement
    kwargs: dict[str, Any] = {"data": spec.data, "model": spec.model, "table": spec.table, "sink": sink,
                              "threads": place.threads, "env": tokenizer_env(place.threads)}
    if pack is not None:
        kwargs["pack"] = pack
    return ds.map_batches(
        Tokenizer if pack is None else TokenizeAndPack,
        fn_constructor_kwargs=kwargs,
        batch_size=None,  # whole blocks: a block holds whole units (a unit is one row)
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(min_size=place.pool[0], max_size=place.pool[1]),
        num_cpus=place.tokenize.num_cpus,
        resources=place.tokenize.resources or None,
    )


def source_dataset(spec: StreamSpec, source: int | None = None, *, epoch: int = 0,
                   start: ResumePoint | None = None) -> ray.data.Dataset:
    """The lazy dataset of ``spec``'s source ``source`` (an index into ``spec.sources``; ``None``: every file)
    for ``epoch``, from ``start`` (a resume point; ``None``: the epoch's beginning)."""
    sink = stats_sink()
    order = spec.files(epoch, source)
    start = start or ResumePoint(epoch=epoch)
    first = start.file_pos
    opts = _read_options(spec, order)
    pack = _pack_options(spec.data, epoch)
    stage = read_task_stage(spec, sink, pack, opts.token_ids)
    datasource = ShardDatasource(spec.table, order[first:], opts, sink, start.cursor, start.skip_rows, stage=stage,
                                 stage_schema=None if stage is None else PACKED_SCHEMA)
    n_tasks = max(1, min(len(order) - first, spec.placement.read_tasks))
    concurrency = spec.placement.reads_at_once(opts.token_ids)
    if stage is not None and spec.placement.read_concurrency == "auto":
        # The read tasks tokenize or check ids themselves: one round. A task that follows another in the same
        # slot waits a scheduling round and fills its tokenizer pipeline again (docs/design.md, "Placement").
        n_tasks = min(n_tasks, concurrency or n_tasks)
        if opts.token_ids:  # and none for less work than its worker's start costs
            n_tasks = min(n_tasks, id_read_tasks(spec.table, order[first:]))
    ds = ray.data.read_datasource(datasource, override_num_blocks=n_tasks, concurrency=concurrency,
                                  **read_task_args(spec.placement, stage))
    if stage is None:
        ds = tokenizer_stage(ds, spec, sink, pack=pack)
    ds.context.target_max_block_size = READ_BLOCK_BYTES  # units leave read tasks as they are read
    ds.context.execution_options.preserve_order = spec.data.deterministic
    _SINKS[ds] = sink
    return ds


def build_dataset(cfg: Config | StreamSpec, split: str = "train", *, epoch: int = 0,
                  start: ResumePoint | None = None) -> ray.data.Dataset:
    """A lazy ``ray.data.Dataset`` of packed rows for ``split`` (``train`` or ``eval``): every file, unmixed.

    Columns: ``input_ids``, ``labels``, ``position_ids`` (list<int32>), ``sample_ids`` (list<int64>)
    and the ``unit_*`` position columns; see docs/design.md. With ``data.deterministic`` the row
    order is the same run after run. ``start`` resumes mid-epoch. ``cfg`` may be a spec already built
    (:func:`pipelines.stream.spec.build_spec`; its split wins). ``data_report(ds)`` returns the data-quality
    counters. Training mixes the sources through the feeder (:mod:`pipelines.stream.feeder`).
    """
    spec = cfg if isinstance(cfg, StreamSpec) else build_spec(cfg, split)
    return source_dataset(spec, None, epoch=epoch, start=start)


def iter_packed_local(cfg: Config | StreamSpec, split: str = "train", sink: StatsSink | None = None, *,
                      source: int | None = None, epoch: int = 0, start: ResumePoint | None = None
                      ) -> Iterator[pa.Table]:
    """The same stages in this process, without Ray: packed-row tables in stream order, the same rows as
    :func:`source_dataset` gives for ``source`` (``None``: every file, unmixed).

    For looking at a config's rows in a notebook or a debugger. The feeder reads pre-tokenized sources this
    way (:mod:`pipelines.stream.feeder`); the tokenizing stages train through :func:`source_dataset`.
    """
    spec = cfg if isinstance(cfg, StreamSpec) else build_spec(cfg, split, cpus=1.0)
    sink = sink or StatsSink()
    start = start or ResumePoint(epoch=epoch)
    order = spec.files(epoch, source)
    files = [spec.table.files[i] for i in order[start.file_pos:]]
    opts = _read_options(spec, order)
    pack = _pack_options(spec.data, epoch)
    if opts.token_ids:
        stage: Any = CheckAndPack(spec.data, spec.model, spec.table, sink, pack, tokenizer_vocab_size(spec.model))
    else:
        stage = TokenizeAndPack(spec.data, spec.model, spec.table, sink, spec.placement.threads, pack)
    yield from stage.stream(read_files(files, opts, sink, start.cursor, start.skip_rows))


def stats_of(ds: ray.data.Dataset) -> StatsSink:
    """Where the counters of a dataset built by :func:`build_dataset` go (its key in the process's stats actor)."""
    sink = _SINKS.get(ds)
    if sink is None or sink.actor is None:
        raise ValueError("this dataset was not made by pipelines.build_dataset (no counters attached)")
    return sink


def data_report(ds: ray.data.Dataset) -> dict[str, Any]:
    """Counters of a dataset built by :func:`build_dataset` (rows, skips, truncations, efficiency)."""
    return stats_of(ds).snapshot()
