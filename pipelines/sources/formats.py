"""Formats: turn one record into text plus the character spans that carry labels.

Every format produces a :class:`Formatted`: the full text to tokenize and the ``[start, end)``
character spans whose tokens are trained. The tokenizer stage labels a token when its first
character falls inside a span, so label masks follow the real tokenization of the whole text
(no re-tokenizing pieces that would merge differently at their borders).

Worked example (``alpaca``, ``train_on_inputs: false``)::

    {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
    text  = "Below is an instruction ...\\n\\n### Instruction:\\nAdd 2 and 3.\\n\\n### Response:\\n5"
    spans = [(len(text) - 1, len(text))]          # only "5"; EOS is appended after it, trained too

``chat_template`` is the exception: a conversation is rendered by the tokenizer's template and handed on
as :class:`pipelines.sources.chat_template.Pieces` (text encoded piece by piece, control tokens as ids).

A record that cannot be formatted raises :class:`RecordError` with the reason; the caller adds the
file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipelines.config import DataConfig, DatasetConfig
from pipelines.errors import RecordError
from pipelines.sources.chat_template import ChatTemplateFormat

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
# Earlier turns of a multi-turn alpaca record (LIMA's ``history``) follow the same pattern.
ALPACA_TURN = "### Instruction:\n{instruction}\n\n### Response:\n"


@dataclass
class Formatted:
    """Text to tokenize, the trained character spans, and whether EOS follows (trained)."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    add_eos: bool = False
    add_special_tokens: bool = True
    counters: tuple[str, ...] = ()  # telemetry keys this sample adds to, e.g. ("tools_in_system_turn",)


def _field(rec: dict[str, Any], key: str, *, required: bool = True, allow_empty: bool = False) -> str:
    if key not in rec or rec[key] is None:
        if required:
            raise RecordError(f"missing field {key!r} (has: {', '.join(sorted(rec)) or 'nothing'})")
        return ""
    value = rec[key]
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} should be a string, got {type(value).__name__}")
    if required and not allow_empty and not value.strip():
        raise RecordError(f"field {key!r} is empty")
    return value


class CompletionFormat:
    """Plain text; every token trained; EOS appended."""

    def __init__(self, ds: DatasetConfig, data: DataConfig, tokenizer: Any) -> None:
        self.key, self.add_eos = ds.text_field, data.add_eos

    def __call__(self, rec: dict[str, Any]) -> Formatted:
        text = _field(rec, self.key)
        return Formatted(text, [(0, len(text))], add_eos=self.add_eos)


class AlpacaFormat:
    """instruction / input / output with the documented Alpaca prompt; optional ``history`` turns."""

    def __init__(self, ds: DatasetConfig, data: DataConfig, tokenizer: Any) -> None:
        self.ds, self.all_trained, self.add_eos = ds, data.train_on_inputs, data.add_eos

    def _history(self, rec: dict[str, Any]) -> list[tuple[str, str]]:
        key = self.ds.history_field
        turns = rec.get(key) if key else None
        if not turns:
            return []
        if not isinstance(turns, list) or not all(
            isinstance(t, list | tuple) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in turns
        ):
            raise RecordError(f"field {key!r} should be a list of [user, assistant] string pairs")
        return [(u, a) for u, a in turns]

    def __call__(self, rec: dict[str, Any]) -> Formatted:
        instruction = _field(rec, self.ds.instruction_field)
        inp = _field(rec, self.ds.input_field, required=False)
        output = _field(rec, self.ds.output_field)
        parts: list[tuple[str, bool]] = []
        history = self._history(rec)
        for i, (user, assistant) in enumerate(history):
            head = ALPACA_PROMPT_NO_INPUT if i == 0 else ALPACA_TURN
            parts += [(head.format(instruction=user), False), (assistant, True), ("\n\n", False)]
        if history:
            prompt = ALPACA_TURN.format(instruction=instruction if not inp else f"{instruction}\n\n{inp}")
        elif inp.strip():
            prompt = ALPACA_PROMPT.format(instruction=instruction, input=inp)
        else:
            prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
        parts += [(prompt, False), (output, True)]
        return _join(parts, self.all_trained, self.add_eos)


def _join(parts: list[tuple[str, bool]], all_trained: bool, add_eos: bool) -> Formatted:
    """Concatenate ``(text, trained)`` parts into text and merged trained spans."""
    text, spans, pos = [], [], 0
    for piece, trained in parts:
        if (trained or all_trained) and piece:
            spans.append((pos, pos + len(piece)))
        text.append(piece)
        pos += len(piece)
    return Formatted("".join(text), _merge(spans), add_eos=add_eos)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in spans:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(e, out[-1][1]))
        else:
            out.append((s, e))
    return out


class InputOutputFormat:
    """Pre-rendered segments ``[{"text": ..., "label": true|false}, ...]``; no EOS added."""

    def __init__(self, ds: DatasetConfig, data: DataConfig, tokenizer: Any) -> None:
        self.key, self.all_trained = ds.segments_field, data.train_on_inputs

    def __call__(self, rec: dict[str, Any]) -> Formatted:
        segs = rec.get(self.key)
        if segs is None:
            raise RecordError(f"missing field {self.key!r}")
        if not isinstance(segs, list) or not segs:
            raise RecordError(f"field {self.key!r} should be a non-empty list of {{text, label}} segments")
        parts = []
        for i, seg in enumerate(segs):
            if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
                raise RecordError(f"{self.key}[{i}] should be an object with a string 'text'")
            label = seg.get("label", False)
            if not isinstance(label, bool):
                raise RecordError(f"{self.key}[{i}].label should be true or false, got {label!r}")
            parts.append((seg["text"], label))
        text = "".join(p for p, _ in parts)
        if not text.strip():
            raise RecordError(f"field {self.key!r} holds only empty text")
        spans, pos = [], 0
        for piece, trained in parts:
            if (trained or self.all_trained) and piece:
                spans.append((pos, pos + len(piece)))
            pos += len(piece)
        return Formatted(text, _merge(spans), add_eos=False)


FORMATS = {
    "completion": CompletionFormat,
    "alpaca": AlpacaFormat,
    "input_output": InputOutputFormat,
    "chat_template": ChatTemplateFormat,
}


def make_formatter(ds: DatasetConfig, data: DataConfig, tokenizer: Any):
    """The formatter for a dataset entry: ``record dict -> Formatted`` (``Pieces`` for chat_template)."""
    return FORMATS[ds.type](ds, data, tokenizer)
