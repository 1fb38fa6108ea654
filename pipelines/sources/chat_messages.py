"""Chat records -> a typed :class:`Conversation` in the OpenAI messages form that chat templates read.

Accepted, per record (``data.datasets[].type: chat_template``):

* OpenAI messages: ``role``/``content`` (a string, ``null`` next to tool calls, or a list of
  ``{"type": "text", "text"}`` parts), assistant ``tool_calls`` (``{"id"?, "type"?, "function": {"name",
  "arguments"}}``, arguments an object or its JSON string; a flat ``{"name", "arguments"}`` and the
  legacy ``function_call`` too), ``tool`` messages with ``tool_call_id`` and ``name``, reasoning as
  ``reasoning_content`` or ``thinking`` (or a ``<think>...</think>`` block that opens the content), and a
  per-message ``train: true|false`` or ``weight: 1|0``. Record-level ``tools`` (a list, or its JSON
  string) and ``system`` (ShareGPT's system column).
* ShareGPT: ``from``/``value`` with the roles of ``role_map``: ``human``/``gpt``/``system``, and
  ``function_call`` (-> ``tool_call``: the value is a JSON call or a list of them) and ``observation``
  (-> ``tool``), as in Glaive and LLaMA-Factory data.

Worked example (ShareGPT, Glaive)::

    {"from": "human", "value": "Find a recipe"}
    {"from": "function_call", "value": "{\\"name\\": \\"search\\", \\"arguments\\": {\\"q\\": \\"rice\\"}}"}
    {"from": "observation", "value": "{\\"recipes\\": []}"}
    ->
    {"role": "user", "content": "Find a recipe"}
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call00001", "type": "function",
                                                          "function": {"name": "search", "arguments": {"q": "rice"}}}]}
    {"role": "tool", "content": "{\\"recipes\\": []}", "tool_call_id": "call00001", "name": "search"}

A call without an id gets ``call`` and five digits of its place in the conversation (Mistral's template
requires 9 characters), and a tool result without one answers the oldest unanswered call. A key the
format does not know, in a record (outside ``ignore_fields``) or in a message, is a :class:`RecordError`:
raised or skipped and counted (``data.on_bad_record``), never dropped silently.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any

from pipelines.config import DatasetConfig
from pipelines.errors import RecordError

__all__ = ["Conversation", "parse_conversation"]

# Message keys besides the role and content keys.
MESSAGE_KEYS = frozenset({"tool_calls", "function_call", "tool_call_id", "name", "reasoning_content", "thinking",
                          "train", "weight"})
REASONING_KEYS = ("reasoning_content", "thinking")


@dataclass(frozen=True)
class Conversation:
    """Messages as chat templates read them, which of them the record itself marks trained, and tools.

    ``messages[i]`` has ``role`` and ``content`` (a string), and where present ``tool_calls`` (OpenAI form,
    arguments as objects), ``tool_call_id``, ``name`` and ``reasoning`` (the pipeline's key; the template
    gets it under the key it reads). ``train[i]`` is the record's ``train``/``weight`` for message ``i``,
    or None where it says nothing.
    """

    messages: tuple[dict[str, Any], ...]
    train: tuple[bool | None, ...]
    tools: tuple[dict[str, Any], ...] | None


def parse_conversation(rec: dict[str, Any], ds: DatasetConfig) -> Conversation:
    """A chat record as a :class:`Conversation`; :class:`RecordError` naming the key when it is not one."""
    key = ds.messages_field or next((k for k in ("messages", "conversations") if k in rec), None)
    if key is None or key not in rec:
        raise RecordError(f"missing field {ds.messages_field or 'messages/conversations'!r} "
                          f"(has: {', '.join(sorted(rec)) or 'nothing'})")
    unknown = sorted(set(rec) - {key, "tools", "system", *ds.ignore_fields})
    if unknown:
        raise RecordError(f"unknown field {unknown[0]!r} in the record (known: {key}, tools, system; list metadata "
                          "columns in the dataset's ignore_fields)")
    turns = rec[key]
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"field {key!r} should be a non-empty list of turns")
    builder = _Builder(key)
    system = rec.get("system")
    if system is not None and (not isinstance(system, str)):
        raise RecordError(f"field 'system' should be a string, got {type(system).__name__}")
    if system and system.strip():
        builder.add({"role": "system", "content": system}, None)
    for i, turn in enumerate(turns):
        builder.turn(i, turn, ds)
    if not any(m["role"] == "assistant" for m in builder.messages):
        raise RecordError("conversation has no assistant turn")
    return Conversation(tuple(builder.messages), tuple(builder.train), parse_tools(rec.get("tools")))


class _Builder:
    """Messages as they are normalized, with the calls still waiting for a result."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.messages: list[dict[str, Any]] = []
        self.train: list[bool | None] = []
        self.pending: deque[dict[str, Any]] = deque()  # calls without a result yet
        self.calls = 0

    def add(self, msg: dict[str, Any], train: bool | None) -> None:
        self.messages.append(msg)
        self.train.append(train)

    def turn(self, i: int, turn: Any, ds: DatasetConfig) -> None:
        where = f"{self.key}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(f"{where} should be an object, got {type(turn).__name__}")
        rk = ds.role_key or ("role" if "role" in turn else "from")
        ck = ds.content_key or ("content" if "content" in turn else "value")
        unknown = sorted(set(turn) - {rk, ck} - MESSAGE_KEYS)
        if unknown:
            raise RecordError(f"{where}: unknown key {unknown[0]!r} (known: {rk}, {ck}, {', '.join(sorted(MESSAGE_KEYS))})")
        if rk not in turn:
            raise RecordError(f"{where} lacks {rk!r}")
        source_role = turn[rk]
        if source_role not in ds.role_map:
            raise RecordError(f"{where}: unknown role {source_role!r} (known: {', '.join(sorted(ds.role_map))}; "
                              "map it in the dataset's role_map)")
        role = ds.role_map[source_role]
        train = _train_flag(turn, where)
        if train and role not in ("assistant", "tool_call"):
            raise RecordError(f"{where}: train: true on a {role} turn; only assistant turns train "
                              "(data.train_on_inputs trains every turn)")
        content = _content(turn.get(ck), f"{where}.{ck}", allow_none=role in ("assistant", "tool_call"))
        if role == "tool_call":
            self._share_gpt_call(where, content, train)
            return
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            self._assistant(msg, turn, where)
        elif role == "tool":
            self._tool_result(msg, turn, where)
        else:
            for k in ("tool_calls", "function_call", "tool_call_id", "reasoning_content", "thinking"):
                if turn.get(k) is not None:
                    raise RecordError(f"{where}: {k!r} on a {role} turn")
            if turn.get("name") is not None:
                msg["name"] = _string(turn["name"], f"{where}.name")
        self.add(msg, train)

    def _assistant(self, msg: dict[str, Any], turn: dict[str, Any], where: str) -> None:
        reasoning = [k for k in REASONING_KEYS if turn.get(k) is not None]
        if len(reasoning) > 1:
            raise RecordError(f"{where}: both reasoning_content and thinking")
        if reasoning:
            msg["reasoning"] = _string(turn[reasoning[0]], f"{where}.{reasoning[0]}")
        else:
            _split_think(msg)
        calls = turn.get("tool_calls")
        if turn.get("function_call") is not None:
            if calls is not None:
                raise RecordError(f"{where}: both tool_calls and function_call")
            calls = [turn["function_call"]]
        if calls is not None:
            if not isinstance(calls, list):
                raise RecordError(f"{where}.tool_calls should be a list, got {type(calls).__name__}")
            if calls:
                msg["tool_calls"] = [self._call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if turn.get("name") is not None:
            msg["name"] = _string(turn["name"], f"{where}.name")
        if turn.get("tool_call_id") is not None:
            raise RecordError(f"{where}: 'tool_call_id' on an assistant turn")

    def _call(self, call: Any, where: str) -> dict[str, Any]:
        if not isinstance(call, dict):
            raise RecordError(f"{where} should be an object, got {type(call).__name__}")
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise RecordError(f"{where}.function should be an object")
        known = {"id", "type", "function", "index"} if "function" in call else {"id", "type", "name", "arguments"}
        extra = sorted(set(call) - known) or sorted(set(fn) - {"name", "arguments"})
        if extra:
            raise RecordError(f"{where}: unknown key {extra[0]!r} in a tool call")
        name = _string(fn.get("name"), f"{where}.name")
        if not name.strip():
            raise RecordError(f"{where}.name is empty")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as err:
                raise RecordError(f"{where}.arguments is not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(args, dict):
            raise RecordError(f"{where}.arguments should be an object, got {type(args).__name__}")
        self.calls += 1
        call_id = call.get("id")
        call_id = f"call{self.calls:05d}" if call_id is None else _string(call_id, f"{where}.id")
        out = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        self.pending.append(out)
        return out

    def _share_gpt_call(self, where: str, value: str, train: bool | None) -> None:
        """A ShareGPT ``function_call`` turn: joins the assistant turn right before it if that has no calls."""
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise RecordError(f"{where}: a tool_call turn should hold a JSON call ({err.msg} at column {err.colno})") from None
        calls = parsed if isinstance(parsed, list) else [parsed]
        made = [self._call(c, f"{where}[{j}]" if isinstance(parsed, list) else where) for j, c in enumerate(calls)]
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" not in last and self.train[-1] == train:
            last["tool_calls"] = made
        else:
            self.add({"role": "assistant", "content": "", "tool_calls": made}, train)

    def _tool_result(self, msg: dict[str, Any], turn: dict[str, Any], where: str) -> None:
        for k in ("tool_calls", "function_call", "reasoning_content", "thinking"):
            if turn.get(k) is not None:
                raise RecordError(f"{where}: {k!r} on a tool turn")
        call_id, name = turn.get("tool_call_id"), turn.get("name")
        call = None
        if call_id is not None:
            call_id = _string(call_id, f"{where}.tool_call_id")
            call = next((c for c in self.pending if c["id"] == call_id), None)
        elif self.pending:
            call = self.pending[0]
            call_id = call["id"]
        if call is not None:
            self.pending.remove(call)
        if call_id is not None:
            msg["tool_call_id"] = call_id
        if name is not None:
            msg["name"] = _string(name, f"{where}.name")
        elif call is not None:
            msg["name"] = call["function"]["name"]


def _train_flag(turn: dict[str, Any], where: str) -> bool | None:
    """A message's own ``train`` (bool) or ``weight`` (0 or 1), or None."""
    train, weight = turn.get("train"), turn.get("weight")
    if train is not None and weight is not None:
        raise RecordError(f"{where}: both train and weight")
    if train is not None:
        if not isinstance(train, bool):
            raise RecordError(f"{where}.train should be true or false, got {train!r}")
        return train
    if weight is not None:
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight not in (0, 1):
            raise RecordError(f"{where}.weight should be 0 or 1 (per-token loss weights are not supported), got {weight!r}")
        return weight == 1
    return None


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{where} should be a string, got {type(value).__name__}")
    return value


def _content(value: Any, where: str, allow_none: bool) -> str:
    """A message's content as one string: a string, text parts joined, or "" for a None next to tool calls."""
    if value is None:
        if allow_none:
            return ""
        raise RecordError(f"missing {where}")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RecordError(f"{where}[{j}] should be a {{'type': 'text', 'text': ...}} part (only text is supported)")
            texts.append(part["text"])
        return "".join(texts)
    raise RecordError(f"{where} should be a string, got {type(value).__name__}")


def _split_think(msg: dict[str, Any]) -> None:
    """Reasoning written inline, ``"<think>\\nR\\n</think>\\n\\nA"``, becomes ``reasoning="R"``, ``content="A"``
    (the newlines around R and before A go, as Qwen3's template strips them)."""
    content = msg["content"]
    if not content.lstrip().startswith("<think>") or "</think>" not in content:
        return
    inner, _, answer = content.lstrip()[len("<think>"):].partition("</think>")
    msg["reasoning"] = inner.strip("\n")
    msg["content"] = answer.lstrip("\n")


def parse_tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    """A ``tools`` column as OpenAI tool definitions; ShareGPT/Glaive stores a JSON string of a list.

    Example: ``'[{"name": "f"}]'`` -> ``({"type": "function", "function": {"name": "f"}},)``; ``""``, ``"[]"``,
    ``None`` -> None. Anything else is a :class:`RecordError`: tools are never dropped silently.
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
    tools = []
    for j, t in enumerate(value):
        if "function" in t:
            if not isinstance(t["function"], dict) or not isinstance(t["function"].get("name"), str):
                raise RecordError(f"tools[{j}].function should be an object with a string name")
            tools.append(t)
        elif isinstance(t.get("name"), str):
            tools.append({"type": "function", "function": t})
        else:
            raise RecordError(f"tools[{j}] has no name")
    return tuple(tools) or None
