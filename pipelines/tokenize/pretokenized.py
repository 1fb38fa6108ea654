"""Samples that arrive as token ids: the checks they pass, and the stage that checks id columns.

Pre-tokenized sources (llm-foundry's concat-tokens MDS, ``ray_jobs/convert.py --tokenize`` output,
JSONL records with ``input_ids``) skip formatting and tokenizing. Before packing, every sample must
be usable with ``model.tokenizer``: ids non-empty and inside its vocabulary, labels aligned with the
ids and either in the vocabulary or -100, at least one label trained. :func:`id_problems` checks a
whole batch at once on flat arrays (no per-token Python), for both the per-record path in
:class:`pipelines.tokenize.stage.Tokenizer` and :class:`IdChecker`.

Worked example, vocabulary of 100 tokens, samples as (ids, labels)::

    ([5, 6], [5, 6])        fine
    ([7, 300], [7, 300])    -> skipped_bad_record: "token id 300 is outside the vocabulary ..."
    ([8, 9], [-100, -100])  -> skipped_no_trained_tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.arrays import list_flat
from pipelines.config import DataConfig, ModelConfig
from pipelines.errors import BadRecordError
from pipelines.sources.listing import SourceTable
from pipelines.stats import Counts, StatsSink
from pipelines.stream.units import carry_unit_columns, explode_units
from pipelines.tokenize.tokenizer import IGNORE_INDEX, shared_tokenizer

__all__ = ["IdChecker", "Problem", "id_problems", "tokenizer_vocab_size"]


def tokenizer_vocab_size(model: ModelConfig) -> int:
    """The vocabulary size ids are checked against (added tokens included), as the tokenizer stage sees it.
    Loaded once per process and tokenizer files: the driver asks for each pre-tokenized stream it builds."""
    return shared_tokenizer(model, with_hf=False)[1].vocab_size


@dataclass(frozen=True)
class Problem:
    """Why one sample cannot be trained on: the counter it is skipped under and the message."""

    counter: str  # skipped_bad_record | skipped_no_trained_tokens
    message: str


def _first_row_of(offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The sample each flat position lies in (``offsets`` delimit samples)."""
    return np.searchsorted(offsets, positions, side="right") - 1


def id_problems(ids_offsets: np.ndarray, ids: np.ndarray, labels_offsets: np.ndarray, labels: np.ndarray,
                vocab_size: int, tokenizer_name: str) -> dict[int, Problem]:
    """Sample index -> :class:`Problem` for every sample of a batch that cannot be trained on.

    ``ids``/``labels`` are the batch's flat values and ``*_offsets`` (n + 1 each) delimit its samples,
    as in an Arrow list array. Each sample gets its first problem in this order: empty ids, labels
    not aligned, an id or label outside the vocabulary, no trained label.
    """
    n = len(ids_offsets) - 1
    lengths, label_lengths = np.diff(ids_offsets), np.diff(labels_offsets)
    found: dict[int, Problem] = {}

    def add(rows: np.ndarray, problem) -> None:  # problem: row -> Problem
        for r in rows.tolist():
            if r not in found:
                found[r] = problem(r)

    add(np.flatnonzero(lengths == 0), lambda r: Problem("skipped_bad_record", "input_ids is empty or not a flat list"))
    add(np.flatnonzero(label_lengths != lengths), lambda r: Problem(
        "skipped_bad_record", f"labels has {label_lengths[r]} entries but input_ids {lengths[r]} "
        f"(labels must align with input_ids, {IGNORE_INDEX} where no loss is taken)"))
    for values, offsets, bad in (
        (ids, ids_offsets, (ids < 0) | (ids >= vocab_size)),
        (labels, labels_offsets, ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)),
    ):
        where = np.flatnonzero(bad)
        if len(where):
            rows, first = np.unique(_first_row_of(offsets, where), return_index=True)
            value_of = dict(zip(rows.tolist(), values[where[first]].tolist(), strict=True))
            add(rows, lambda r, value_of=value_of: Problem(
                "skipped_bad_record", f"token id {value_of[r]} is outside the vocabulary of tokenizer "
                f"{tokenizer_name!r} (0..{vocab_size - 1}); was it tokenized with another tokenizer?"))
    untrained = labels == IGNORE_INDEX
    if untrained.any():  # else every non-empty sample trains on all its tokens
        trained = np.concatenate([[0], np.cumsum(~untrained)])
        n_trained = trained[labels_offsets[1:]] - trained[labels_offsets[:-1]]
        add(np.flatnonzero(n_trained == 0), lambda r: Problem(
            "skipped_no_trained_tokens", "no trained tokens (nothing to learn from this sample)"))
    assert all(0 <= r < n for r in found)
    return found


class IdChecker:
    """``map_batches`` callable for id-column blocks (:data:`pipelines.sources.read.TOKEN_SCHEMA`):
    unit rows -> the tokenizer stage's output (one row per sample, a skipped sample an empty row).

    What :class:`pipelines.tokenize.stage.Tokenizer` does for records holding ``input_ids``, without a
    JSON record or a Python object per sample: the ids stay Arrow arrays from the read to packing.
    """

    def __init__(self, data: DataConfig, model: ModelConfig, table: SourceTable, sink: StatsSink,
                 vocab_size: int) -> None:
        """``vocab_size``: ``model.tokenizer``'s, found once by the driver (:func:`tokenizer_vocab_size`),
        so a read worker that checks ids never loads the tokenizer."""
        self.data, self.table, self.sink = data, table, sink
        self.tokenizer_name = model.tokenizer_path
        self.vocab_size = vocab_size

    def __call__(self, batch: pa.Table) -> pa.Table:
        counts = Counts()
        batch = explode_units(batch)
        ids_col, labels_col = batch.column("input_ids"), batch.column("labels")
        problems = id_problems(*list_flat(ids_col), *list_flat(labels_col), self.vocab_size, self.tokenizer_name)
        sids = batch.column("sample_id")
        for r, p in sorted(problems.items()):
            where = self.table.where(sids[r].as_py())
            if self.data.on_bad_record == "raise":
                raise BadRecordError(f"{where}: {p.message} (set data.on_bad_record: skip to skip and count such records)")
            counts.add(p.counter, 1, f"{where}: {p.message}")
        if problems:  # a skipped sample is an empty row (the packer checks it got every record of a unit)
            keep = np.ones(batch.num_rows, bool)
            keep[list(problems)] = False
            empty = pa.array([[]], pa.list_(pa.int32()))
            mask = pa.array(~keep)
            ids_col = pc.if_else(mask, empty.take(np.zeros(batch.num_rows, np.int64)), ids_col)
            labels_col = pc.if_else(mask, empty.take(np.zeros(batch.num_rows, np.int64)), labels_col)
        kept = batch.num_rows - len(problems)
        counts.add("samples_pretokenized", kept)
        counts.add("samples_tokenized", kept)
        counts.add("tokens", int(pc.sum(pc.list_value_length(ids_col)).as_py() or 0))
        self.sink.send(counts)
        out = pa.Table.from_arrays([sids, ids_col, labels_col], names=["sample_id", "input_ids", "labels"])
        return carry_unit_columns(batch, out)
