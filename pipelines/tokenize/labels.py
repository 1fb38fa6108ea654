"""Labels from trained character spans: the one place that maps a format's spans onto tokens.

Two ways, with the same result:

* :func:`span_labels` asks the encoding (``char_to_token``), so it needs the offsets that
  ``Tokenizer.encode_batch`` computes for every token.
* :class:`ByteSpans` needs no offsets. In a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2)
  every token stands for a fixed byte string, so a text's tokens tile its UTF-8 bytes in order and
  the cumulative byte lengths of the ids say where each token starts. The ids can then come from
  ``encode_batch_fast``, which skips the offsets and is faster (docs/design.md, "Placement and timing
  notes"). :meth:`ByteSpans.for_tokenizer` returns None for any tokenizer where that
  tiling does not hold (a normalizer, a prefix space, stripped added tokens, a pre-tokenizer that drops
  text, a vocabulary outside the byte alphabet), and the offsets path is used. A byte that has no
  token of its own is dropped by the model; that shows per sample (:meth:`ByteSpans.labels` is None)
  and only that sample takes the offsets path.

Worked example (GPT-2, text ``"Hi there"``, span ``(2, 8)``, i.e. ``" there"``): ids ``[17250, 612]``
stand for ``b"Hi"`` and ``b" there"``, byte lengths ``[2, 6]``, token ends ``[2, 8]``; the span's
bytes ``[2, 8)`` start in token 1 and end in token 1, so labels ``[-100, 612]``, no straddle.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pipelines.tokenize.tokenizer import IGNORE_INDEX

__all__ = ["ByteSpans", "span_labels"]


def _first_token(enc: Any, start: int, end: int, step: int) -> int | None:
    """Token index of the first (step=1) or last (step=-1) character in [start, end) that maps to one."""
    rng = range(start, end) if step == 1 else range(end - 1, start - 1, -1)
    for pos in rng:
        tok = enc.char_to_token(pos)
        if tok is not None:
            return tok
    return None


def span_labels(ids: np.ndarray, enc: Any, spans: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Labels (``ids`` where a token overlaps a trained span, else -100) and the number of straddles.

    A token that straddles a span's start (GPT-2 merges a prompt's trailing ``"\n"`` with a
    response's leading ``"\n\n"`` into one ``"\n\n\n"`` token) is trained, since it holds response
    text; such cases are counted (``label_span_straddles``) so a template can be fixed if they are common.
    """
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
    straddles = 0
    for start, end in spans:
        first = _first_token(enc, start, end, 1)
        if first is None:
            continue
        last = _first_token(enc, start, end, -1)
        labels[first : last + 1] = ids[first : last + 1]
        straddles += enc.token_to_chars(first)[0] < start  # not enc.offsets: that builds every token's pair
    return labels, straddles


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte (tokenizers' ByteLevel)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_CHARS = frozenset(_bytes_to_unicode())


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizer component (pre-tokenizer, post-processor) as its tokenizer.json object, or None."""
    return None if component is None else json.loads(component.__getstate__())


def _keeps_bytes(pre: dict[str, Any]) -> bool:
    """Whether one pre-tokenizer (tokenizer.json form) only splits: no bytes added, dropped or changed."""
    kind = pre.get("type")
    if kind == "ByteLevel":
        return not pre.get("add_prefix_space", False)
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior") != "Removed"
    return kind == "Digits"


def _byte_level_pre(pre: dict[str, Any] | None) -> bool:
    """ByteLevel, alone or in a Sequence of pre-tokenizers that all keep every byte."""
    parts = (pre or {}).get("pretokenizers", []) if (pre or {}).get("type") == "Sequence" else [pre or {}]
    return any(p.get("type") == "ByteLevel" for p in parts) and all(_keeps_bytes(p) for p in parts)


def _untrimmed_post(post: dict[str, Any] | None) -> bool:
    """A post-processor that leaves offsets whole (a trimmed offset would map no token to a space)."""
    parts = (post or {}).get("processors", []) if (post or {}).get("type") == "Sequence" else [post] if post else []
    return all(p.get("type") == "TemplateProcessing" or (p.get("type") == "ByteLevel" and not p.get("trim_offsets"))
               for p in parts)


class ByteSpans:
    """Labels of a byte-level BPE tokenizer's ids from their byte lengths (no offsets needed).

    Gives exactly what :func:`span_labels` gives on the same text (tested on every corpus and
    tokenizer in ``../shared/data`` and on multi-byte text, ``tests/test_labels.py``).
    """

    def __init__(self, byte_lengths: np.ndarray, adds_special_tokens: bool) -> None:
        self.byte_lengths = byte_lengths  # per id; int64
        self.adds_special_tokens = adds_special_tokens  # the post-processor inserts tokens with no text

    @classmethod
    def for_tokenizer(cls, tok: Any) -> ByteSpans | None:
        """For a ``tokenizers.Tokenizer`` whose tokens tile the text's bytes, else None."""
        if not hasattr(tok, "encode_batch_fast") or tok.model.__class__.__name__ != "BPE":
            return None
        if tok.model.continuing_subword_prefix or tok.model.end_of_word_suffix:
            return None  # "##ab" stands for 2 bytes, not 4
        if (tok.normalizer is not None or not _byte_level_pre(_state(tok.pre_tokenizer))
                or not _untrimmed_post(_state(tok.post_processor))):
            return None
        vocab = tok.get_vocab(with_added_tokens=False)  # the model's own tokens, as byte-level strings
        if not set("".join(vocab)) <= _BYTE_CHARS:
            return None  # not a byte-level vocabulary
        lengths = np.full(tok.get_vocab_size(with_added_tokens=True), -1, dtype=np.int64)
        lengths[np.fromiter(vocab.values(), np.int64, len(vocab))] = np.fromiter(map(len, vocab), np.int64, len(vocab))
        for i, added in tok.get_added_tokens_decoder().items():  # matched in the raw text, before the model
            if added.lstrip or added.rstrip or i >= len(lengths):
                return None  # stripped whitespace would not be in the token's bytes
            lengths[i] = len(added.content.encode("utf-8"))
        if (lengths < 0).any():
            return None
        post = tok.post_processor
        adds = bool(post is not None and post.num_special_tokens_to_add(False))
        lengths.flags.writeable = False  # shared by the stages of one backend (pipelines.tokenize.stage.byte_spans)
        return cls(lengths, adds)

    def usable(self, add_special_tokens: bool) -> bool:
        """Whether ids encoded with this flag tile the text (no post-processor tokens in between)."""
        return not (add_special_tokens and self.adds_special_tokens)

    def labels(self, ids: np.ndarray, n_text: int, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, int] | None:
        """As :func:`span_labels`, for ``ids`` whose first ``n_text`` come from ``text`` (the rest, e.g.
        EOS, stay -100); :meth:`batch_labels` for one sample. None when the ids do not tile the text."""
        offsets = np.array([0, n_text], dtype=np.int64)
        text_labels, straddles, ok = self.batch_labels(np.asarray(ids[:n_text]), offsets, [text], [spans])
        if not ok[0]:
            return None
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
        labels[:n_text] = text_labels
        return labels, int(straddles[0])

    def batch_labels(self, ids: np.ndarray, offsets: np.ndarray, texts: list[str],
                     spans: list[list[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Labels of a batch of samples at once: ``ids`` (flat) holds sample ``k``'s text ids at
        ``offsets[k]:offsets[k + 1]``, encoded from ``texts[k]``, trained where ``spans[k]`` say.

        Returns flat labels (as ``ids``), straddles per sample and, per sample, whether its ids tile its
        text's bytes (where not, its labels are all -100 here and the caller needs the offsets).
        Per sample as :func:`span_labels`: the token holding a span's first byte to the token holding
        its last character's first byte (as ``char_to_token`` of the last character), and whether that
        first token starts before the span (a straddle).

        The token ends are one cumulative sum over the whole batch, so a sample's byte ``b`` is
        ``base[k] + b`` there. Example: samples ``"Hi there"`` (ids ``[17250, 612]``, bytes ``[2, 6]``) and
        ``"ok"`` (``[482]``, ``[2]``): ends ``[2, 8, 10]``, bases ``[0, 8]``; the second sample's span
        ``(0, 2)`` covers bytes ``[8, 9]`` of the batch, which fall in token 2.
        """
        n = len(texts)
        ends0 = np.zeros(len(ids) + 1, dtype=np.int64)  # ends0[j]: bytes before token j
        lengths = self.byte_lengths[ids]
        np.cumsum(lengths, out=ends0[1:])
        ends = ends0[1:]
        base = ends0[offsets[:-1]]
        ascii_text = [t.isascii() for t in texts]
        text_bytes = np.fromiter((len(t) if a else len(t.encode("utf-8")) for t, a in zip(texts, ascii_text, strict=True)),
                                 np.int64, n)
        ok = ends0[offsets[1:]] - base == text_bytes
        owner: list[int] = []  # per span: its sample, its first and last byte in the sample's text
        b0: list[int] = []
        b1: list[int] = []
        for k in np.flatnonzero(ok & (offsets[1:] > offsets[:-1])).tolist():
            text, a = texts[k], ascii_text[k]
            for start, end in spans[k]:
                if end > start:
                    owner.append(k)
                    b0.append(start if a else len(text[:start].encode("utf-8")))
                    b1.append(end - 1 if a else len(text[: end - 1].encode("utf-8")))
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
        straddles = np.zeros(n, dtype=np.int64)
        if not owner:
            return labels, straddles, ok
        k = np.array(owner, dtype=np.int64)
        lo = base[k] + np.array(b0, dtype=np.int64)
        first = np.searchsorted(ends, lo, side="right")  # every earlier sample's ends are <= base[k]
        last = np.searchsorted(ends, base[k] + np.array(b1, dtype=np.int64), side="right")
        stop = offsets[1:][k]
        keep = first < stop  # a span past the sample's last token trains nothing
        k, lo, first, last = k[keep], lo[keep], first[keep], np.minimum(last[keep], stop[keep] - 1)
        straddles += np.bincount(k, weights=ends[first] - lengths[first] < lo, minlength=n).astype(np.int64)
        cover = np.zeros(len(ids) + 1, dtype=np.int64)  # +1 at each span's first token, -1 after its last
        np.add.at(cover, first, 1)
        np.add.at(cover, last + 1, -1)
        trained = np.cumsum(cover[:-1]) > 0
        labels[trained] = ids[trained]
        return labels, straddles, ok
