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
measurements: docs/design.md, "Placement". The stages themselves, which run in any process, are in
:mod:`pipelines.stream.stages`.
"""

from __future__ import annotations

import logging
import math
import uuid
import weakref
from typing import Any

import ray

from pipelines.config import Config
from pipelines.sources.datasource import ShardDatasource
from pipelines.sources.listing import SourceTable
from pipelines.stats import StatsSink, stats_sink
from pipelines.stream.packing import PACKED_SCHEMA, PackOptions
from pipelines.stream.placement import Placement
from pipelines.stream.spec import StreamSpec, build_spec
from pipelines.stream.stages import (
    CheckAndPack,
    InReadTask,
    TokenizeAndPack,
    TokenizeToStore,
    pack_options,
    read_options,
    tokenizer_env,
)
from pipelines.stream.units import READ_BLOCK_BYTES, ResumePoint
from pipelines.tokenize.pretokenized import tokenizer_vocab_size
from pipelines.tokenize.stage import Tokenizer, imports_transformers, rust_thread_env

log = logging.getLogger(__name__)

__all__ = ["ResumePoint", "build_dataset", "data_report", "source_dataset", "stats_of"]

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


def read_task_stage(spec: StreamSpec, sink: StatsSink, pack: PackOptions, token_ids: bool) -> InReadTask | None:
    """The packing stage to run inside :func:`build_dataset`'s read tasks, or None where it runs in a tokenizer
    actor pool (:func:`tokenizer_stage`; ``spec.placement.where``).

    Id-column blocks (``token_ids``, see :func:`pipelines.stream.stages.all_pretokenized`) are always checked
    and packed in the read tasks (:class:`CheckAndPack`); ``data.tokenize`` then places nothing. The read tasks
    take :func:`read_task_args`: where the tokenizer runs in them, what an actor of the pool would reserve.

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
    opts = read_options(spec, order)
    pack = pack_options(spec.data, epoch)
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


def stats_of(ds: ray.data.Dataset) -> StatsSink:
    """Where the counters of a dataset built by :func:`build_dataset` go (its key in the process's stats actor)."""
    sink = _SINKS.get(ds)
    if sink is None or sink.actor is None:
        raise ValueError("this dataset was not made by pipelines.build_dataset (no counters attached)")
    return sink


def data_report(ds: ray.data.Dataset) -> dict[str, Any]:
    """Counters of a dataset built by :func:`build_dataset` (rows, skips, truncations, efficiency)."""
    return stats_of(ds).snapshot()
