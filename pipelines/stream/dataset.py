"""``build_dataset``: the stages wired into one lazy, streaming ``ray.data.Dataset`` of packed rows.

    read tasks (whole files, seeded order)   ->  tokenizer (CPU): tokenize, then pack
    one block per unit, one row per unit:        each unit -> input_ids, labels, position_ids,
    sample_ids, records (lists)                  sample_ids (+ unit_* columns), one row per packed row

The tokenizer runs where ``data.tokenize.placement`` says (:func:`tokenizer_placement`): in a pool of
actors, or inside the read tasks (:func:`read_task_stage`: no actor to start, a unit's records never
cross the object store, and the tokenizer keeps encoding from one unit to the next). A set that is all
token ids (pre-tokenized MDS) always takes the second way: its read blocks hold the ids as Arrow list
columns, and their check (:class:`pipelines.tokenize.pretokenized.IdChecker`) and packing run inside the read tasks.

A *unit* is ``pack_buffer_size`` consecutive records of one file (see :mod:`pipelines.stream.units`); it is
packed on its own, so the rows are a function of the data and the config, and a resume point is
"file, unit, rows done". A unit is one row until it is packed, so Ray Data can hand each unit on as
soon as it is read (``READ_BLOCK_BYTES``) without ever cutting one; packing runs right after
tokenizing, in the same process, so a unit's tokens never travel between processes unpacked.

Nothing is read until the dataset is iterated: building it lists files (metadata only) and starts
one tiny counters actor. Memory is bounded by Ray Data's streaming backpressure and the buffer sizes
(``data.tokenize.batch_size``, ``data.pack_buffer_size``), not by the size of the data.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray

from pipelines.config import Config, DataConfig, ModelConfig, TokenizeConfig
from pipelines.sources.datasource import ReadOptions, ShardDatasource, read_files
from pipelines.sources.listing import SourceTable, datasets_for_split, resolve_sources
from pipelines.stats import StatsSink, stats_sink
from pipelines.stream.packing import PACKED_SCHEMA, Packer, PackOptions
from pipelines.stream.units import READ_BLOCK_BYTES, Cursor, ResumePoint
from pipelines.stream.units import ordered_files as _ordered_files
from pipelines.tokenize.pretokenized import IdChecker, tokenizer_vocab_size
from pipelines.tokenize.stage import Tokenizer, imports_transformers, rust_thread_env

log = logging.getLogger(__name__)

__all__ = ["ResumePoint", "all_pretokenized", "build_dataset", "data_report", "iter_packed_local", "ordered_files"]

# CPUs left for read and packing tasks when sizing the tokenizer pool automatically; a pool that
# takes every CPU starves the reads and the pipeline hangs.
CPU_RESERVE_FOR_READS = 0.5
# A pre-tokenized stream gets a read task per this many bytes of shard data (uncompressed), and no more
# than run at once (one per CPU). Each task beside the first waits for a worker process of its own, and a
# cold cluster's start outlasts a small stream's share. On the 2-core host one task checks and packs about
# 70 MB/s of int32 ids through Ray (B6's 12.8 M-token set, 54 MB: 0.8 s) and a worker start takes ~1.5 s,
# so a second task finishes sooner only past ~2 x 1.5 s x 70 MB/s = 200 MB; 128 MB leans to parallel reads,
# as a larger or quieter node starts workers sooner. B6's set: 1 task instead of 2, whole pass 4.2 -> 3.1 s
# (BENCHMARKS.md, "One read task for a small pre-tokenized stream"; with idle workers up, 0.8 s both ways).
ID_BYTES_PER_READ_TASK = 128 << 20


def ordered_files(cfg: Config, table: SourceTable, epoch: int, datasets: list[int] | None = None) -> list[int]:
    """Indices into ``table.files`` in the epoch's read order (see :func:`pipelines.stream.units.ordered_files`)."""
    return _ordered_files(table, cfg.data.shuffle_seed, epoch, datasets)


def unit_size(cfg: Config) -> int:
    """Records per packing unit: the pack buffer (bfd, concat) or a tokenizer batch (none)."""
    return cfg.data.pack_buffer_size if cfg.data.packing != "none" else cfg.data.tokenize.batch_size


def _cluster_cpus() -> float:
    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 1))
    return float(os.cpu_count() or 1)


def tokenizer_pool_size(tok: TokenizeConfig, cpus: float | None = None) -> tuple[int, int]:
    """``(min, max)`` tokenizer actors. ``auto``: as many as fit next to the read tasks, at least one.

    Example: 8 CPUs, ``num_cpus: 1`` -> (1, 7); the pool grows as CPUs free up, so a cluster busy
    with training still gets one actor instead of hanging.
    """
    if tok.num_actors != "auto":
        return int(tok.num_actors), int(tok.num_actors)
    cpus = _cluster_cpus() if cpus is None else cpus
    return 1, max(1, math.floor((cpus - CPU_RESERVE_FOR_READS) / tok.num_cpus))


def tokenizer_pools_short(tok: TokenizeConfig, pools: int, cluster: Mapping[str, float]) -> list[str]:
    """What ``cluster`` (``ray.cluster_resources()``) lacks to run ``pools`` tokenizer pools at once, each at
    its smallest; empty when they fit.

    A mix of N sources streams them side by side, one pool each, so all N must start. Example:
    ``resources: {cpu_node: 1}``, 2 sources, one node with ``cpu_node: 1`` -> ``["cpu_node: 2 needed, 1 in
    the cluster"]``: one pool waits for the other's stream to end, which can be never (the mixer waits on
    the stream that cannot start; tests/test_node_loss.py stalled so).
    """
    smallest = tokenizer_pool_size(tok, cpus=1.0)[0]  # the minimum does not depend on the CPUs
    need = {"CPU": tok.num_cpus * smallest * pools}
    for key, amount in tok.resources.items():
        need[key] = need.get(key, 0.0) + amount * smallest * pools
    return [f"{key}: {n:g} needed, {cluster.get(key, 0.0):g} in the cluster"
            for key, n in need.items() if n > cluster.get(key, 0.0) + 1e-9]


def tokenizer_threads(tok: TokenizeConfig, max_actors: int, cpus: float | None = None) -> int:
    """Rust threads per tokenizer actor: as set, or (auto) the cluster's CPUs per actor, at least 1."""
    if tok.threads != "auto":
        return int(tok.threads)
    cpus = _cluster_cpus() if cpus is None else cpus
    return max(1, math.floor(cpus / max(1, max_actors)))


def read_concurrency(cfg: Config, token_ids: bool, cpus: float | None = None) -> int | None:
    """Read tasks running at once: ``data.read_concurrency``; ``None`` is Ray's own cap, as many as the
    CPUs allow. ``auto`` (the default): one per tokenizer actor of the pool at its largest, or one per
    CPU of the cluster when the read tasks do the work themselves (``token_ids``: every source is
    pre-tokenized MDS). Ray's own cap there is one per ``read_num_cpus`` (8 at a time on 2 CPUs): each
    starts a worker process, and the pre-tokenized B6 pass took 4.5-8 s instead of 2.5 s.

    Example: 2 CPUs -> 1 actor -> 1 read task at a time; 16 CPUs -> 15 actors -> 15. Reading is cheap
    next to tokenizing (B2 data: 0.2-0.6 CPU-s of reads against 12 CPU-s in the tokenizer), but each read
    task that runs beside another takes a worker process of its own, which imports ``ray.data`` (~2 CPU-s)
    on the cores the tokenizer needs; with Ray's default (4 at a time on 2 CPUs) B2 was ~30% slower.
    """
    d = cfg.data
    if d.read_concurrency is None:
        return None
    if d.read_concurrency != "auto":
        return int(d.read_concurrency)
    if token_ids:
        return max(1, math.floor(_cluster_cpus() if cpus is None else cpus))
    return tokenizer_pool_size(d.tokenize, cpus)[1]


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
    through Ray's runtime-env agent, while one without can take an idle worker that is already up. On the
    B2 data (2 CPUs) the first packed row came a little sooner: median 3.68 s against 3.82 s after the
    build (``benchmarks/ray_floors.py``, BENCHMARKS.md). For the read tasks see :func:`read_task_stage`.
    """
    return {**rust_thread_env(threads), "USE_TORCH": "0"}


def _read_options(cfg: Config, table: SourceTable, split: str, order: list[int]) -> ReadOptions:
    """How an epoch's stream over ``order`` (indices into ``table.files``, in read order) is read.

    Decided from the whole epoch, never from where a resumed run starts: id-column blocks measure a
    unit's size in id bytes, JSON blocks in record text, so a resumed stream must read as the first did.
    """
    return ReadOptions(
        storage=table.storage,
        on_bad_record=cfg.data.on_bad_record,
        text_fields=tuple(ds.text_field for ds in table.datasets),
        eval_fraction=cfg.data.eval_fraction if not cfg.data.eval_datasets else 0.0,
        split=split,
        unit_size=unit_size(cfg),
        first_unit_source=order[0] if order else -1,
        token_ids=all_pretokenized(table, order),
    )


def _pack_options(cfg: Config, epoch: int) -> PackOptions:
    d = cfg.data
    return PackOptions(d.packing, d.sequence_len, d.oversize, d.shuffle_seed, epoch)


def _start(start: ResumePoint | None) -> tuple[int, Cursor | None, int]:
    if start is None:
        return 0, None, 0
    return start.file_pos, start.cursor, start.skip_rows


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
    stage: type[CheckAndPack | TokenizeAndPack]
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


def tokenizer_placement(tok: TokenizeConfig, cpus: float | None = None) -> str:
    """Where the tokenizer runs, ``actors`` or ``read_tasks``: ``data.tokenize.placement``, or (auto) in the
    read tasks where the pool would hold one actor at most and ``resources`` places nothing.

    Example: 2 CPUs, ``num_cpus: 1`` -> a pool of (1, 1) -> ``read_tasks``: a lone actor runs the units one
    after another as the read task would, but costs a process start and every unit's trip through the object
    store (B2, BENCHMARKS.md: first packed row 2.49 -> 2.04 s, 11% less CPU). 16 CPUs -> (1, 15) -> ``actors``:
    15 tokenizers share the units of 8 read tasks, where in the read tasks each file group would have one.
    """
    if tok.placement != "auto":
        return tok.placement
    return "read_tasks" if tokenizer_pool_size(tok, cpus)[1] == 1 and not tok.resources else "actors"


def read_task_args(cfg: Config, stage: InReadTask | None) -> dict[str, Any]:
    """Ray remote arguments of :func:`build_dataset`'s read tasks, given their :func:`read_task_stage`. Where
    the tokenizer runs in them they reserve what a tokenizer actor would, and an ``isolated`` stage's
    environment is their ``runtime_env``."""
    if stage is None or stage.stage is CheckAndPack:
        return {"num_cpus": cfg.data.read_num_cpus}
    tok = cfg.data.tokenize
    args: dict[str, Any] = {"num_cpus": tok.num_cpus, "resources": dict(tok.resources) or None}
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


def read_task_stage(cfg: Config, table: SourceTable, sink: StatsSink, pack: PackOptions,
                    token_ids: bool) -> InReadTask | None:
    """The packing stage to run inside :func:`build_dataset`'s read tasks, or None where it runs in a tokenizer
    actor pool (:func:`tokenizer_stage`; :func:`tokenizer_placement`).

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
    kwargs: dict[str, Any] = {"data": cfg.data, "model": cfg.model, "table": table, "sink": sink, "pack": pack}
    if token_ids:
        log.info("every source is pre-tokenized MDS: ids are checked and packed in the read tasks "
                 "(no tokenizer actors; data.tokenize is not used)")
        return InReadTask(uuid.uuid4().hex, CheckAndPack, {**kwargs, "vocab_size": tokenizer_vocab_size(cfg.model)})
    tok = cfg.data.tokenize
    if tokenizer_placement(tok) != "read_tasks":
        return None
    threads = tokenizer_threads(tok, tokenizer_pool_size(tok)[1])
    kwargs["threads"] = threads
    if imports_transformers(cfg.model, table):
        return InReadTask(uuid.uuid4().hex, TokenizeAndPack, kwargs, tokenizer_env(threads), isolated=True)
    return InReadTask(uuid.uuid4().hex, TokenizeAndPack, kwargs, rust_thread_env(threads))


def tokenizer_stage(ds: ray.data.Dataset, cfg: Config, table: SourceTable, sink: StatsSink,
                    pack: PackOptions | None = None) -> ray.data.Dataset:
    """``ds`` (unit blocks) through a pool of tokenizer actors: tokenized records, or with ``pack`` packed
    rows (:class:`TokenizeAndPack`). Where the tokenizer runs in the read tasks instead, see
    :func:`read_task_stage`."""
    tok = cfg.data.tokenize
    pool = tokenizer_pool_size(tok)
    threads = tokenizer_threads(tok, pool[1])
    kwargs: dict[str, Any] = {"data": cfg.data, "model": cfg.model, "table": table, "sink": sink,
                              "threads": threads, "env": tokenizer_env(threads)}
    if pack is not None:
        kwargs["pack"] = pack
    return ds.map_batches(
        Tokenizer if pack is None else TokenizeAndPack,
        fn_constructor_kwargs=kwargs,
        batch_size=None,  # whole blocks: a block holds whole units (a unit is one row)
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(min_size=pool[0], max_size=pool[1]),
        num_cpus=tok.num_cpus,
        resources=tok.resources or None,
    )


def build_dataset(
    cfg: Config,
    split: str = "train",
    *,
    epoch: int = 0,
    start: ResumePoint | None = None,
    datasets: list[int] | None = None,
) -> ray.data.Dataset:
    """A lazy ``ray.data.Dataset`` of packed rows for ``split`` (``train`` or ``eval``).

    Columns: ``input_ids``, ``labels``, ``position_ids`` (list<int32>), ``sample_ids`` (list<int64>)
    and the ``unit_*`` position columns; see docs/design.md. With ``data.deterministic`` the row
    order is the same run after run. ``start`` resumes mid-epoch; ``datasets`` restricts the stream
    to some entries of ``data.datasets`` (one stream per source when mixing).
    ``data_report(ds)`` returns the data-quality counters.
    """
    datasets_for_split(cfg, split)  # a clear error for a split with no sources, before listing
    table = resolve_sources(cfg, split)
    check_pretokenized(cfg, table)
    sink = stats_sink()
    order = ordered_files(cfg, table, epoch, datasets)
    first, cursor, skip = _start(start)
    opts = _read_options(cfg, table, split, order)
    pack = _pack_options(cfg, epoch)
    stage = read_task_stage(cfg, table, sink, pack, opts.token_ids)
    source = ShardDatasource(table, order[first:], opts, sink, cursor, skip, stage=stage,
                             stage_schema=None if stage is None else PACKED_SCHEMA)
    n_tasks = max(1, min(len(order) - first, cfg.data.read_tasks))
    concurrency = read_concurrency(cfg, opts.token_ids)
    if stage is not None and cfg.data.read_concurrency == "auto":
        # The read tasks tokenize or check ids themselves: one round. A task that follows another in the same
        # slot waits a scheduling round and fills its tokenizer pipeline again (B2 on 2 CPUs, 8 tasks -> 1:
        # steady median +3.5% over 12 A/B pairs, see BENCHMARKS.md).
        n_tasks = min(n_tasks, concurrency)
        if opts.token_ids:  # and none for less work than its worker's start costs
            n_tasks = min(n_tasks, id_read_tasks(table, order[first:]))
    ds = ray.data.read_datasource(source, override_num_blocks=n_tasks, concurrency=concurrency,
                                  **read_task_args(cfg, stage))
    if stage is None:
        ds = tokenizer_stage(ds, cfg, table, sink, pack=pack)
    ds.context.target_max_block_size = READ_BLOCK_BYTES  # units leave read tasks as they are read
    ds.context.execution_options.preserve_order = cfg.data.deterministic
    ds.pipelines_stats = sink  # type: ignore[attr-defined]  # read by data_report()
    return ds


def iter_packed_local(cfg: Config, split: str = "train", sink: StatsSink | None = None, *, epoch: int = 0,
                      start: ResumePoint | None = None) -> Iterator[pa.Table]:
    """The same stages in this process, without Ray: packed-row tables in stream order.

    For debugging a config in a notebook and for tests; training uses :func:`build_dataset`.
    """
    table = resolve_sources(cfg, split)
    check_pretokenized(cfg, table)
    sink = sink or StatsSink()
    first, cursor, skip = _start(start)
    order = ordered_files(cfg, table, epoch)
    files = [table.files[i] for i in order[first:]]
    opts = _read_options(cfg, table, split, order)
    if opts.token_ids:
        stage: Any = CheckAndPack(cfg.data, cfg.model, table, sink, _pack_options(cfg, epoch),
                                  tokenizer_vocab_size(cfg.model))
    else:
        stage = TokenizeAndPack(cfg.data, cfg.model, table, sink, tokenizer_threads(cfg.data.tokenize, 1),
                                _pack_options(cfg, epoch))
    yield from stage.stream(read_files(files, opts, sink, cursor, skip))


def check_pretokenized(cfg: Config, table: SourceTable) -> None:
    """Refuse an MDS set tokenized with another tokenizer (see :func:`pipelines.mds.reader.check_tokenized_sources`)."""
    if any(f.format == "mds" for f in table.files):
        from pipelines.mds.reader import check_tokenized_sources

        check_tokenized_sources(cfg, table)


def data_report(ds: ray.data.Dataset) -> dict[str, Any]:
    """Counters of a dataset built by :func:`build_dataset` (rows, skips, truncations, efficiency)."""
    sink: StatsSink | None = getattr(ds, "pipelines_stats", None)
    if sink is None or sink.actor is None:
        raise ValueError("this dataset was not made by pipelines.build_dataset (no counters attached)")
    return sink.snapshot()

