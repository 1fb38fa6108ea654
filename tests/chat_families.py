"""Tokenizers for six model families' chat templates, built at test time from the shared vocabularies.

Each family (:data:`FAMILIES`) has a published chat template in ``tests/fixtures/chat_templates/<family>.jinja``
(its header says which published file it is and what, if anything, was changed) and an entry in
``tests/fixtures/chat_templates/families.json``: the base vocabulary (``smollm2``: the SmolLM2 byte-level BPE of
../shared/data, or ``gpt2``), the family's control tokens as added tokens (with the ``special`` flag of the real
tokenizer), and its bos/eos/pad tokens. :func:`family_tokenizer` writes a Hugging Face tokenizer directory with
all of that; the real tokenizer files are never copied into the project.

:func:`agent_trace` is one deterministic multi-turn agent conversation in OpenAI format (tools, reasoning,
two tool calls and results, a final answer) to render with them.
"""

from __future__ import annotations

import copy
import inspect
import json
from functools import cache
from pathlib import Path
from typing import Any

from conftest import SHARED

__all__ = ["FAMILIES", "TEMPLATES", "agent_trace", "agent_traces", "control_strings", "family_spec", "family_tokenizer", "template_text"]

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
FAMILIES: tuple[str, ...] = ("qwen2_5", "qwen3", "llama3_1", "mistral", "gemma3", "gpt_oss")
_VOCABS = {"smollm2": "smollm2-135m-instruct", "gpt2": "gpt2"}


@cache
def _families() -> dict[str, dict[str, Any]]:
    return json.loads((TEMPLATES / "families.json").read_text(encoding="utf-8"))


def family_spec(family: str) -> dict[str, Any]:
    """The family's entry of ``families.json`` (a copy)."""
    if family not in FAMILIES:
        raise KeyError(f"unknown chat family {family!r}; one of {FAMILIES}")
    return copy.deepcopy(_families()[family])


def template_text(family: str) -> str:
    """The family's chat template, as ``<family>.jinja`` has it."""
    family_spec(family)
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def family_tokenizer(family: str, root: Path) -> Path:
    """Write the family's tokenizer to ``root / family`` and return that directory.

    The shared base vocabulary loaded with ``AutoTokenizer``, plus the family's added tokens (special ones as
    additional special tokens, the others as plain added tokens, all ``normalized=False``), its bos/eos/pad
    tokens (``None`` where the real tokenizer has none) and its chat template.
    """
    from transformers import AddedToken, AutoTokenizer

    spec = family_spec(family)
    tok = AutoTokenizer.from_pretrained(str(SHARED / "tokenizers" / _VOCABS[spec["vocab"]]))
    added = spec["added_tokens"]
    special = [AddedToken(t["content"], special=True, normalized=False) for t in added if t["special"]]
    plain = [AddedToken(t["content"], special=False, normalized=False) for t in added if not t["special"]]
    if special:  # kept as special tokens (skipped by decode(skip_special_tokens=True)), never split
        if "replace_extra_special_tokens" in inspect.signature(tok.add_special_tokens).parameters:  # transformers 5
            tok.add_special_tokens({"extra_special_tokens": special}, replace_extra_special_tokens=False)
        else:
            tok.add_special_tokens({"additional_special_tokens": special}, replace_additional_special_tokens=False)
    if plain:
        tok.add_tokens(plain)
    tok.bos_token = spec.get("bos_token")
    tok.eos_token = spec.get("eos_token")
    tok.pad_token = spec.get("pad_token")
    tok.chat_template = template_text(family)
    out = Path(root) / family
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def control_strings(family: str) -> list[str]:
    """Every control token the family's template may emit: its added tokens (the base vocabulary's own
    specials that the template uses, such as ``<|im_start|>``, are listed among them) and its bos/eos/pad."""
    spec = family_spec(family)
    out = [t["content"] for t in spec["added_tokens"]]
    for key in ("bos_token", "eos_token", "pad_token"):
        value = spec.get(key)
        if value and value not in out:
            out.append(value)
    return out


_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather_forecast",
            "description": "Get the daily weather forecast for a city on a given date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Lisbon"},
                    "date": {"type": "string", "description": "Date in YYYY-MM-DD format"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
                },
                "required": ["city", "date"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_air_quality",
            "description": "Get the current air quality index (AQI) and dominant pollutant for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Lisbon"}},
                "required": ["city"],
            },
        },
    },
]

SYSTEM = "You are a concise travel assistant. Use the tools to check facts before answering."
QUESTION = "I'm cycling around Lisbon tomorrow (2025-06-14). Will it rain, and is the air clean enough to ride?"
REASONING_1 = "The user wants tomorrow's forecast for Lisbon and the air quality. Start with the forecast."
REASONING_FINAL = "Rain chance is 10% and AQI is 32 (good), so cycling conditions look fine. Mention the wind."
ANSWER = (
    "Tomorrow in Lisbon looks dry: 24 °C, only a 10% chance of rain and a light 14 km/h north wind. "
    "The air quality is good (AQI 32, mostly ozone), so it is a fine day for a ride."
)
WEATHER_RESULT = (
    '{"city": "Lisbon", "date": "2025-06-14", "condition": "sunny", "high_c": 24, "low_c": 17, '
    '"precipitation_chance": 0.1, "wind_kmh": 14, "wind_direction": "N"}'
)
AIR_RESULT = '{"city": "Lisbon", "aqi": 32, "category": "good", "dominant_pollutant": "o3"}'


def agent_trace() -> dict[str, Any]:
    """One agent conversation in OpenAI format (a fresh copy each call): record-level ``tools`` (two),
    a system message, a user question, an assistant turn with ``reasoning_content`` and a tool call
    (content ``""``), its tool result, a second tool call (no reasoning), its result, and a final answer
    with ``reasoning_content``. Tool-call ids are 9 alphanumeric characters (Mistral's templates insist);
    tool results are JSON text."""
    return {
        "tools": copy.deepcopy(_TOOLS),
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": REASONING_1,
                "tool_calls": [{
                    "id": "Wx7Kp2Lq9",
                    "type": "function",
                    "function": {"name": "get_weather_forecast",
                                 "arguments": {"city": "Lisbon", "date": "2025-06-14", "unit": "celsius"}},
                }],
            },
            {"role": "tool", "content": WEATHER_RESULT, "tool_call_id": "Wx7Kp2Lq9", "name": "get_weather_forecast"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{
                    "id": "Fc3Mn8Tz1",
                    "type": "function",
                    "function": {"name": "get_air_quality", "arguments": {"city": "Lisbon"}},
                }],
            },
            {"role": "tool", "content": AIR_RESULT, "tool_call_id": "Fc3Mn8Tz1", "name": "get_air_quality"},
            {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING_FINAL},
        ],
    }


_CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Cairo", "Quito", "Perth", "Dublin", "Hanoi")


def agent_traces(n: int) -> list[dict[str, Any]]:
    """``n`` agent conversations in the shape of :func:`agent_trace`, deterministic and all different: the
    city, date and figures vary by index, and every third one makes a third call (a second forecast) before
    answering, so the set has 2 or 3 calls per conversation (``sum`` of them: ``n * 2 + n // 3`` roughly)."""
    out = []
    for i in range(n):
        city, day = _CITIES[i % len(_CITIES)], f"2025-07-{1 + i % 28:02d}"
        rain, aqi = (7 * i) % 90, 20 + (11 * i) % 120
        rec = agent_trace()
        msgs = rec["messages"]
        msgs[1]["content"] = f"I'm cycling around {city} on {day} (trip {i}). Will it rain, and is the air clean?"
        msgs[2]["reasoning_content"] = f"Check the {city} forecast for {day} first, then the air."
        msgs[2]["tool_calls"][0]["function"]["arguments"] = {"city": city, "date": day, "unit": "celsius"}
        msgs[3]["content"] = json.dumps({"city": city, "date": day, "precipitation_chance": rain / 100, "high_c": 15 + i % 15})
        msgs[4]["tool_calls"][0]["function"]["arguments"] = {"city": city}
        msgs[5]["content"] = json.dumps({"city": city, "aqi": aqi, "category": "good" if aqi < 50 else "moderate"})
        if i % 3 == 0:  # a third call: the next day's forecast
            extra = {"role": "assistant", "content": "", "tool_calls": [{
                "id": f"Nx{i:07d}", "type": "function",
                "function": {"name": "get_weather_forecast", "arguments": {"city": city, "date": "next day"}}}]}
            msgs[6:6] = [extra, {"role": "tool", "content": json.dumps({"city": city, "precipitation_chance": 0.5}),
                                 "tool_call_id": f"Nx{i:07d}", "name": "get_weather_forecast"}]
        msgs[-1]["reasoning_content"] = f"Rain {rain}% and AQI {aqi} in {city}: answer with both."
        msgs[-1]["content"] = (f"On {day} in {city} the chance of rain is {rain}% and the air quality index is {aqi} "
                               f"({'good' if aqi < 50 else 'moderate'}). Trip {i}: {'go' if rain < 50 else 'pack a coat'}.")
        out.append(rec)
    return out
