"""The six chat-template fixtures (tests/fixtures/chat_templates) render an agent trace as the published
templates do, and every control string they emit is one token of the tokenizer built for them.

Quick: no Ray; the six tokenizers are built once per module from ../shared/data's vocabularies.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from chat_families import (
    AIR_RESULT,
    ANSWER,
    FAMILIES,
    QUESTION,
    REASONING_1,
    REASONING_FINAL,
    SYSTEM,
    TEMPLATES,
    WEATHER_RESULT,
    agent_trace,
    control_strings,
    family_spec,
    family_tokenizer,
    template_text,
)
from conftest import needs_shared
from jinja2.exceptions import TemplateError

pytestmark = needs_shared

CALL_NAMES = ("get_weather_forecast", "get_air_quality")
FOLLOW_UP = "Thanks! Same question for the day after, 2025-06-15?"
REASONING_2 = "A new day means a new forecast; I only have today's numbers, so say so briefly."
ANSWER_2 = "I only checked 2025-06-14; ask me to look up 2025-06-15 and I will call the forecast tool."
# What each family's rendering starts with (the comment header emits nothing) and ends a generation prompt with.
OPENING = {
    "qwen2_5": "<|im_start|>system\n" + SYSTEM + "\n\n# Tools\n",
    "qwen3": "<|im_start|>system\n" + SYSTEM + "\n\n# Tools\n",
    "llama3_1": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n",
    "mistral": "<s>[AVAILABLE_TOOLS] [{",
    "gemma3": "<bos><start_of_turn>user\n" + SYSTEM + "\n\nYou have access to functions.",
    "gpt_oss": "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
}
GENERATION_PROMPT = {
    "qwen2_5": "<|im_start|>assistant\n",
    "qwen3": "<|im_start|>assistant\n",
    "llama3_1": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[/INST]",  # the published Mistral template has no generation prompt of its own
    "gemma3": "<start_of_turn>model\n",
    "gpt_oss": "<|start|>assistant",
}
GPT_OSS_DATE = {"date_string": "2025-06-13"}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat_families")
    return {family: AutoTokenizer.from_pretrained(str(family_tokenizer(family, root))) for family in FAMILIES}


def render(tok, family, messages, tools, **kwargs):
    if family == "gpt_oss":
        kwargs = {**GPT_OSS_DATE, **kwargs}
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


def thinking_for_gpt_oss(messages):
    """gpt-oss's published template reads reasoning from ``thinking``, not ``reasoning_content``."""
    out = copy.deepcopy(messages)
    for m in out:
        if "reasoning_content" in m:
            m["thinking"] = m.pop("reasoning_content")
    return out


def with_follow_up(messages):
    return messages + [
        {"role": "user", "content": FOLLOW_UP},
        {"role": "assistant", "content": ANSWER_2, "reasoning_content": REASONING_2},
    ]


def test_families_json_and_templates_match():
    assert set(json.loads((TEMPLATES / "families.json").read_text())) == set(FAMILIES)
    for family in FAMILIES:
        spec = family_spec(family)
        assert spec["vocab"] in ("smollm2", "gpt2") and spec["based_on"]
        text = template_text(family)
        assert text.startswith("{#-") and "Based on:" in text.split("-#}", 1)[0]
    assert {family_spec(f)["vocab"] for f in FAMILIES} == {"smollm2", "gpt2"}


@pytest.mark.parametrize("family", FAMILIES)
def test_built_tokenizer_carries_the_family(toks, family):
    tok, spec = toks[family], family_spec(family)
    assert tok.chat_template == template_text(family)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        spec.get("bos_token"), spec.get("eos_token"), spec.get("pad_token"))
    added = {t.content: t for t in tok.added_tokens_decoder.values()}
    for t in spec["added_tokens"]:
        assert added[t["content"]].special is t["special"], t
        assert added[t["content"]].normalized is False, t


@pytest.mark.parametrize("family", FAMILIES)
def test_renders_agent_trace(toks, family):
    tok, trace = toks[family], agent_trace()
    messages = thinking_for_gpt_oss(trace["messages"]) if family == "gpt_oss" else trace["messages"]
    full = render(tok, family, messages, trace["tools"])
    full_gen = render(tok, family, messages, trace["tools"], add_generation_prompt=True)
    prompt = render(tok, family, messages[:2], trace["tools"], add_generation_prompt=True)

    assert full.startswith(OPENING[family]) and prompt.startswith(OPENING[family])
    assert "Fixture chat template" not in full  # the comment header renders nothing
    assert QUESTION in full and ANSWER in full
    for name in CALL_NAMES:  # each tool is defined once and called once (Llama: defined in the first user turn)
        assert full.count(name) >= 2, name
    for result in (WEATHER_RESULT, AIR_RESULT):  # Llama 3.1 and gpt-oss JSON-quote a string tool result
        assert (json.dumps(result, ensure_ascii=False) if family in ("llama3_1", "gpt_oss") else result) in full
    assert prompt.endswith(GENERATION_PROMPT[family])
    if family == "mistral":  # the system prompt moves into the last user turn, so the prompt is no prefix
        assert not full.startswith(prompt)
        assert full_gen == full
    else:
        assert full.startswith(prompt), "the generation prompt must be a prefix of the whole conversation"
        assert full_gen.endswith(GENERATION_PROMPT[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_control_strings_are_single_tokens(toks, family):
    from tokenizers import Tokenizer as RustTokenizer

    tok, trace = toks[family], agent_trace()
    controls = control_strings(family)
    ids = {c: tok.convert_tokens_to_ids(c) for c in controls}
    for c, i in ids.items():
        assert isinstance(i, int) and tok.convert_ids_to_tokens(i) == c, c  # not the unknown token
        assert tok(c, add_special_tokens=False).input_ids == [i], c
    assert len(set(ids.values())) == len(ids)

    messages = with_follow_up(trace["messages"])
    messages = thinking_for_gpt_oss(messages) if family == "gpt_oss" else messages
    text = render(tok, family, messages, trace["tools"])
    encoded = tok(text, add_special_tokens=False).input_ids
    emitted = [c for c in controls if c in text]
    assert len(emitted) >= 3
    for c in emitted:  # every occurrence in the rendering is that one token
        assert encoded.count(ids[c]) == text.count(c), c
    # the pipeline's direct loader (tokenizers alone, pipelines/tokenize/tokenizer.py) encodes the same
    rust = RustTokenizer.from_file(str(Path(tok.name_or_path) / "tokenizer.json"))
    assert rust.encode(text, add_special_tokens=False).ids == encoded


def test_qwen2_5_tool_response_is_plain_text(toks):
    tok = toks["qwen2_5"]
    assert "<tool_response>" not in control_strings("qwen2_5")
    assert len(tok.tokenize("<tool_response>")) > 1
    full = render(tok, "qwen2_5", agent_trace()["messages"], agent_trace()["tools"])
    assert f"<|im_start|>user\n<tool_response>\n{AIR_RESULT}\n</tool_response><|im_end|>" in full


def test_qwen3_reasoning_kept_after_last_query_and_stripped_before(toks):
    tok, trace = toks["qwen3"], agent_trace()
    full = render(tok, "qwen3", trace["messages"], trace["tools"])
    # all assistant turns follow the one user query: the reasoning of both is rendered
    assert f"<|im_start|>assistant\n<think>\n{REASONING_1}\n</think>\n\n<tool_call>\n" in full
    assert f"<|im_start|>assistant\n<think>\n{REASONING_FINAL}\n</think>\n\n{ANSWER}<|im_end|>\n" in full
    assert "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_air_quality\"" in full  # no reasoning, no block
    assert full.count("<think>") == 2

    later = render(tok, "qwen3", with_follow_up(trace["messages"]), trace["tools"])
    assert REASONING_1 not in later and REASONING_FINAL not in later
    assert f"<|im_start|>assistant\n{ANSWER}<|im_end|>\n" in later
    assert later.endswith(f"<|im_start|>assistant\n<think>\n{REASONING_2}\n</think>\n\n{ANSWER_2}<|im_end|>\n")
    assert later.count("<think>") == 1

    no_think = render(tok, "qwen3", trace["messages"][:2], trace["tools"], add_generation_prompt=True,
                      enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama3_1_tool_calls_json_and_results_under_ipython(toks):
    tok, trace = toks["llama3_1"], agent_trace()
    full = render(tok, "llama3_1", trace["messages"], trace["tools"])
    assert "Today Date: 26 Jul 2024\n\n" + SYSTEM + "<|eot_id|>" in full
    call = json.dumps({"name": "get_weather_forecast",
                       "parameters": {"city": "Lisbon", "date": "2025-06-14", "unit": "celsius"}})
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{call}<|eot_id|>" in full
    for result in (WEATHER_RESULT, AIR_RESULT):  # a string result is JSON-quoted by the published template
        quoted = json.dumps(result, ensure_ascii=False)
        assert f"<|start_header_id|>ipython<|end_header_id|>\n\n{quoted}<|eot_id|>" in full
    assert full.count("<|start_header_id|>ipython<|end_header_id|>") == 2
    assert "<|start_header_id|>tool<|end_header_id|>" not in full
    assert full.endswith(f"<|start_header_id|>assistant<|end_header_id|>\n\n{ANSWER}<|eot_id|>")

    two_calls = copy.deepcopy(trace["messages"])
    two_calls[2]["tool_calls"].append(two_calls[4]["tool_calls"][0])
    with pytest.raises(TemplateError, match="single tool-calls"):
        render(tok, "llama3_1", two_calls, trace["tools"])


def test_mistral_system_only_in_last_user_turn(toks):
    tok, trace = toks["mistral"], agent_trace()
    prompt = render(tok, "mistral", trace["messages"][:2], trace["tools"], add_generation_prompt=True)
    assert prompt.endswith(f"[/AVAILABLE_TOOLS][INST] {SYSTEM}\n\n{QUESTION}[/INST]")

    # a later user turn: the system text goes there, after the last [INST], and nowhere else
    messages = with_follow_up(trace["messages"])[:-1]
    later = render(tok, "mistral", messages, trace["tools"])
    assert later.count(SYSTEM) == 1 and later.rindex("[INST]") < later.index(SYSTEM)
    assert f"[INST] {QUESTION}[/INST]" in later
    assert later.count("[AVAILABLE_TOOLS]") == 1 and later.index("[AVAILABLE_TOOLS]") > later.index(QUESTION)

    # the whole conversation ends with an assistant turn: the published template drops the system message
    full = render(tok, "mistral", trace["messages"], trace["tools"])
    assert SYSTEM not in full
    assert full.count("[TOOL_CALLS] [") == 2 and full.count("[TOOL_RESULTS] ") == 2
    assert ('[TOOL_CALLS] [{"name": "get_air_quality", "arguments": {"city": "Lisbon"}, "id": "Fc3Mn8Tz1"}]</s>'
            in full)
    assert f'[TOOL_RESULTS] {{"content": {AIR_RESULT}, "call_id": "Fc3Mn8Tz1"}}[/TOOL_RESULTS]' in full
    assert full.endswith(f"[/TOOL_RESULTS] {ANSWER}</s>")

    bad_id = copy.deepcopy(trace["messages"])
    bad_id[2]["tool_calls"][0]["id"] = "call_001"
    with pytest.raises(TemplateError, match="length 9"):
        render(tok, "mistral", bad_id, trace["tools"])


def test_gemma3_folds_system_and_requires_alternation(toks):
    tok, trace = toks["gemma3"], agent_trace()
    plain = render(tok, "gemma3", trace["messages"][:2] + [{"role": "assistant", "content": " Sure. "}], None)
    assert plain == (f"<bos><start_of_turn>user\n{SYSTEM}\n\n{QUESTION}<end_of_turn>\n"
                     "<start_of_turn>model\nSure.<end_of_turn>\n")
    assert "<start_of_turn>system" not in plain

    full = render(tok, "gemma3", trace["messages"], trace["tools"])
    assert full.count("<start_of_turn>user\n") == 3 and full.count("<start_of_turn>model\n") == 3
    assert "<start_of_turn>tool" not in full and "<start_of_turn>assistant" not in full
    assert f"<start_of_turn>user\n```tool_output\n{AIR_RESULT}\n```<end_of_turn>\n" in full
    assert '<start_of_turn>model\n{"name": "get_air_quality", "parameters": {"city": "Lisbon"}}<end_of_turn>' in full
    assert full.endswith(f"<start_of_turn>model\n{ANSWER}<end_of_turn>\n")

    for roles in (("user", "user"), ("system", "user", "user"), ("user", "assistant", "assistant"), ("assistant",)):
        with pytest.raises(TemplateError, match="must alternate"):
            render(tok, "gemma3", [{"role": r, "content": "hi"} for r in roles], None)


def test_gpt_oss_channels_and_return(toks):
    tok, trace = toks["gpt_oss"], agent_trace()
    messages = thinking_for_gpt_oss(trace["messages"])
    full = render(tok, "gpt_oss", messages, trace["tools"])
    assert "Current date: 2025-06-13\n" in full
    assert f"<|start|>developer<|message|># Instructions\n\n{SYSTEM}\n\n# Tools\n\n## functions\n" in full
    assert full.endswith(f"<|start|>assistant<|channel|>analysis<|message|>{REASONING_FINAL}<|end|>"
                         f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
    assert full.count("<|return|>") == 1
    assert REASONING_1 not in full  # a tool call's reasoning is dropped once a final answer follows
    assert ('<|start|>assistant to=functions.get_weather_forecast<|channel|>commentary json<|message|>'
            '{"city": "Lisbon", "date": "2025-06-14", "unit": "celsius"}<|call|>') in full
    quoted = json.dumps(AIR_RESULT, ensure_ascii=False)
    assert f"<|start|>functions.get_air_quality to=assistant<|channel|>commentary<|message|>{quoted}<|end|>" in full

    gen = render(tok, "gpt_oss", messages, trace["tools"], add_generation_prompt=True)
    assert gen.endswith(f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|end|><|start|>assistant")
    assert "<|return|>" not in gen and REASONING_FINAL not in gen

    # The published template reads "thinking" only. transformers 4.x hands the messages over as given, so
    # reasoning_content is not rendered; transformers 5 copies reasoning_content to thinking (and back)
    # before rendering, so the result is the same as with "thinking".
    as_given = render(tok, "gpt_oss", trace["messages"], trace["tools"])
    if "<|channel|>analysis" in as_given:
        assert as_given == full
    else:
        assert REASONING_FINAL not in as_given
        assert as_given.endswith(f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")

    # without date_string, the published behaviour: today's date
    today = tok.apply_chat_template(messages[:2], tools=trace["tools"], tokenize=False)
    assert re.search(r"\nCurrent date: \d{4}-\d{2}-\d{2}\n", today)
