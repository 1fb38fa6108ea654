"""A Ray Data ``Datasource`` over the resolved files: read tasks own groups of whole files and stream them
(:func:`pipelines.sources.read.read_files`: one block per packing unit), through the stage
``pipelines.stream.dataset`` may give them (``ShardDatasource(stage=...)``: the tokenizer and packer, where
they run in the read tasks). Read tasks' closures hold file paths, options and that stage: small to pickle.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from pipelines.sources.listing import SourceFile, SourceTable
from pipelines.sources.read import ReadOptions, read_files
from pipelines.stats import StatsSink
from pipelines.stream.units import FIRST_UNIT_BYTES, Cursor


def group_files(files: list[SourceFile], parallelism: int) -> list[list[SourceFile]]:
    """Split files into exactly ``min(parallelism, len(files))`` contiguous groups of similar size.

    Exactly that many, so Ray Data does not split the read's output blocks to make up the count (a
    unit is one row, so a split could not cut one, but it costs extra tasks). Example: sizes [5, 1, 1, 1, 4]
    into 2 groups: cut where the running total first reaches half of 12 -> [[5, 1], [1, 1, 4]].
    """
    n = max(1, min(parallelism, len(files)))
    cum = list(itertools.accumulate(max(f.size, 1) for f in files))
    cuts, prev = [], 0
    for g in range(1, n):
        i = bisect.bisect_left(cum, cum[-1] * g / n) + 1
        i = min(max(i, prev + 1), len(files) - (n - g))
        cuts.append(i)
        prev = i
    bounds = [0, *cuts, len(files)]
    return [files[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


# A stage that runs inside the read tasks: a task's unit blocks in, in order, -> the blocks it hands on
# (``pipelines.stream.stages.InReadTask``: the tokenizer and packer), with the schema they have.
BlockStage = Callable[[Iterator[pa.Table]], Iterator[pa.Table]]


class ShardDatasource(Datasource):
    """Ray Data source over a :class:`SourceTable`, reading files in a seeded order; with ``stage``, each read
    task runs its unit blocks through it (one stream per task) and hands on what it yields (``stage_schema``).
    ``first_unit_task``: the stream's first unit gets a read task of its own (:meth:`get_read_tasks`), for a
    stream whose first row is waited for; ``convert.py``, which only writes, turns it off."""

    def __init__(self, table: SourceTable, order: list[int], opts: ReadOptions, sink: StatsSink,
                 start: Cursor | None = None, skip_rows: int = 0, stage: BlockStage | None = None,
                 stage_schema: pa.Schema | None = None, first_unit_task: bool = True) -> None:
        super().__init__()
        assert (stage is None) == (stage_schema is None), "a stage comes with its output schema"
        self._files = [table.files[i] for i in order]
        self._opts = opts
        self._sink = sink
        self._start, self._skip = start, skip_rows
        self._stage, self._schema = stage, stage_schema or opts.schema
        self._first_unit_task = first_unit_task

    def get_name(self) -> str:
        return "ReadShards"

    @property
    def stage(self) -> BlockStage | None:
        """What each read task runs its unit blocks through (None: the blocks leave as read)."""
        return self._stage

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(f.size for f in self._files) or None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None) -> list[ReadTask]:
        """One task per group of whole files, and before them a task for the stream's first unit.

        A read task's units are merged into blocks of up to ``READ_BLOCK_BYTES`` before they leave it, and
        the tokenizer stage hands on a block's rows when the whole block is done. The stream's first unit
        therefore gets a task of its own (unless ``first_unit_task`` is off): its block leaves at once and is
        tokenized alone, so the first row does not wait for the units merged after it. The first group's task
        reads that unit again and drops it (``units=slice(1, None)``). The price is reading the first unit
        twice: ``FIRST_UNIT_BYTES`` from an epoch's start; a full-size unit from a resume point (which starts at
        a unit of the epoch's layout) or when the first file holds no record (then the first unit is the next
        file's). Without it, a resumed unit's packed rows wait in the task's output block for more rows
        (docs/design.md, "Placement and timing notes").
        """
        tasks = []
        for group in group_files(self._files, max(parallelism, 1)):
            start, skip = (self._start, self._skip) if group[0] is self._files[0] else (None, 0)
            units = slice(None)
            if group[0] is self._files[0] and self._first_unit_task:
                # the whole group, not its first file: if that file holds no record, the first unit is the
                # next file's first, and both tasks must agree on which unit that is
                tasks.append(self._task(group, start, skip, slice(0, 1), FIRST_UNIT_BYTES, per_task_row_limit))
                units = slice(1, None)
            tasks.append(self._task(group, start, skip, units, None, per_task_row_limit))
        return tasks

    def _task(self, group: list[SourceFile], start: Cursor | None, skip: int, units: slice, max_bytes: int | None,
              per_task_row_limit: int | None) -> ReadTask:
        size = sum(f.size for f in group)
        meta = BlockMetadata(
            num_rows=None,
            size_bytes=(min(size, max_bytes) if max_bytes else size) or None,
            input_files=[f.url for f in group],
            exec_stats=None,
        )
        opts, sink, stage = self._opts, self._sink, self._stage

        def read_fn() -> Iterator[pa.Table]:
            blocks = read_files(group, opts, sink, start, skip, units=units)
            return blocks if stage is None else stage(blocks)

        return ReadTask(read_fn, meta, schema=self._schema, per_task_row_limit=per_task_row_limit)
