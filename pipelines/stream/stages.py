"""The stages a stream's unit blocks go through, as callables that run in any process: in a tokenizer actor
(``map_batches``), inside a Ray Data read task (:class:`InReadTask`) or in this process
(:func:`iter_packed_local`). No Ray Data here: the feeder reads pre-tokenized sources in its own process
with these, and its process starts without importing ``ray.data``.

    unit blocks (pipelines.sources.read)  ->  TokenizeAndPack   -> packed rows (pipelines.stream.packing)
                                          ->  CheckAndPack      -> packed rows (pre-tokenized: ids checked)
                                          ->  TokenizeToStore   -> tokenized records (convert.py --tokenize)

:mod:`pipelines.stream.dataset` places them in a Ray Data pipeline.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.config import Config, DataConfig, ModelConfig
from pipelines.sources.listing import SourceTable
from pipelines.sources.read import ReadOptions, read_files
from pipelines.stats import StatsSink
from pipelines.stream.packing import Packer, PackOptions
from pipelines.stream.spec import StreamSpec, build_spec
from pipelines.stream.units import ResumePoint
from pipelines.tokenize.pretokenized import IdChecker, tokenizer_vocab_size
from pipelines.tokenize.stage import Tokenizer, rust_thread_env

__all__ = ["CheckAndPack", "InReadTask", "TokenizeAndPack", "TokenizeToStore", "all_pretokenized", "iter_packed_local",
           "pack_options", "read_options", "stored_columns", "tokenizer_env"]


def tokenizer_env(threads: int) -> dict[str, str]:
    """Environment of the tokenizer actors: bounded Rust threads (:func:`pipelines.tokenize.stage.rust_thread_env`),
    and transformers without torch (``USE_TORCH=0``: importing torch costs seconds and ~1 GB per actor, and
    tokenizing never needs it).

    The actors set it in their constructor (``Tokenizer(env=...)``), before anything loads, rather than
    through a ``runtime_env``: an actor with an environment of its own needs a new worker process, started
    through Ray's runtime-env agent, while one without can take an idle worker that is already up. For the
    read tasks see :func:`pipelines.stream.dataset.read_task_stage`.
    """
    return {**rust_thread_env(threads), "USE_TORCH": "0"}


def read_options(spec: StreamSpec, order: list[int]) -> ReadOptions:
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


def pack_options(data: DataConfig, epoch: int) -> PackOptions:
    """How an epoch's units are packed (``data.packing`` and its options; the epoch seeds the shuffle)."""
    return PackOptions(data.packing, data.sequence_len, data.oversize, data.shuffle_seed, epoch)


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


class TokenizeAndPack:
    """The tokenizer actors' callable in :func:`pipelines.stream.dataset.build_dataset`: blocks of whole units ->
    packed rows."""

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
    environment it had (see :func:`pipelines.stream.dataset.read_task_stage`).
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


def iter_packed_local(cfg: Config | StreamSpec, split: str = "train", sink: StatsSink | None = None, *,
                      source: int | None = None, epoch: int = 0, start: ResumePoint | None = None
                      ) -> Iterator[pa.Table]:
    """The same stages in this process, without Ray: packed-row tables in stream order, the same rows as
    :func:`pipelines.stream.dataset.source_dataset` gives for ``source`` (``None``: every file, unmixed).

    For looking at a config's rows in a notebook or a debugger. The feeder reads pre-tokenized sources this
    way (:mod:`pipelines.stream.feeder`); the tokenizing stages train through Ray Data.
    """
    spec = cfg if isinstance(cfg, StreamSpec) else build_spec(cfg, split, cpus=1.0)
    sink = sink or StatsSink()
    start = start or ResumePoint(epoch=epoch)
    order = spec.files(epoch, source)
    files = [spec.table.files[i] for i in order[start.file_pos:]]
    opts = read_options(spec, order)
    pack = pack_options(spec.data, epoch)
    if opts.token_ids:
        stage: Any = CheckAndPack(spec.data, spec.model, spec.table, sink, pack, tokenizer_vocab_size(spec.model))
    else:
        stage = TokenizeAndPack(spec.data, spec.model, spec.table, sink, spec.placement.threads, pack)
    yield from stage.stream(read_files(files, opts, sink, start.cursor, start.skip_rows))
