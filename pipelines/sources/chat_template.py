"""``chat_template``: a conversation rendered with the tokenizer's own template, as pieces with exact labels.

A chat sample is not one text to encode but a list of :class:`Pieces`: text, encoded on its own with no
added token recognised, and control tokens (``<|im_start|>``, ``<|eot_id|>``, ``<tool_call>``...), taken
as ids. Three rules decide the pieces:

1. **Control tokens come only from the template.** Every string in the data (content, reasoning, tool
   calls, tool results, tool schemas) has each control string replaced by a private-use character
   before rendering, and back after, so a user who types ``<|im_end|>`` gets the 10 characters, never
   the token. Every control string left in the rendering is the template's own.
2. **A cut at every generation point.** The row is cut where each trained assistant turn's generation
   prompt ends (``add_generation_prompt=True`` on the turns before it), so the prompt tokens are exactly
   what that prompt tokenizes to alone, and the answer's tokens start a new word: ChatML's
   ``"assistant\\n"`` and an answer ``"\\n\\nHi"`` stay ``"\\n"`` | ``"\\n\\n" "Hi"`` instead of merging
   into one ``"\\n\\n\\n"`` that inference would never see. Control tokens already split the text in any
   tokenization, so between cuts the ids are the tokenizer's own.
3. **A turn trains as it is generated.** Turn ``k``'s trained text is what the template renders for it
   after its generation prompt (``render(turns[:k+1])`` past ``render(turns[:k], add_generation_prompt)``:
   reasoning, content, tool calls), up to and with its end marker. Where the whole conversation renders
   the turn or its prompt otherwise (Qwen3 drops earlier turns' reasoning and their empty think blocks,
   gpt-oss drops the analysis of calls once a final answer follows, Mistral drops the system prompt from
   a finished conversation), the turn trains as the conversation renders it, from its generation header
   to its end marker, and is counted (``chat_turns_differ_from_generation``); what of the turn that
   rendering lacks is counted too (``chat_reasoning_not_rendered``...). The alternative, a sample per
   turn in its own inference context, would repeat every earlier turn's tokens once per later turn
   (quadratic in the turns); ``train_turns: last`` trains only the turn whose context always holds.

A cut changes how a later turn's prompt tokenizes only where the tokenizer splits the text at the cut
otherwise when more follows (GPT-2's regex: a trailing ``"\\n\\n"`` is one token, but two before a word).
The tokenizer stage checks each cut before the last trained turn and counts such rows
(``chat_prompt_retokenized``); the first trained turn's prompt always holds.

Worked example (ChatML, user "Hi", assistant "\\n\\nHello"; ``|`` a cut, ``[..]`` a control token,
``^`` trained)::

    [<|im_start|>]user\\nHi[<|im_end|>]\\n[<|im_start|>]assistant\\n | \\n\\nHello[<|im_end|>] | \\n
                                                           ^^^^^^^^^^^^^^^^^^^^^

What a template does not render itself goes where the template can show it, and is counted: tool
schemas in a system turn (``tools_in_system_turn``), tool calls as Hermes ``<tool_call>`` JSON after
the content (``chat_tool_calls_inlined``), reasoning as a ``<think>`` block before it
(``chat_reasoning_inlined``), tool results as user turns in ``<tool_response>`` tags
(``chat_tool_results_as_user``). A template's own error (``raise_exception``) is a :class:`RecordError`.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from typing import Any

from pipelines.config import DataConfig, DatasetConfig
from pipelines.errors import RecordError
from pipelines.sources.chat_messages import REASONING_KEYS, Conversation, parse_conversation

__all__ = ["ChatTemplateFormat", "ControlTokens", "Pieces", "tools_system_text"]

# The private-use plane (U+F0000 on) stands in for control strings inside data while a template renders.
MARK_BASE = 0xF0000
SEGMENT = -2  # Pieces.control of text encoded with the tokenizer's own added tokens
# Text checked on either side of a cut (Pieces.checks). A cut changes a regex pre-tokenizer's words only at
# the cut (the word across it, or the one before it whose end a one-character lookahead decides), so a few
# characters either side show it; the stage caches the results, and short windows repeat.
CHECK_CHARS = 8

# Tool definitions for templates that ignore ``tools=``: the text Qwen2.5 / Hermes templates put in
# their system turn, one JSON schema per line.
TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>"
)
TOOL_CALL_TEXT = "<tool_call>\n{call}\n</tool_call>"  # Hermes / Qwen2.5, for templates that ignore tool_calls
TOOL_RESPONSE_TEXT = "<tool_response>\n{content}\n</tool_response>"
THINK_TEXT = "<think>\n{reasoning}\n</think>\n\n"  # Qwen3 / DeepSeek-R1, for templates that ignore reasoning

_PROBE_TOOL = {"type": "function", "function": {"name": "zqprobefn", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"id": "call00001", "type": "function", "function": {"name": "zqprobefn", "arguments": {}}}
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _template_errors() -> tuple[type[Exception], ...]:
    """What a failing template raises (jinja2 is imported only where a chat template is used)."""
    from jinja2 import TemplateError

    return (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def tools_system_text(tools: list | tuple) -> str:
    """The system-turn text for tool definitions, e.g. ``[{"name": "f"}]`` -> ``... <tools>\\n{"name": "f"}\\n</tools>``."""
    return TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


@dataclass(frozen=True)
class Pieces:
    """A chat sample as the tokenizer stage encodes it, piece by piece: ``texts[i]`` is the control token
    ``control[i]`` where that is >= 0, text encoded with no added token recognised where it is -1, and text
    encoded with the tokenizer's added tokens (all of them the template's) where it is :data:`SEGMENT`;
    ``trained[i]`` says whether its tokens carry labels."""

    texts: tuple[str, ...]
    control: tuple[int, ...]
    trained: tuple[bool, ...]
    counters: tuple[str, ...] = ()
    # Stretches of text between two control tokens, cut before the last trained turn, in their parts: the
    # tokenizer stage checks that the parts encode to what the stretch encodes to whole, since a later
    # turn's prompt holds it whole (GPT-2's regex makes a trailing "\n\n" one token, "\n", "\n" before a word).
    checks: tuple[tuple[str, ...], ...] = ()

    @property
    def text(self) -> str:
        """The rendered conversation."""
        return "".join(self.texts)


class ControlTokens:
    """The tokenizer's added tokens (special or not): what a template may emit as a control token.

    Escaping puts one private-use character per control string into data strings, e.g. with
    ``<|im_end|>`` the 3rd longest: ``"a<|im_end|>b"`` -> ``"a\\U000f0002b"``; :meth:`unescape` undoes it.
    """

    def __init__(self, tokenizer: Any) -> None:
        tokens = sorted(((t.content, i, t) for i, t in tokenizer.added_tokens_decoder.items() if t.content),
                        key=lambda x: (-len(x[0]), x[0]))
        self.ids = {content: i for content, i, _ in tokens}
        self.pattern = re.compile("|".join(re.escape(c) for c, _, _ in tokens) or "(?!)")
        self.mark = {c: chr(MARK_BASE + k) for k, (c, _, _) in enumerate(tokens)}
        self.unmark = {v: c for c, v in self.mark.items()}
        self.marks = re.compile(f"[{chr(MARK_BASE)}-{chr(MARK_BASE + max(len(tokens), 1) - 1)}]")
        self.json_safe = not any(ch in c for c, _, _ in tokens for ch in '"\\\n\t\r\b\f')
        self.lstrip = {c for c, _, t in tokens if t.lstrip}
        self.rstrip = {c for c, _, t in tokens if t.rstrip}

    def escape(self, s: str) -> str:
        if self.marks.search(s):
            raise RecordError(f"text contains private-use character U+{ord(self.marks.search(s).group()):X}, "
                              "which stands in for control tokens while a template renders")
        return self.pattern.sub(lambda m: self.mark[m.group()], s) if self.pattern.search(s) else s

    def escape_all(self, value: Any) -> Any:
        """``value`` with every string in it (dict keys too) escaped; ``value`` itself where none needs it
        (told from its JSON text, one C call, unless a control string holds a character JSON escapes)."""
        if isinstance(value, str):
            return self.escape(value)
        if self.json_safe:
            text = json.dumps(value, ensure_ascii=False)
            if not self.pattern.search(text) and not self.marks.search(text):
                return value
        return self._escape_walk(value)

    def _escape_walk(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, list | tuple):
            return [self._escape_walk(v) for v in value]
        if isinstance(value, dict):
            return {self._escape_walk(k): self._escape_walk(v) for k, v in value.items()}
        return value

    def unescape(self, s: str) -> str:
        return self.marks.sub(lambda m: self.unmark[m.group()], s)


@dataclass(frozen=True)
class Capabilities:
    """What a template renders itself, found once by rendering small probe conversations."""

    tools: bool
    tool_calls: bool
    tool_role: bool
    reasoning_key: str | None
    end_markers: frozenset[str]  # control tokens that end a turn (the EOS token, and what ends probe turns)
    header: str  # what add_generation_prompt appends, e.g. "<|im_start|>assistant\n" ("" for Mistral)


@dataclass(frozen=True)
class _Turn:
    """Where an assistant turn's trained text lies in the rendering, and whether exactly as generated."""

    start: int
    end: int
    exact: bool


class ChatTemplateFormat:
    """Records -> :class:`Pieces` with the tokenizer's chat template (see the module docstring)."""

    def __init__(self, ds: DatasetConfig, data: DataConfig, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RecordError(
                f"dataset {ds.path!r} has type chat_template but tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '?')!r} has no chat template"
            )
        self.ds, self.tok, self.all_trained = ds, tokenizer, data.train_on_inputs
        # What apply_chat_template hands the template: the special tokens and the dataset's own variables.
        # Rendering through transformers' renderer directly skips apply_chat_template's per-call argument work.
        self.template_vars = {**tokenizer.special_tokens_map, **ds.chat_template_kwargs}
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render_jinja, self._errors = render_jinja_template, _template_errors()
        # A dict of named templates (``default``, ``tool_use``) is chosen from as apply_chat_template does.
        named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {"default": tokenizer.chat_template}
        self.templates = (named.get("default") or next(iter(named.values())), named.get("tool_use"))
        self.control = ControlTokens(tokenizer)
        self.generation_markers = any(GENERATION_BLOCK.search(t) for t in self.templates if t)
        self.caps = self._probe()
        ends = sorted(self.caps.end_markers, key=len, reverse=True)
        self._end_marker = re.compile(r"\s*(?:" + "|".join(map(re.escape, ends)) + ")" if ends else "(?!)")
        if not self.generation_markers and self._header_trains():
            raise RecordError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} renders the "
                              "assistant's role header with the answer, not in its generation prompt "
                              "(add_generation_prompt), and has no {% generation %} markers, so the header cannot "
                              "be told from the answer")

    # -- the template -----------------------------------------------------------------------
    def _render(self, msgs: list[dict[str, Any]], tools: list | None, generation_prompt: bool = False) -> str:
        if not msgs:
            return ""
        try:
            rendered, _ = self._render_jinja(conversations=[msgs], tools=tools, chat_template=self._template(tools),
                                             add_generation_prompt=generation_prompt, **self.template_vars)
            return rendered[0]
        except self._errors as err:
            raise RecordError(f"the chat template failed: {type(err).__name__}: {err}") from None

    def _template(self, tools: list | None) -> str:
        return self.templates[1] if tools and self.templates[1] else self.templates[0]

    def _generation_spans(self, msgs: list[dict[str, Any]], tools: list | None) -> list[tuple[int, int]]:
        """The ``{% generation %}`` blocks of the rendered conversation, as transformers finds them."""
        try:
            _, spans = self._render_jinja(conversations=[msgs], tools=tools, chat_template=self._template(tools),
                                          return_assistant_tokens_mask=True, **self.template_vars)
        except self._errors as err:
            raise RecordError(f"the chat template failed: {type(err).__name__}: {err}") from None
        return [tuple(span) for span in spans[0]]

    def _try(self, msgs: list[dict[str, Any]], tools: list | None = None) -> str:
        try:
            return self._render(msgs, tools)
        except RecordError:
            return ""

    def _probe(self) -> Capabilities:
        user = [{"role": "user", "content": "Hi"}]
        call = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
        tools = self._try(user, [_PROBE_TOOL]) not in ("", self._try(user))
        tool_calls = "zqprobefn" in self._try([*user, call])
        answered = call if tool_calls else {"role": "assistant", "content": "ok"}
        result = {"role": "tool", "content": "zqproberesult", "tool_call_id": "call00001", "name": "zqprobefn"}
        tool_role = "zqproberesult" in self._try([*user, answered, result])
        key = next((k for k in REASONING_KEYS
                    if "zqprobereason" in self._try([*user, {"role": "assistant", "content": "ok", k: "zqprobereason"}])),
                   None)
        ends = {self.tok.eos_token} if getattr(self.tok, "eos_token", None) else set()
        for probe in (user, [*user, {"role": "assistant", "content": "ok"}], [*user, call] if tool_calls else user):
            tail = self._try(probe).rstrip()
            last = None
            for m in self.control.pattern.finditer(tail):
                last = m
            if last is not None and last.end() == len(tail):
                ends.add(last.group())
        header = self._try(user)
        header = self._render(user, None, generation_prompt=True)[len(header):] if header else ""
        return Capabilities(tools, tool_calls, tool_role, key, frozenset(ends), header)

    def _header_trains(self) -> bool:
        """Whether a template that adds no generation prompt renders text between a probe's prompt and its
        answer (ChatML without ``add_generation_prompt``: ``<|im_start|>assistant\\n``). Mistral adds none
        and its answer follows ``[/INST]`` directly; gpt-oss adds ``<|start|>assistant``, and the channel
        after it is the model's to generate."""
        if self.caps.header:
            return False
        user = [{"role": "user", "content": "Hi"}]
        prompt = self._render(user, None, generation_prompt=True)
        turn = self._try([*user, {"role": "assistant", "content": "zqprobeanswer"}])
        if not turn.startswith(prompt) or "zqprobeanswer" not in turn:
            return False
        between = turn[len(prompt) : turn.index("zqprobeanswer")]
        return bool(self.control.pattern.sub("", between).strip())

    # -- one record ---------------------------------------------------------------------------
    def __call__(self, rec: dict[str, Any]) -> Pieces:
        conv = parse_conversation(rec, self.ds)
        msgs, index, tools, counters = self._template_messages(conv)
        full = self._render(msgs, tools)
        counters += self._dropped(conv, full)
        if self.all_trained:
            return self._pieces(full, [(0, len(full))], counters)
        trained: list[tuple[int, int]] = []
        marked = self._generation_spans(msgs, tools) if self.generation_markers else None
        chosen = self._trained_turns(conv)
        for k in chosen:
            m = conv.messages[k]
            n_calls = len(m.get("tool_calls", ()))
            turn = self._locate(msgs, index[k], tools, full)
            if turn is None:  # nothing of it in the rendering
                counters += ["chat_turns_not_rendered"] + ["chat_tool_calls_not_rendered"] * n_calls
                continue
            counters.append("chat_turns_trained")
            if not turn.exact:
                counters.append("chat_turns_differ_from_generation")
            missing = self._missing(m, full[turn.start : turn.end])
            counters += missing
            if "chat_tool_calls_not_rendered" not in missing:
                counters += [f"chat_tool_calls_{'trained' if self.ds.train_tool_calls else 'untrained'}"] * n_calls
            if m.get("reasoning", "").strip() and "chat_reasoning_not_rendered" not in missing:
                counters.append(f"chat_reasoning_{'trained' if self.ds.train_reasoning else 'untrained'}")
            untrained = [self._region_of(msgs, index[k], tools, full, key)
                         for key, flag in (("reasoning", self.ds.train_reasoning), ("tool_calls", self.ds.train_tool_calls))
                         if not flag and m.get(key)]
            spans = [(turn.start, turn.end)]
            if marked is not None:  # the template says what trains: its generation blocks inside the turn
                spans = [(max(s, turn.start), min(e, turn.end)) for s, e in marked if s < turn.end and e > turn.start]
            trained += [piece for span in spans for piece in _subtract(span, untrained)]
        for k, m in enumerate(conv.messages):  # turns the record or train_turns leave out
            if m["role"] == "assistant" and k not in chosen and _has_output(m):
                counters += ["chat_turns_untrained"] + ["chat_tool_calls_untrained"] * len(m.get("tool_calls", ()))
        return self._pieces(full, trained, counters)

    def _trained_turns(self, conv: Conversation) -> list[int]:
        """Indices of the assistant turns that train: ``train_turns`` unless the message says otherwise."""
        turns = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant" and _has_output(m)]
        last = turns[-1] if turns else -1
        out = []
        for k in turns:
            own = conv.train[k]
            if own if own is not None else (self.ds.train_turns == "all" or k == last):
                out.append(k)
        return out

    def _template_messages(self, conv: Conversation) -> tuple[list[dict[str, Any]], list[int], list | None, list[str]]:
        """``(messages for the template, index of each message there, tools for the template, counters)``:
        data strings escaped, and what the template does not render put where it can show it."""
        esc, caps = self.control, self.caps
        out: list[dict[str, Any]] = []
        index: list[int] = []
        counters: list[str] = []
        for m in conv.messages:
            m = esc.escape_all(m)
            role = m["role"]
            if role == "assistant":
                t = {"role": "assistant", "content": m["content"]}
                if "reasoning" in m:
                    if caps.reasoning_key:
                        t[caps.reasoning_key] = m["reasoning"]
                    else:
                        t["content"] = THINK_TEXT.format(reasoning=m["reasoning"]) + t["content"]
                        counters.append("chat_reasoning_inlined")
                if "tool_calls" in m:
                    if caps.tool_calls:
                        t["tool_calls"] = m["tool_calls"]
                    else:
                        calls = "\n".join(TOOL_CALL_TEXT.format(call=json.dumps(
                            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False))
                            for c in m["tool_calls"])
                        t["content"] = f"{t['content']}\n{calls}" if t["content"] else calls
                        counters.append("chat_tool_calls_inlined")
                if "name" in m:
                    t["name"] = m["name"]
                index.append(len(out))
                out.append(t)
            elif role == "tool" and not caps.tool_role:
                text = TOOL_RESPONSE_TEXT.format(content=m["content"])
                counters.append("chat_tool_results_as_user")
                if out and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "_tool_results": True})
                index.append(len(out) - 1)
            else:
                index.append(len(out))
                out.append(dict(m))
        for t in out:
            t.pop("_tool_results", None)
        tools = esc.escape_all(list(conv.tools)) if conv.tools else None
        if tools is not None:
            if caps.tools:
                counters.append("tools_rendered_by_template")
            else:
                block = tools_system_text(tools)
                if out[0]["role"] == "system":
                    out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
                else:
                    out.insert(0, {"role": "system", "content": block})
                    index = [i + 1 for i in index]
                tools = None
                counters.append("tools_in_system_turn")
        return out, index, tools, counters

    def _locate(self, msgs: list[dict[str, Any]], i: int, tools: list | None, full: str) -> _Turn | None:
        """Where template message ``i`` (an assistant turn) trains in ``full`` (see the module docstring,
        rule 3): exactly as generated after its generation prompt where the conversation renders it so,
        else as the conversation renders it (:meth:`_in_context`); None where it renders nothing of it."""
        prompt = self._render(msgs[:i], tools, generation_prompt=True)
        alone = full if i == len(msgs) - 1 else self._render(msgs[: i + 1], tools)
        if alone.startswith(prompt) and full.startswith(prompt):
            start, generated = len(prompt), alone[len(prompt):]
            same = _common_prefix(full, start, generated)
            inside = next((m for m in self.control.pattern.finditer(generated) if m.start() < same < m.end()), None)
            if inside is not None:  # <|end|> and <|return|> share "<|": no cut inside a control token
                same = inside.start()
            end = start + len(full[start : start + same].rstrip())
            rest = generated[end - start :]
            if not self.control.pattern.sub("", rest).strip():  # only the end marker or whitespace differs
                marker = self._end_marker.match(full, end)
                if marker and self.control.pattern.match(rest.lstrip()):
                    end = marker.end()
                return _Turn(start, end, exact=True) if end > start else None
        return self._in_context(msgs, i, tools, full)

    def _in_context(self, msgs: list[dict[str, Any]], i: int, tools: list | None, full: str) -> _Turn | None:
        """Turn ``i`` as the whole conversation renders it: the text that changes when the turn's content,
        reasoning and call arguments change, widened back to the generation header before it and on to the
        end marker after it. Example (Qwen3, an earlier turn whose reasoning the template drops): the
        content differs, the header is ``<|im_start|>assistant\\n``, the end ``<|im_end|>``."""
        altered = list(msgs)
        altered[i] = _altered(msgs[i], self.caps.reasoning_key)
        other = self._render(altered, tools)
        head = _common_prefix(full, 0, other)
        tail = 0
        while tail < min(len(full), len(other)) - head and full[-1 - tail] == other[-1 - tail]:
            tail += 1
        lo, hi = head, len(full) - tail
        if hi <= lo:
            return None
        header = self.caps.header
        if header:
            at = full.rfind(header, 0, lo)
            start = at + len(header) if at >= 0 else -1
        else:  # no header (Mistral: the answer follows [/INST]): after the end marker of the turn before it
            start = max((m.end() for m in self.control.pattern.finditer(full, 0, lo) if m.group() in self.caps.end_markers),
                        default=-1)
        marker = next((m for m in self.control.pattern.finditer(full, hi) if m.group() in self.caps.end_markers), None)
        if start < 0 or marker is None:
            return None
        return _Turn(start, marker.end(), exact=False)

    def _missing(self, m: dict[str, Any], text: str) -> list[str]:
        """Counters for what of message ``m`` its rendered turn ``text`` lacks (a template that drops a turn's
        content next to its calls, or its reasoning, or ignores a call)."""
        esc = self.control.escape
        out = []
        if m["content"].strip() and esc(m["content"].strip()) not in text:
            out.append("chat_content_not_rendered")
        if m.get("reasoning", "").strip() and esc(m["reasoning"].strip()) not in text:
            out.append("chat_reasoning_not_rendered")
        calls = m.get("tool_calls", ())
        if any(esc(c["function"]["name"]) not in text for c in calls):
            out += ["chat_tool_calls_not_rendered"] * len(calls)
        return out

    def _dropped(self, conv: Conversation, full: str) -> list[str]:
        """Counters for system, user and tool messages whose content the rendering lacks (Mistral's template
        renders the system prompt only inside the last user turn, so never in a conversation that ends with an
        answer); a content the template JSON-quotes (Llama 3.1's tool results) counts as there."""
        out = []
        for m in conv.messages:
            text = m["content"].strip()
            if m["role"] != "assistant" and text:
                text = self.control.escape(text)
                if text not in full and json.dumps(text, ensure_ascii=False)[1:-1] not in full:
                    out.append(f"chat_{m['role']}_not_rendered")
        return out

    def _region_of(self, msgs: list[dict[str, Any]], i: int, tools: list | None, full: str, key: str) -> tuple[int, int]:
        """Where turn ``i``'s reasoning or tool calls lie in ``full``: the text that changes when the template
        renders the conversation without the reasoning, or with other names and arguments in the calls (a
        template may refuse a conversation whose calls are gone: a tool result must follow a call)."""
        turn = dict(msgs[i])
        if key == "reasoning":
            if self.caps.reasoning_key:
                turn.pop(self.caps.reasoning_key, None)
            else:  # inlined: drop the <think> block from the content
                turn["content"] = turn["content"].split("</think>\n\n", 1)[-1]
        elif self.caps.tool_calls:
            turn["tool_calls"] = [{**c, "function": {"name": f"zqaltcall{j}", "arguments": {"zqalt": j}}}
                                  for j, c in enumerate(turn["tool_calls"])]
        else:  # inlined: drop the <tool_call> blocks from the content
            turn["content"] = turn["content"].split("<tool_call>\n", 1)[0].rstrip("\n")
        other = self._render([*msgs[:i], turn, *msgs[i + 1 :]], tools)
        head = _common_prefix(full, 0, other)
        tail = 0
        while tail < min(len(full), len(other)) - head and full[-1 - tail] == other[-1 - tail]:
            tail += 1
        return head, len(full) - tail

    # -- pieces ------------------------------------------------------------------------------
    def _pieces(self, full: str, trained: list[tuple[int, int]], counters: list[str]) -> Pieces:
        """``full`` cut at the ends of the trained spans, each piece trained or not.

        Where no control string came from the data (no escape in ``full``), a piece is the text between two
        cuts, encoded with the tokenizer's own added tokens (:data:`SEGMENT`): every control string in it is
        the template's. Otherwise the text is cut at control tokens too and encoded with none recognised.
        """
        spans = sorted(trained)
        cuts = sorted({p for span in spans for p in span} - {0, len(full)})
        marks = [(m.start(), m.end()) for m in self.control.pattern.finditer(full)]
        last = spans[-1][0] if spans else 0
        checks = self._checks(full, [c for c in cuts if c <= last], marks)
        if not self.control.marks.search(full):
            bounds = [0, *cuts, len(full)]
            texts = [full[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
            flags = [_inside(spans, a) for a in bounds[:-1]]
            return Pieces(tuple(texts), (SEGMENT,) * len(texts), tuple(flags), tuple(counters), checks)
        texts: list[str] = []
        control: list[int] = []
        pos = 0
        starts: list[int] = []
        for cstart, cend in [*marks, (len(full), len(full))]:
            for cut in [c for c in cuts if pos < c < cstart] + [cstart]:
                if cut > pos:
                    texts.append(full[pos:cut])
                    control.append(-1)
                    starts.append(pos)
                pos = cut
            if cend > cstart:
                texts.append(full[cstart:cend])
                control.append(self.control.ids[full[cstart:cend]])
                starts.append(cstart)
                pos = cend
        return self._finish(texts, control, [_inside(spans, a) for a in starts], counters, checks)

    def _checks(self, full: str, cuts: list[int], marks: list[tuple[int, int]]) -> tuple[tuple[str, ...], ...]:
        """For each cut before the last trained turn that falls in text (not at a control token), the text
        around it, in its parts: up to the control tokens on either side, at most :data:`CHECK_CHARS` from the
        outer cuts, e.g. ``("\\n\\n", "Paris. T")`` after Llama's ``<|end_header_id|>``. The tokenizer stage
        compares the parts' ids with the whole's."""
        out = []
        edges = sorted({p for m in marks for p in m})
        for c in cuts:
            k = bisect.bisect_left(edges, c)
            if k < len(edges) and edges[k] == c:
                continue
            lo = edges[k - 1] if k > 0 else 0
            hi = edges[k] if k < len(edges) else len(full)
            inner = [x for x in cuts if lo < x < hi]
            if inner[0] != c:
                continue  # one check per stretch of text, with all its cuts
            lo, hi = max(lo, inner[0] - CHECK_CHARS), min(hi, inner[-1] + CHECK_CHARS)
            bounds = [lo, *inner, hi]
            out.append(tuple(self.control.unescape(full[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)))
        return tuple(out)

    def _finish(self, texts: list[str], control: list[int], flags: list[bool], counters: list[str],
                checks: tuple[tuple[str, ...], ...]) -> Pieces:
        """Data strings back from their escapes; whitespace that an lstrip/rstrip control token takes, gone."""
        esc = self.control
        for j, cid in enumerate(control):
            if cid >= 0:
                continue
            text = esc.unescape(texts[j])
            if j > 0 and control[j - 1] >= 0 and texts[j - 1] in esc.rstrip:
                text = text.lstrip()
            if j + 1 < len(texts) and control[j + 1] >= 0 and texts[j + 1] in esc.lstrip:
                text = text.rstrip()
            texts[j] = text
        keep = [j for j, t in enumerate(texts) if t]
        return Pieces(tuple(texts[j] for j in keep), tuple(control[j] for j in keep), tuple(flags[j] for j in keep),
                      tuple(counters), checks)


def _inside(spans: list[tuple[int, int]], pos: int) -> bool:
    """Whether ``pos`` lies in one of the sorted, disjoint ``spans``."""
    k = bisect.bisect_right(spans, (pos, float("inf"))) - 1
    return k >= 0 and spans[k][0] <= pos < spans[k][1]


def _altered(t: dict[str, Any], reasoning_key: str | None) -> dict[str, Any]:
    """Template message ``t`` with other data of the same shape: content, reasoning and call arguments."""
    t = dict(t)
    if t.get("content"):
        t["content"] = "zqaltcontent"
    if reasoning_key and t.get(reasoning_key):
        t[reasoning_key] = "zqaltreasoning"
    if t.get("tool_calls"):
        t["tool_calls"] = [{**c, "function": {**c["function"], "arguments": {"zqalt": 1}}} for c in t["tool_calls"]]
    return t


def _has_output(m: dict[str, Any]) -> bool:
    """Whether an assistant message has anything to train: content, a call or reasoning (whitespace is not)."""
    return bool(m["content"].strip() or m.get("tool_calls") or m.get("reasoning", "").strip())


def _common_prefix(a: str, start: int, b: str) -> int:
    """How many characters of ``b`` equal ``a`` from ``start`` on."""
    n = min(len(b), len(a) - start)
    if a.startswith(b[:n], start):
        return n
    lo, hi = 0, n  # a[start:start+lo] == b[:lo]; not so for hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(b[:mid], start):
            lo = mid
        else:
            hi = mid
    return lo


def _subtract(span: tuple[int, int], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``span`` minus ``holes``: ``(0, 10) - [(2, 4)]`` -> ``[(0, 2), (4, 10)]``."""
    out, pos = [], span[0]
    for s, e in sorted(holes):
        if s > pos:
            out.append((pos, min(s, span[1])))
        pos = max(pos, e)
    if pos < span[1]:
        out.append((pos, span[1]))
    return [(s, e) for s, e in out if e > s]
