"""``build_dataset``: the stages wired into one lazy, streaming ``ray.data.Dataset`` of packed rows.

    read tasks (whole files, seeded order)   ->  tokenizer actors (CPU pool)  ->  packing tasks
    sample_id, record                            sample_id, input_ids, labels     input_ids, labels,
                                                                                   position_ids, sample_ids

Nothing is read until the dataset is iterated: building it lists files (metadata only) and starts
one tiny counters actor. Memory is bounded by Ray Data's streaming backpressure and the buffer sizes
(``data.tokenize.batch_size``, ``data.pack_buffer_size``), not by the size of the data.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import ray

from pipelines.config import Config, TokenizeConfig
from pipelines.datasource import ReadOptions, ShardDatasource, read_files
from pipelines.packing import Packer, PackOptions
from pipelines.sources import SourceTable, datasets_for_split, resolve_sources
from pipelines.stats import StatsSink, format_report, new_stats_actor
from pipelines.tokenize import Tokenizer

# CPUs left for read and packing tasks when sizing the tokenizer pool automatically; a pool that
# takes every CPU starves the reads and the pipeline hangs.
CPU_RESERVE_FOR_READS = 0.5


def file_order(n_files: int, seed: int) -> list[int]:
    """Read order of the files: a seeded permutation (ids stay tied to sorted order)."""
    order = list(range(n_files))
    random.Random(seed).shuffle(order)
    return order


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


def _read_options(cfg: Config, table: SourceTable, split: str) -> ReadOptions:
    return ReadOptions(
        storage=table.storage,
        on_bad_record=cfg.data.on_bad_record,
        text_fields=tuple(ds.text_field for ds in table.datasets),
        eval_fraction=cfg.data.eval_fraction if not cfg.data.eval_datasets else 0.0,
        split=split,
    )


def _pack_options(cfg: Config) -> PackOptions:
    d = cfg.data
    return PackOptions(d.packing, d.sequence_len, d.oversize, d.shuffle_seed)


def build_dataset(cfg: Config, split: str = "train") -> ray.data.Dataset:
    """A lazy ``ray.data.Dataset`` of packed rows for ``split`` (``train`` or ``eval``).

    Columns: ``input_ids``, ``labels``, ``position_ids`` (list<int32>) and ``sample_ids``
    (list<int64>); see docs/design.md. ``data_report(ds)`` returns the data-quality counters.
    """
    datasets_for_split(cfg, split)  # a clear error for a split with no sources, before listing
    table = resolve_sources(cfg, split)
    sink = StatsSink(new_stats_actor())
    source = ShardDatasource(table, file_order(len(table.files), cfg.data.shuffle_seed), _read_options(cfg, table, split), sink)
    ds = ray.data.read_datasource(source, num_cpus=cfg.data.read_num_cpus)

    tok = cfg.data.tokenize
    ds = ds.map_batches(
        Tokenizer,
        fn_constructor_kwargs={"data": cfg.data, "model": cfg.model, "table": table, "sink": sink, "threads": tok.threads},
        batch_size=tok.batch_size,
        batch_format="pyarrow",
        concurrency=tokenizer_pool_size(tok),
        num_cpus=tok.num_cpus,
        resources=tok.resources or None,
        runtime_env={"env_vars": {"RAYON_NUM_THREADS": str(tok.threads),
                                  "TOKENIZERS_PARALLELISM": "true" if tok.threads > 1 else "false"}},
    )
    pack_batch = cfg.data.pack_buffer_size if cfg.data.packing != "none" else tok.batch_size
    ds = ds.map_batches(
        _pack,
        fn_kwargs={"packer": Packer(_pack_options(cfg), sink, table)},
        batch_size=pack_batch,
        batch_format="pyarrow",
        num_cpus=cfg.data.read_num_cpus,
    )
    ds.pipelines_stats = sink  # type: ignore[attr-defined]  # read by data_report()
    return ds


def iter_packed_local(cfg: Config, split: str = "train", sink: StatsSink | None = None) -> Iterator[pa.Table]:
    """The same stages in this process, without Ray: packed-row tables in order.

    For debugging a config in a notebook and for tests; the training path uses :func:`build_dataset`.
    """
    table = resolve_sources(cfg, split)
    sink = sink or StatsSink()
    files = [table.files[i] for i in file_order(len(table.files), cfg.data.shuffle_seed)]
    tokenizer = Tokenizer(cfg.data, cfg.model, table, sink, cfg.data.tokenize.threads)
    packer = Packer(_pack_options(cfg), sink, table)
    buffer_size = cfg.data.pack_buffer_size if cfg.data.packing != "none" else cfg.data.tokenize.batch_size
    pending: list[pa.Table] = []
    n_pending = 0
    for block in read_files(files, _read_options(cfg, table, split), sink):
        for start in range(0, block.num_rows, cfg.data.tokenize.batch_size):
            tokenized = tokenizer(block.slice(start, cfg.data.tokenize.batch_size))
            pending.append(tokenized)
            n_pending += tokenized.num_rows
            while n_pending >= buffer_size:
                merged = pa.concat_tables(pending)
                yield packer(merged.slice(0, buffer_size))
                rest = merged.slice(buffer_size)
                pending, n_pending = [rest], rest.num_rows
    if n_pending:
        yield packer(pa.concat_tables(pending))


def _pack(batch: Any, packer: Packer) -> Any:
    return packer(batch)


def data_report(ds: ray.data.Dataset) -> dict[str, Any]:
    """Counters of a dataset built by :func:`build_dataset` (rows, skips, truncations, efficiency)."""
    sink: StatsSink | None = getattr(ds, "pipelines_stats", None)
    if sink is None or sink.actor is None:
        raise ValueError("this dataset was not made by pipelines.build_dataset (no counters attached)")
    return ray.get(sink.actor.snapshot.remote())


def print_report(ds: ray.data.Dataset) -> str:
    """The counters as a short text block (also returned)."""
    text = format_report(data_report(ds))
    print(text)
    return text
