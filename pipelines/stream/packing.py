"""Packing: tokenized samples -> rows of at most ``sequence_len`` tokens.

Strategies (``data.packing``):

* ``bfd`` - best-fit-decreasing over a buffer of ``pack_buffer_size`` samples; a sample is never
  split. Example with capacity 10 and lengths [6, 5, 4, 3, 2]: sorted decreasing, 6 opens bin A
  (4 left), 5 opens B (5 left), 4 fits A best (0 left), 3 fits B (2 left), 2 fits B (0 left) ->
  rows [6, 4] and [5, 3, 2], 100% full.
* ``concat`` - documents (already ending in EOS) joined and cut every ``sequence_len`` tokens; a
  document may continue into the next row. The last, shorter row of each buffer is emitted (no token
  is lost) and counted as ``concat_partial_rows``.
* ``none`` - one sample per row.

Samples longer than ``sequence_len`` (bfd, none) are truncated or dropped per ``data.oversize``,
counted either way. ``position_ids`` restart at 0 at every sample's first token in the row.
Packing works on *units*: ``pack_buffer_size`` consecutive records of one file, cut by the read
tasks. A unit's rows depend only on its records and the config, and are shuffled with a seed from
``data.shuffle_seed``, the epoch and the unit id, so the stream is the same run after run.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipelines.arrays import list_array, list_parts
from pipelines.seeds import unit_shuffle_seed
from pipelines.sources.listing import SourceTable
from pipelines.stats import Counts, StatsSink
from pipelines.stream.units import ROW_UNIT_FIELDS, UnitInfo, row_unit_columns
from pipelines.tokenize.tokenizer import IGNORE_INDEX

ROW_FIELDS = [
    ("input_ids", pa.list_(pa.int32())),
    ("labels", pa.list_(pa.int32())),
    ("position_ids", pa.list_(pa.int32())),
    ("sample_ids", pa.list_(pa.int64())),
]
PACKED_SCHEMA = pa.schema(ROW_FIELDS + ROW_UNIT_FIELDS)


@dataclass(frozen=True)
class PackOptions:
    """Everything a packing task needs; cheap to serialize."""

    strategy: str  # none | concat | bfd
    sequence_len: int
    oversize: str = "truncate"  # truncate | drop
    shuffle_seed: int = 42
    epoch: int = 0


def best_fit_decreasing(lengths: list[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of sample indices, each summing to <= capacity (every length must be <= capacity).

    Items are placed longest first (ties: earlier index first) into the bin with the least room that
    still fits them, which keeps bins full; bins come out in the order they were opened.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []  # remaining capacities of the bins that still have room, sorted ...
    room_bin: list[int] = []  # ... and the bin each belongs to
    for i in order:
        n = int(lengths[i])
        assert 0 < n <= capacity, f"length {n} does not fit capacity {capacity}"
        k = bisect.bisect_left(room, n)  # the fullest bin that still fits n
        if k == len(room):
            b, left = len(bins), capacity - n
            bins.append([i])
        else:
            b, left = room_bin.pop(k), room.pop(k) - n
            bins[b].append(i)
        if left > 0:
            j = bisect.bisect_left(room, left)
            room.insert(j, left)
            room_bin.insert(j, b)
    return bins


@dataclass
class Samples:
    """A buffer of tokenized samples: their ids, and each one's token ids and labels (numpy views into the block)."""

    sample_ids: np.ndarray
    ids: list[np.ndarray]
    labels: list[np.ndarray]

    @classmethod
    def from_table(cls, table: pa.Table) -> Samples:
        """Samples of a tokenized table; empty rows (skipped samples) are left out."""
        sid = table.column("sample_id").to_numpy()
        ids, labels = list_parts(table.column("input_ids")), list_parts(table.column("labels"))
        keep = [i for i, x in enumerate(ids) if len(x)]
        if len(keep) < len(ids):
            return cls(sid[keep], [ids[i] for i in keep], [labels[i] for i in keep])
        return cls(sid, ids, labels)


def fit_to_length(s: Samples, opts: PackOptions, counts: Counts, where: Callable[[int], str] = str) -> Samples:
    """Apply the oversize policy; drop samples left without trained tokens after truncation."""
    keep_sid, keep_ids, keep_labels = [], [], []
    limit = opts.sequence_len
    for sid, ids, labels in zip(s.sample_ids, s.ids, s.labels, strict=True):
        if len(ids) > limit:
            if opts.oversize == "drop":
                counts.add("dropped_oversize", 1, f"{where(int(sid))}: {len(ids)} tokens")
                continue
            counts.add("truncated_samples", 1, f"{where(int(sid))}: {len(ids)} tokens")
            counts.add("truncated_tokens", len(ids) - limit)
            ids, labels = ids[:limit], labels[:limit]
            if not (labels != IGNORE_INDEX).any():
                counts.add("dropped_no_trained_after_truncation", 1, f"{where(int(sid))}: {len(ids)} tokens kept")
                continue
        keep_sid.append(sid)
        keep_ids.append(ids)
        keep_labels.append(labels)
    return Samples(np.asarray(keep_sid, dtype=np.int64), keep_ids, keep_labels)


@dataclass
class Rows:
    """Packed rows under construction."""

    ids: list[np.ndarray]
    labels: list[np.ndarray]
    positions: list[np.ndarray]
    sample_ids: list[np.ndarray]

    def to_arrays(self) -> list[pa.Array]:
        return [
            list_array(self.ids),
            list_array(self.labels),
            list_array(self.positions),
            list_array(self.sample_ids, pa.int64()),
        ]


def rows_from_bins(s: Samples, bins: list[list[int]]) -> Rows:
    """Concatenate each bin's samples in order; positions restart per sample."""
    rows = Rows([], [], [], [])
    for b in bins:
        rows.ids.append(np.concatenate([s.ids[i] for i in b]))
        rows.labels.append(np.concatenate([s.labels[i] for i in b]))
        rows.positions.append(np.concatenate([np.arange(len(s.ids[i]), dtype=np.int32) for i in b]))
        rows.sample_ids.append(s.sample_ids[b].astype(np.int64))
    return rows


def concat_rows(s: Samples, seq_len: int, counts: Counts) -> Rows:
    """Join documents and cut every ``seq_len`` tokens.

    Example, seq_len 4, docs a=[1,2,3] b=[4,5,6,7,8]: stream 1 2 3 4 5 6 7 8 -> rows [1,2,3,4]
    (positions 0 1 2 0, samples a b) and [5,6,7,8] (positions 1 2 3 4 -> restarted at the row: 0 1 2 3,
    samples b).

    Positions restart wherever a document or a row starts, so they are ``arange`` minus the start of
    the piece each token lies in (pieces: the stream cut at every document and row start; above, the
    cuts 0 3 4 give pieces [0,3) [3,4) [4,8)): two passes over the tokens, no per-token search.
    """
    rows = Rows([], [], [], [])
    nonempty = [i for i, x in enumerate(s.ids) if len(x)]
    if not nonempty:
        return rows
    if len(nonempty) < len(s.ids):  # an empty document has no token, so no row holds it
        s = Samples(s.sample_ids[nonempty], [s.ids[i] for i in nonempty], [s.labels[i] for i in nonempty])
    ids = np.concatenate(s.ids)
    labels = np.concatenate(s.labels)
    n = len(ids)
    lengths = np.fromiter((len(x) for x in s.ids), np.int64, len(s.ids))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    row_starts = np.arange(0, n, seq_len)
    cuts = np.union1d(starts, row_starts)
    pos = np.arange(n, dtype=np.int32) - np.repeat(cuts.astype(np.int32), np.diff(np.append(cuts, n)))
    row_ends = np.minimum(row_starts + seq_len, n)
    first_doc = np.searchsorted(starts, row_starts, side="right") - 1
    last_doc = np.searchsorted(starts, row_ends - 1, side="right") - 1
    sample_ids = s.sample_ids.astype(np.int64)
    for r0, r1, d0, d1 in zip(row_starts.tolist(), row_ends.tolist(), first_doc.tolist(), last_doc.tolist(), strict=True):
        rows.ids.append(ids[r0:r1])
        rows.labels.append(labels[r0:r1])
        rows.positions.append(pos[r0:r1])
        rows.sample_ids.append(sample_ids[d0 : d1 + 1])
    tail = n % seq_len
    if tail:
        counts.add("concat_partial_rows")
        counts.add("concat_partial_tokens", int(tail))
    return rows


def shuffle_rows(rows: Rows, seed: int, epoch: int, unit_id: int) -> Rows:
    """Seeded permutation of a unit's rows (same seed, stream epoch and unit -> same order)."""
    rng = np.random.default_rng(unit_shuffle_seed(seed, epoch, unit_id))
    perm = rng.permutation(len(rows.ids))
    return Rows(*[[part[i] for i in perm] for part in (rows.ids, rows.labels, rows.positions, rows.sample_ids)])


def pack_samples(s: Samples, opts: PackOptions, counts: Counts, where: Callable[[int], str] = str) -> Rows:
    """Pack one buffer of samples with the configured strategy (``where`` names a sample in messages)."""
    if opts.strategy == "concat":
        return concat_rows(s, opts.sequence_len, counts)
    s = fit_to_length(s, opts, counts, where)
    if opts.strategy == "bfd":
        bins = best_fit_decreasing([len(x) for x in s.ids], opts.sequence_len)
    else:
        bins = [[i] for i in range(len(s.ids))]
    return rows_from_bins(s, bins)


def split_units(batch: pa.Table) -> Iterator[pa.Table]:
    """The units of a tokenized batch (contiguous runs of one ``unit_id``), each checked complete."""
    uid = batch.column("unit_id").to_numpy()
    bounds = [0, *(np.flatnonzero(np.diff(uid)) + 1).tolist(), len(uid)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        unit = batch.slice(a, b - a)
        expected = unit.column("unit_records")[0].as_py()
        if b - a != expected:
            raise RuntimeError(
                f"packing unit {uid[a]} arrived split ({b - a} of {expected} records in one batch); "
                "units must reach packing whole (is a custom map between the stages re-batching?)"
            )
        yield unit


class Packer:
    """``map_batches`` callable: tokenized units -> shuffled packed rows, unit by unit.

    Each unit is packed on its own and its rows shuffled with a seed from (``shuffle_seed``, epoch,
    unit id), so a unit's rows are the same whatever else shares the batch; a resumed unit drops
    its first ``unit_skip`` rows (already trained on).
    """

    def __init__(self, opts: PackOptions, sink: StatsSink, table: SourceTable | None = None) -> None:
        self.opts, self.sink, self.table = opts, sink, table

    def _where(self, sample_id: int) -> str:
        return self.table.where(sample_id) if self.table else f"sample {sample_id}"

    def pack_unit(self, unit: pa.Table, counts: Counts) -> pa.Table:
        s = Samples.from_table(unit)
        rows = pack_samples(s, self.opts, counts, self._where)
        info = UnitInfo.of(unit)
        rows = shuffle_rows(rows, self.opts.shuffle_seed, self.opts.epoch, info.unit_id)
        skip = min(info.skip, len(rows.ids))
        kept = Rows(*[part[skip:] for part in (rows.ids, rows.labels, rows.positions, rows.sample_ids)])
        counts.add("rows", len(kept.ids))
        counts.add("row_tokens", sum(len(r) for r in kept.ids))
        counts.add("row_capacity", len(kept.ids) * self.opts.sequence_len)
        if skip:
            counts.add("resume_skipped_rows", skip)
        base = kept.to_arrays()
        return pa.Table.from_arrays(base + row_unit_columns(info, len(rows.ids), skip), schema=PACKED_SCHEMA)

    def __call__(self, batch: pa.Table) -> pa.Table:
        counts = Counts()
        tables = [self.pack_unit(unit, counts) for unit in split_units(batch)] if batch.num_rows else []
        self.sink.send(counts)
        return pa.concat_tables(tables) if tables else PACKED_SCHEMA.empty_table()
