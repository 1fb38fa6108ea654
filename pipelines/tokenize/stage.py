"""Tokenize: the CPU stage, ``(sample_id, record)`` blocks -> ``(sample_id, input_ids, labels)``.

Each process that runs it (a tokenizer actor, or a read worker: ``data.tokenize.placement``) loads the
tokenizer once, and the stages of the streams it serves after that share it
(:func:`pipelines.tokenize.tokenizer.shared_tokenizer`). Per block it parses the JSON records, formats them
(:mod:`pipelines.sources.formats`), encodes the texts in batch calls of the Rust tokenizer
(``data.tokenize.batch_size`` texts each, on the stage's encode thread, while this thread formats and
labels the neighbouring slices), and turns
each format's trained character spans into labels (:mod:`pipelines.tokenize.labels`), so the cost per sample
is a few lookups, not a loop over tokens. Given a stream of blocks (inside a read task:
:meth:`Tokenizer.stream`), it keeps the encode thread busy from one block to the next. With a byte-level
BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2) the batch call is ``encode_batch_fast``, which skips
computing offsets, and the labels come from the tokens' byte lengths, for the whole batch at once in
flat arrays (ids, labels and EOS never handled per sample in Python); any other tokenizer uses
``encode_batch`` and its offsets.

Chat samples (:class:`pipelines.sources.chat_template.Pieces`) are encoded piece by piece: the text between two cuts
by the tokenizer itself where no control string came from the data, else text with the tokenizer's added
tokens switched off (:func:`plain_tokenizer`) and the template's control tokens put in as ids. They are
labelled per piece: no offsets and no byte lengths are needed, since every trained span starts and ends at a
piece boundary.

Worked example (completion, GPT-2): ``"Hello world"`` -> ids ``[15496, 995, 50256]`` (EOS
appended), labels ``[15496, 995, 50256]``. Labels are not shifted; the model shifts them.
"""

from __future__ import annotations

import functools
import json
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa

from pipelines.arrays import list_array, parts_flat
from pipelines.config import DataConfig, ModelConfig
from pipelines.errors import BadRecordError, RecordError
from pipelines.sources.chat_template import SEGMENT, Pieces
from pipelines.sources.formats import Formatted, make_formatter
from pipelines.sources.listing import SourceTable, split_sample_id
from pipelines.sources.records import unpack_array
from pipelines.stats import Counts, StatsSink
from pipelines.stream.units import carry_unit_columns, explode_units
from pipelines.tokenize.labels import ByteSpans, span_labels
from pipelines.tokenize.pretokenized import id_problems
from pipelines.tokenize.tokenizer import (
    IGNORE_INDEX,
    Backend,
    load_tokenizer,
    loads_without_transformers,
    shared_tokenizer,
)

# Dataset types whose formatter needs the transformers tokenizer (its chat template).
HF_FORMATS = ("chat_template",)

__all__ = ["IGNORE_INDEX", "TOKENIZED_SCHEMA", "Tokenizer", "byte_spans", "imports_transformers", "rust_thread_env", "tokenized_table"]


def rust_thread_env(threads: int) -> dict[str, str]:
    """The Rust tokenizer's thread settings: ``RAYON_NUM_THREADS`` (read once, when the process's thread pool
    is built at its first parallel encode) and ``TOKENIZERS_PARALLELISM``."""
    return {"RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false"}


def _needs_hf(table: SourceTable) -> bool:
    return any(ds.type in HF_FORMATS for ds in table.datasets)


def imports_transformers(model: ModelConfig, table: SourceTable) -> bool:
    """Whether a :class:`Tokenizer` for ``table`` loads the transformers tokenizer, told without loading
    anything: a chat template, or a tokenizer that ``tokenizers`` alone does not load exactly
    (:func:`pipelines.tokenize.tokenizer.loads_without_transformers`)."""
    return _needs_hf(table) or not loads_without_transformers(model)


@functools.lru_cache(maxsize=4)
def byte_spans(backend: Backend) -> ByteSpans | None:
    """:meth:`ByteSpans.for_tokenizer` of ``backend``'s tokenizer, computed once per backend object.

    The stages of stream after stream in one process share one backend
    (:func:`pipelines.tokenize.tokenizer.shared_tokenizer`), which nothing changes, and so its ByteSpans (0.07 s to
    compute for GPT-2's vocabulary). A backend hashes and compares by its tokenizer object's identity, and
    the cache holds the backend, so an entry never answers for another tokenizer.
    """
    return ByteSpans.for_tokenizer(backend.tokenizer)


@functools.lru_cache(maxsize=4)
def plain_tokenizer(backend: Backend) -> Any:
    """``backend``'s tokenizer with no added tokens: text in, the model's own tokens out, so a control string
    inside data (``"<|im_end|>"``) is encoded as its characters. Chat pieces are encoded with it
    (:class:`pipelines.sources.chat_template.Pieces`); cached per backend as :func:`byte_spans` is."""
    from tokenizers import Tokenizer as RustTokenizer

    state = json.loads(backend.tokenizer.to_str())
    state["added_tokens"] = []
    plain = RustTokenizer.from_str(json.dumps(state))
    plain.no_truncation()
    plain.no_padding()
    return plain


TOKENIZED_SCHEMA = pa.schema(
    [("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))]
)


@dataclass(frozen=True)
class Encoded:
    """One tokenized sample: ids and labels (EOS included), span straddles, whether any token is trained."""

    ids: np.ndarray
    labels: np.ndarray
    straddles: int
    trained: bool
    retokenized: int = 0  # chat: runs cut at a generation point that a later prompt tokenizes otherwise


@dataclass
class Pretokenized:
    """A record that arrived with token ids: used as is (labels default to the ids: all trained)."""

    ids: np.ndarray
    labels: np.ndarray


class Tokenizer:
    """Records -> token ids and labels: called per block by an actor pool's ``map_batches``; inside the read
    tasks, :meth:`stream` takes each task's blocks as one stream.

    Records that already hold ``input_ids`` (pre-tokenized MDS such as llm-foundry's concat-tokens
    layout or ``ray_jobs/convert.py --tokenize`` output) skip formatting and tokenization.

    Constructor arguments are small: configs, the file table (for error locations) and the stats sink;
    ``env`` (the actors': :func:`pipelines.stream.stages.tokenizer_env`) is set in the process before anything
    loads, replacing what it inherited. Without it (in the read tasks: their ``runtime_env`` or
    :class:`pipelines.stream.stages.InReadTask` sets it), the thread settings are only defaults.
    """

    def __init__(self, data: DataConfig, model: ModelConfig, table: SourceTable, sink: StatsSink, threads: int = 1,
                 env: Mapping[str, str] | None = None):
        if env is not None:  # an actor's own process (see pipelines.stream.dataset.tokenizer_stage): set, before any load
            os.environ.update(env)
        for key, value in rust_thread_env(threads).items():
            os.environ.setdefault(key, value)
        self.data, self.model, self.table, self.sink = data, model, table, sink
        self._pool: ThreadPoolExecutor | None = None  # the encode thread (_encoder)
        # Chat templates need the transformers tokenizer; other formats only the Rust one, which loads
        # without importing transformers when that gives the same encoding (pipelines.tokenize.tokenizer).
        self._hf, backend = shared_tokenizer(model, _needs_hf(table))
        self._backend = backend
        self._checked: dict[tuple[str, ...], bool] = {}  # chat: retokenization checks done (_retokenized)
        self.backend, self.eos, self.vocab_size = backend.tokenizer, backend.eos_token_id, backend.vocab_size
        self.byte_spans = byte_spans(backend)  # None: labels need the encoding's offsets
        self.tokenizer_name = model.tokenizer_path
        self.formatters = [make_formatter(ds, data, self._hf) for ds in table.datasets]
        if data.add_eos and self.eos is None and any(ds.type in ("completion", "alpaca") for ds in table.datasets):
            raise ValueError(f"tokenizer {model.tokenizer_path!r} has no eos_token; set data.add_eos: false")

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (loaded on first use where the stage itself does not need it)."""
        if self._hf is None:
            self._hf = load_tokenizer(self.model)
        return self._hf

    # -- one record -------------------------------------------------------------------------
    def _format(self, sample_id: int, record: str, counts: Counts) -> Formatted | Pieces | Pretokenized | None:
        try:
            rec = json.loads(record)
        except json.JSONDecodeError as err:
            return self._bad(sample_id, f"malformed JSON ({err.msg} at column {err.colno})", counts)
        if not isinstance(rec, dict):
            return self._bad(sample_id, f"a record should be a JSON object, got {type(rec).__name__}", counts)
        if "input_ids" in rec:
            return self._pretokenized(sample_id, rec, counts)
        source, _ = split_sample_id(sample_id)
        try:
            return self.formatters[self.table.files[source].dataset_index](rec)
        except RecordError as err:
            return self._bad(sample_id, str(err), counts)

    def _pretokenized(self, sample_id: int, rec: dict[str, Any], counts: Counts) -> Pretokenized | None:
        """A record that already holds ``input_ids`` (and maybe ``labels``); no template, no EOS.

        Which tokenizer made a converted set is checked once at build time (pipelines.mds.reader); the
        ids themselves are checked with the rest of the batch (:func:`pipelines.tokenize.pretokenized.id_problems`).
        """
        try:
            ids = unpack_array(rec["input_ids"])
            labels = unpack_array(rec["labels"]) if rec.get("labels") is not None else ids
        except (TypeError, ValueError, OverflowError):
            return self._bad(sample_id, "input_ids/labels should be lists of integers", counts)
        if ids.ndim != 1:
            return self._bad(sample_id, "input_ids is empty or not a flat list", counts)
        if labels.ndim != 1:
            return self._bad(sample_id, "labels should be a flat list of integers", counts)
        return Pretokenized(ids, labels)

    def _check_pretokenized(self, sids: list[int], items: dict[int, Pretokenized], counts: Counts) -> dict[int, Pretokenized]:
        """The batch's pre-tokenized samples that pass :func:`id_problems`, as int32 (the rest reported)."""
        if not items:
            return {}
        rows = list(items)
        problems = id_problems(*parts_flat([items[i].ids for i in rows]), *parts_flat([items[i].labels for i in rows]),
                               self.vocab_size, self.tokenizer_name)
        good = {}
        for k, i in enumerate(rows):
            if k in problems:
                self._bad(sids[i], problems[k].message, counts, problems[k].counter)
            else:
                good[i] = Pretokenized(items[i].ids.astype(np.int32), items[i].labels.astype(np.int32))
        return good

    def _bad(self, sample_id: int, msg: str, counts: Counts, key: str = "skipped_bad_record") -> None:
        where = self.table.where(sample_id)
        if self.data.on_bad_record == "raise":
            raise BadRecordError(f"{where}: {msg} (set data.on_bad_record: skip to skip and count such records)")
        counts.add(key, 1, f"{where}: {msg}")
        return None

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[Any]:
        """The Rust tokenizer's batch call: without offsets where :meth:`_fast` says the ids suffice."""
        encode = self.backend.encode_batch_fast if self._fast(add_special_tokens) else self.backend.encode_batch
        return encode(texts, add_special_tokens=add_special_tokens)

    def _fast(self, add_special_tokens: bool) -> bool:
        """Whether texts encoded with this flag go without offsets (their labels then come from the ids)."""
        return self.byte_spans is not None and self.byte_spans.usable(add_special_tokens)

    def _format_slice(self, blk: _Block, start: int) -> list[tuple[bool | None, list[int], Future]]:
        """Format ``blk``'s records from ``start`` (one ``data.tokenize.batch_size`` slice) and submit their
        texts to the encode thread: one call per ``add_special_tokens`` flag (the flag is per call; what a
        sample encodes to does not depend on its call), and one for the chat samples' pieces."""
        end = start + self.data.tokenize.batch_size
        blk.formatted.extend(self._format(sid, rec, blk.counts)
                             for sid, rec in zip(blk.sids[start:end], blk.records[start:end], strict=True))
        calls = []
        for flag in (True, False):
            idx = [i for i in range(start, len(blk.formatted))
                   if isinstance(blk.formatted[i], Formatted) and blk.formatted[i].add_special_tokens is flag]
            if idx:
                texts = [blk.formatted[i].text for i in idx]
                calls.append((flag, idx, self._encoder().submit(self._encode, texts, flag)))
        idx = [i for i in range(start, len(blk.formatted)) if isinstance(blk.formatted[i], Pieces)]
        if idx:
            segments: list[str] = []
            plain: list[str] = []
            for i in idx:
                _piece_texts(blk.formatted[i], segments, plain)
            calls.append((None, idx, self._encoder().submit(self._encode_pieces, segments, plain)))
        return calls

    def _encode_pieces(self, segments: list[str], plain: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Chat pieces' texts, each alone: segments with the tokenizer's added tokens (the template's control
        tokens), the rest with none recognised (:func:`plain_tokenizer`)."""
        return _ids(self.backend, segments), _ids(plain_tokenizer(self._backend), plain) if plain else []

    def _encoder(self) -> ThreadPoolExecutor:
        """The stage's one encode thread (made on first use: the stage object itself is never pickled)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        return self._pool

    def _label(self, blk: _Block, calls: list[tuple[bool | None, list[int], Future]]) -> None:
        """Ids and labels of one of ``blk``'s slices, into ``blk.encoded`` by index, once it is encoded."""
        for flag, idx, future in calls:
            group = [blk.formatted[i] for i in idx]
            encs = future.result()
            if flag is None:
                done = _from_pieces(group, encs, plain_tokenizer(self._backend), self._checked)
            elif self._fast(flag):
                done = self._from_ids(group, encs)
            else:
                done = [self._with_offsets(f, enc) for f, enc in zip(group, encs, strict=True)]
            blk.encoded.update(zip(idx, done, strict=True))
        blk.labelled += 1

    def _from_ids(self, group: list[Formatted], encs: list[Any]) -> list[Encoded]:
        """The fast path for one batch call, on flat arrays: ids, labels from the ids' byte lengths
        (:meth:`ByteSpans.batch_labels`), EOS appended; a sample whose ids do not tile its text is encoded
        again with offsets. Each sample's arrays are views into the batch's two arrays.

        Example: two samples of 2 and 1 text ids, EOS after both: text offsets ``[0, 2, 3]``, output
        offsets ``[0, 3, 5]``; text id ``j`` of sample ``k`` lands at ``j + (out[k] - text[k])``.
        """
        n = len(group)
        raw = [enc.ids for enc in encs]
        n_text = np.fromiter(map(len, raw), np.int64, n)
        eos = np.fromiter((f.add_eos for f in group), bool, n)
        text_off, out_off = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
        np.cumsum(n_text, out=text_off[1:])
        np.cumsum(n_text + eos, out=out_off[1:])
        flat = np.fromiter(chain.from_iterable(raw), np.int32, int(text_off[-1]))
        text_labels, straddles, ok = self.byte_spans.batch_labels(flat, text_off, [f.text for f in group],
                                                                  [f.spans for f in group])
        ids = np.empty(int(out_off[-1]), dtype=np.int32)
        labels = np.empty_like(ids)
        at = np.arange(len(flat)) + np.repeat(out_off[:-1] - text_off[:-1], n_text)
        ids[at], labels[at] = flat, text_labels
        if eos.any():
            last = out_off[1:][eos] - 1
            ids[last] = self.eos
            trained_eos = np.fromiter((bool(f.spans) for f in group), bool, n)[eos]
            labels[last] = np.where(trained_eos, self.eos, IGNORE_INDEX)  # trained when the sample has spans
        trained = np.zeros(len(labels) + 1, dtype=np.int64)
        np.cumsum(labels != IGNORE_INDEX, out=trained[1:])
        has_trained = trained[out_off[1:]] > trained[out_off[:-1]]
        out = []
        for k, f in enumerate(group):
            if ok[k]:
                s, e = out_off[k], out_off[k + 1]
                out.append(Encoded(ids[s:e], labels[s:e], int(straddles[k]), bool(has_trained[k])))
            else:  # a byte with no token of its own: this sample needs the offsets
                out.append(self._with_offsets(f, self.backend.encode(f.text, add_special_tokens=f.add_special_tokens)))
        return out

    def _with_offsets(self, f: Formatted, enc: Any) -> Encoded:
        """One sample from an encoding with offsets (:func:`span_labels`), EOS appended."""
        raw = enc.ids
        ids = np.empty(len(raw) + f.add_eos, dtype=np.int32)  # room for EOS: no copy to append it
        ids[: len(raw)] = raw
        labels, straddles = span_labels(ids, enc, f.spans)  # EOS, past every span, stays -100 here
        if f.add_eos:
            ids[-1] = self.eos
            labels[-1] = self.eos if f.spans else IGNORE_INDEX
        return Encoded(ids, labels, straddles, bool((labels != IGNORE_INDEX).any()))

    # -- blocks ------------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> pa.Table:
        """Tokenize a batch. The row count is kept: a skipped sample becomes an empty row, so the
        packing stage can check it received every record of a unit."""
        (out,) = self.stream([batch])
        return out

    def stream(self, blocks: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """``map(self, blocks)``, with the encode thread kept busy across blocks: the stage's thread reads
        the next block and formats its first slice before it labels the last slice of the one before, and
        hands a block on (to be packed, or put in Ray's object store) while the next one encodes.

        Slices in flight, time going down (block ``A`` of two slices, then ``B``; ``F`` format, ``E``
        encode, ``L`` label, ``R`` read the next block, ``>`` hand the block on)::

            this thread    FA0 FA1 LA0 R FB0 LA1 >A  FB1 LB0 ...
            encode thread      EA0 EA1     EB0       EB1

        Blocks come out in order, each once all its slices are labelled; at most two slices are sent and not
        yet labelled, and at most one block with records is read ahead of the one handed on.
        """
        open_blocks: deque[_Block] = deque()
        pending: tuple[_Block, list[tuple[bool | None, list[int], Future]]] | None = None
        for batch in blocks:
            blk = _Block.of(batch)
            open_blocks.append(blk)
            for start in range(0, len(blk.records), self.data.tokenize.batch_size):
                calls = self._format_slice(blk, start)
                blk.submitted += 1
                if pending is not None:
                    self._label(*pending)  # the slice before, while this one encodes
                pending = (blk, calls)
                while open_blocks and open_blocks[0].done:
                    yield self._finish(open_blocks.popleft())
        if pending is not None:
            self._label(*pending)
        while open_blocks:
            yield self._finish(open_blocks.popleft())

    def _finish(self, blk: _Block) -> pa.Table:
        """A block whose slices are all labelled -> its output table; its counters go to the sink."""
        sids, formatted, counts = blk.sids, blk.formatted, blk.counts
        live = [i for i, f in enumerate(formatted) if isinstance(f, Formatted | Pieces)]
        for i in live:  # what the formatter did to a sample (e.g. tools moved into a system turn)
            for key in formatted[i].counters:
                counts.add(key, 1, self.table.where(sids[i]))
        empty = np.zeros(0, dtype=np.int32)
        all_ids, all_labels = [empty] * len(sids), [empty] * len(sids)
        n_kept = n_tokens = 0
        pretokenized = {i: f for i, f in enumerate(formatted) if isinstance(f, Pretokenized)}
        for i, f in self._check_pretokenized(sids, pretokenized, counts).items():  # e.g. convert.py --tokenize output
            all_ids[i], all_labels[i] = f.ids, f.labels
            n_kept, n_tokens = n_kept + 1, n_tokens + len(f.ids)
            counts.add("samples_pretokenized")
        for i in live:
            sample = blk.encoded[i]
            if sample.straddles:
                counts.add("label_span_straddles", sample.straddles, self.table.where(sids[i]))
            if sample.retokenized:
                counts.add("chat_prompt_retokenized", sample.retokenized, self.table.where(sids[i]))
            if not sample.trained:
                self._bad(sids[i], "no trained tokens (nothing to learn from this sample)", counts, "skipped_no_trained_tokens")
                continue
            all_ids[i], all_labels[i] = sample.ids, sample.labels
            n_kept, n_tokens = n_kept + 1, n_tokens + len(sample.ids)
        counts.add("samples_tokenized", n_kept)
        counts.add("tokens", n_tokens)
        self.sink.send(counts)
        return carry_unit_columns(blk.batch, tokenized_table(sids, all_ids, all_labels))


def _ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids alone, in one batch call without offsets (no post-processor tokens)."""
    return [enc.ids for enc in tok.encode_batch_fast(texts, add_special_tokens=False)] if texts else []


def _piece_texts(p: Pieces, segments: list[str], plain: list[str]) -> None:
    """What a chat sample sends to be encoded, appended in order: its segments to ``segments``, its plain
    pieces to ``plain``."""
    for t, c in zip(p.texts, p.control, strict=True):
        if c == SEGMENT:
            segments.append(t)
        elif c < 0:
            plain.append(t)


def _retokenized(group: list[Pieces], plain: Any, known: dict[tuple[str, ...], bool]) -> list[int]:
    """Per sample, how many of its checked stretches (:attr:`Pieces.checks`) encode otherwise in parts than
    whole: one batch call of the ``plain`` tokenizer for the stretches not in ``known`` (results so far, by
    stretch; a few characters around a header's end, so they repeat)."""
    new = list({parts: None for p in group for parts in p.checks if parts not in known})
    if new:
        ids = iter(_ids(plain, [t for parts in new for t in (*parts, "".join(parts))]))
        if len(known) > 1 << 16:
            known.clear()
        for parts in new:
            known[parts] = list(chain.from_iterable(next(ids) for _ in parts)) != next(ids)
    return [sum(known[parts] for parts in p.checks) for p in group]


def _from_pieces(group: list[Pieces], encs: tuple[list[list[int]], list[list[int]]], plain: Any,
                 known: dict[tuple[str, ...], bool]) -> list[Encoded]:
    """Chat samples from their pieces: the text pieces' ids (``encs``, in :func:`_piece_texts` order) and
    control ids joined, labelled where the piece is trained. Example: pieces ``"\n"`` (untrained),
    ``<|im_end|>`` (id 2, trained) with plain ids ``[[198]]`` -> ids ``[198, 2]``, labels ``[-100, 2]``. A
    checked stretch whose parts encode otherwise than the stretch whole counts in ``retokenized``: that
    check runs here, on the stage's own thread, while the encode thread encodes the next slice."""
    out = []
    segments, texts = iter(encs[0]), iter(encs[1])
    for p, retokenized in zip(group, _retokenized(group, plain, known), strict=True):
        parts = [next(segments) if c == SEGMENT else next(texts) if c < 0 else [c] for c in p.control]
        lengths = np.fromiter(map(len, parts), np.int64, len(parts))
        ids = np.fromiter(chain.from_iterable(parts), np.int32, int(lengths.sum()))
        mask = np.repeat(np.fromiter(p.trained, bool, len(parts)), lengths)
        labels = np.where(mask, ids, IGNORE_INDEX).astype(np.int32)
        out.append(Encoded(ids, labels, 0, bool(mask.any()), retokenized))
    return out


@dataclass
class _Block:
    """One block in the tokenizer stage: its records, and their formatted and encoded forms as its slices
    come back from the encode thread."""

    batch: pa.Table  # one row per record (unit columns repeated)
    sids: list[int]
    records: list[str]
    counts: Counts = field(default_factory=Counts)
    formatted: list[Formatted | Pieces | Pretokenized | None] = field(default_factory=list)
    encoded: dict[int, Encoded] = field(default_factory=dict)  # by index into records
    submitted: int = 0  # slices formatted and sent to the encode thread
    labelled: int = 0  # slices labelled

    @classmethod
    def of(cls, batch: pa.Table) -> _Block:
        batch = explode_units(batch)
        return cls(batch, batch.column("sample_id").to_pylist(), batch.column("record").to_pylist())

    @property
    def done(self) -> bool:
        """All its records formatted, and every slice sent labelled."""
        return len(self.formatted) == len(self.records) and self.labelled == self.submitted


def tokenized_table(sample_ids: list[int], ids: list[np.ndarray], labels: list[np.ndarray]) -> pa.Table:
    """The tokenizer stage's output block."""
    return pa.Table.from_arrays(
        [pa.array(sample_ids, pa.int64()), list_array(ids), list_array(labels)], schema=TOKENIZED_SCHEMA
    )
