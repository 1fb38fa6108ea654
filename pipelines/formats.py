"""Formats: turn one record into text plus the character spans that carry labels.

Every format produces a :class:`Formatted`: the full text to tokenize and the ``[start, end)``
character spans whose tokens are trained. The tokenizer stage labels a token when its first
character falls inside a span, so label masks follow the real tokenization of the whole text
(no re-tokenizing pieces that would merge differently at their borders).

Worked example (``alpaca``, ``train_on_inputs: false``)::

    {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
    text  = "Below is an instruction ...\\n\\n### Instruction:\\nAdd 2 and 3.\\n\\n### Response:\\n5"
    spans = [(len(text) - 1, len(text))]          # only "5"; EOS is appended after it, trained too

A record that cannot be formatted raises :class:`RecordError` with the reason; the caller adds the
file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pipelines.config import DataConfig, DatasetConfig

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


class RecordError(ValueError):
    """A record that cannot be formatted; the message says why (the caller adds where)."""


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


class ChatTemplateFormat:
    """Conversations rendered with the tokenizer's own chat template; trained roles located by span.

    Each turn is located in the template's own rendering of growing prefixes of the conversation:
    turn ``i`` is ``render(msgs[:i+1])[len(render(msgs[:i])):]``. Where its content sits inside that
    text is found by rendering the same prefix with the content replaced by a marker
    (:data:`CONTENT_MARKER`): the text before the marker is the role header, the text after it the end
    of the turn. The trained part runs from the content to the turn's end marker, e.g. for ChatML
    ``<|im_start|>assistant\\nHi!<|im_end|>\\n`` the trained text is ``Hi!<|im_end|>``; for a
    Llama-3 template that trims the content, ``"Paris.\\n"`` trains ``Paris.<|eot_id|>``. No search
    for the content text is involved, so an answer such as ``"a"`` (which also occurs in
    ``assistant``) cannot match inside the header. A turn whose span cannot be located exactly
    (the template renders the header differently around other content, or changes the content
    beyond trimming whitespace) is a :class:`RecordError`: raised, or skipped and counted under
    ``data.on_bad_record: skip``; never guessed. This works for templates with ``{% generation %}``
    markers and without.

    Tool definitions (a ``tools`` column: a list, or a JSON string of one as in ShareGPT/Glaive) go to
    the template as ``tools=`` when the template renders them; a template that ignores them gets them
    as a system turn instead (:data:`TOOLS_SYSTEM_PROMPT`, appended to the conversation's first
    system turn or added as one), so the schemas the calls refer to are always in the training text.
    Each sample is counted under ``tools_rendered_by_template`` or ``tools_in_system_turn``.
    """

    def __init__(self, ds: DatasetConfig, data: DataConfig, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RecordError(
                f"dataset {ds.path!r} has type chat_template but tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '?')!r} has no chat template"
            )
        self.ds, self.tok, self.all_trained = ds, tokenizer, data.train_on_inputs
        self.train_roles = set(ds.roles_to_train)

    def _messages(self, rec: dict[str, Any]) -> list[dict[str, str]]:
        key = self.ds.messages_field or next((k for k in ("messages", "conversations") if k in rec), None)
        if key is None or key not in rec:
            raise RecordError(f"missing field {self.ds.messages_field or 'messages/conversations'!r}")
        turns = rec[key]
        if not isinstance(turns, list) or not turns:
            raise RecordError(f"field {key!r} should be a non-empty list of turns")
        msgs = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise RecordError(f"{key}[{i}] should be an object, got {type(turn).__name__}")
            rk = self.ds.role_key or ("role" if "role" in turn else "from")
            ck = self.ds.content_key or ("content" if "content" in turn else "value")
            if rk not in turn or ck not in turn:
                raise RecordError(f"{key}[{i}] lacks {rk!r} or {ck!r}")
            role, content = turn[rk], turn[ck]
            if role not in self.ds.role_map:
                raise RecordError(f"{key}[{i}]: unknown role {role!r} (known: {', '.join(sorted(self.ds.role_map))})")
            if not isinstance(content, str):
                raise RecordError(f"{key}[{i}].{ck} should be a string, got {type(content).__name__}")
            msgs.append({"role": self.ds.role_map[role], "content": content})
        if not any(m["role"] in self.train_roles for m in msgs):
            raise RecordError(f"conversation has no {'/'.join(sorted(self.train_roles))} turn")
        return msgs

    def _render(self, msgs: list[dict[str, str]], tools: list | None) -> str:
        if not msgs:
            return ""
        return self.tok.apply_chat_template(msgs, tools=tools, tokenize=False)

    def _with_tools(self, msgs: list[dict[str, str]], tools: list | None) -> tuple[list, list | None, str | None]:
        """``(messages, tools for the template, counter)``: tools by the template, or in a system turn."""
        if tools is None:
            return msgs, None, None
        if self._render(msgs, tools) != self._render(msgs, None):
            return msgs, tools, "tools_rendered_by_template"
        block = tools_system_text(tools)
        if msgs[0]["role"] == "system":
            msgs = [{"role": "system", "content": f"{msgs[0]['content']}\n\n{block}"}, *msgs[1:]]
        else:
            msgs = [{"role": "system", "content": block}, *msgs]
        return msgs, None, "tools_in_system_turn"

    def _content_span(self, msgs: list[dict[str, str]], i: int, cur: str, tools: list | None) -> tuple[int, int]:
        """``[start, end)`` of turn ``i``'s trained text in ``cur`` (= the rendering of ``msgs[:i+1]``)."""
        probe = self._render([*msgs[:i], {**msgs[i], "content": CONTENT_MARKER}], tools)
        head, found, tail = probe.partition(CONTENT_MARKER)
        where = f"{msgs[i]['role']} turn {i}"
        if not found or CONTENT_MARKER in tail:
            raise RecordError(f"{where}: the chat template does not render a turn's content as given, so its "
                              "labels cannot be located; use input_output segments for this template")
        start, end = len(head), len(cur) - len(tail)
        if not (cur.startswith(head) and cur.endswith(tail) and start <= end
                and cur[start:end].strip() == msgs[i]["content"].strip()):
            raise RecordError(f"{where}: cannot locate the content in the chat template's rendering "
                              "(the template renders this turn's header or content differently); not trained "
                              "rather than guessed")
        return start, len(cur.rstrip())

    def __call__(self, rec: dict[str, Any]) -> Formatted:
        msgs, tools, counter = self._with_tools(self._messages(rec), _tools(rec.get("tools")))
        counters = (counter,) if counter else ()
        rendered = [self._render(msgs[: i + 1], tools) for i in range(len(msgs))]
        full = rendered[-1]
        if self.all_trained:
            return Formatted(full, [(0, len(full))], add_special_tokens=False, counters=counters)
        spans, prev = [], ""
        for i, (msg, cur) in enumerate(zip(msgs, rendered, strict=True)):
            if not cur.startswith(prev) or not full.startswith(cur):
                raise RecordError("the chat template does not render conversations prefix-by-prefix; "
                                  "use input_output segments for this template")
            # An empty or whitespace-only turn trains nothing (not even its end marker); a sample left
            # with no trained tokens is counted as such.
            if msg["role"] in self.train_roles and msg["content"].strip():
                start, end = self._content_span(msgs, i, cur, tools)
                if end > start:
                    spans.append((start, end))
            prev = cur
        return Formatted(full, spans, add_special_tokens=False, counters=counters)


# Stands in for a turn's content to find where the template puts it: letters and digits only, so
# templates that trim or strip the content leave it as it is.
CONTENT_MARKER = "Zq7PipelinesContentMarker4Xv"

# Tool definitions for templates that ignore ``tools=``: the text Qwen2.5 / Hermes templates put in
# their system turn, one JSON schema per line.
TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>"
)


def tools_system_text(tools: list) -> str:
    """The system-turn text for tool definitions, e.g. ``[{"name": "f"}]`` -> ``... <tools>\\n{"name": "f"}\\n</tools>``."""
    return TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _tools(value: Any) -> list | None:
    """A ``tools`` column as a list (ShareGPT/Glaive stores it as a JSON string); empty -> None.

    Example: ``'[{"name": "f"}]'`` -> ``[{"name": "f"}]``; ``""``, ``"[]"``, ``None`` -> ``None``.
    Anything else is a :class:`RecordError`: tools are never dropped silently.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RecordError(f"field 'tools' is not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RecordError(f"field 'tools' should be a list of tool definitions (objects), got {type(value).__name__}")
    return value or None


FORMATS = {
    "completion": CompletionFormat,
    "alpaca": AlpacaFormat,
    "input_output": InputOutputFormat,
    "chat_template": ChatTemplateFormat,
}


def make_formatter(ds: DatasetConfig, data: DataConfig, tokenizer: Any):
    """The formatter for a dataset entry: ``record dict -> Formatted``."""
    return FORMATS[ds.type](ds, data, tokenizer)
