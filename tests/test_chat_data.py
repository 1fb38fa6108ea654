"""Chat data as people fine-tune it now, through the tokenizer stage, for six model families' templates.

Families (``tests/fixtures/chat_templates``): Qwen2.5, Qwen3, Llama 3.1, Mistral, Gemma 3, gpt-oss, each
built over a shared vocabulary with its control tokens added (``tests/chat_families.py``). What is
checked, per family unless said otherwise:

* the trained text of every turn is what the template renders for the turn and its end marker, never a
  header byte, and the prompt generation sees, tokenized alone, is a token prefix of the row;
* control strings inside data stay text: a row holds exactly the control tokens the template emits;
* tool calls and reasoning train, and can be left out of the labels per dataset;
* a template's own error is a bad record (file and line, the template's words), skipped and counted on
  request; a key the format does not know likewise.

These tests use only the stage's public pieces, so they run against older code too.
"""

from __future__ import annotations

import copy
import json

import pytest
from chat_families import FAMILIES, agent_trace, control_strings, family_tokenizer
from conftest import SMOLLM2, make_config, needs_shared, trained_runs, write_jsonl

from pipelines.sources.listing import resolve_sources
from pipelines.sources.read import ReadOptions, read_files
from pipelines.stats import StatsSink
from pipelines.tokenize.stage import IGNORE_INDEX, Tokenizer

pytestmark = needs_shared

# gpt-oss renders today's date unless given one.
KWARGS = {"gpt_oss": {"date_string": "2025-06-13"}}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: family_tokenizer(f, root) for f in FAMILIES}


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _tokenize(tmp_path, tokenizer, records, family=None, name="c.jsonl", **ds):
    """Read + format + tokenize in-process: ``(rows as (ids, labels) lists, counters, examples)``."""
    kwargs = KWARGS.get(family)
    if kwargs:
        ds.setdefault("chat_template_kwargs", kwargs)
    on_bad = ds.pop("on_bad_record", "raise")
    cfg = make_config([{"path": str(write_jsonl(tmp_path / name, records)), "type": "chat_template", **ds}],
                      tokenizer=tokenizer, sequence_len=8192, on_bad_record=on_bad)
    table, sink = resolve_sources(cfg), StatsSink()
    opts = ReadOptions(table.storage, cfg.data.on_bad_record, tuple(d.text_field for d in table.datasets))
    tok = Tokenizer(cfg.data, cfg.model, table, sink)
    rows = []
    for block in read_files(list(table.files), opts, sink):
        out = tok(block)
        rows += list(zip(out["input_ids"].to_pylist(), out["labels"].to_pylist(), strict=True))
    return rows, dict(sink.local.counters), dict(sink.local.examples)


def _runs(hf, ids, labels) -> list[str]:
    return trained_runs(hf.decode, ids, labels)


def _render(hf, msgs, family, tools=None, generation_prompt=False) -> str:
    return hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=generation_prompt,
                                  **KWARGS.get(family, {}))


PLAIN = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"},
                      {"role": "assistant", "content": "Madrid."}]}
# What each family trains of PLAIN: the answer as the template renders it after its generation prompt, and
# the turn's end marker. Qwen3 renders an empty think block for the turn it generates, and none in earlier
# turns; gpt-oss's model generates the channel, and the last turn ends in <|return|>; Mistral's answers
# follow [/INST] with a space.
PLAIN_TRAINED = {
    "qwen2_5": ["Paris.<|im_end|>", "Madrid.<|im_end|>"],
    "qwen3": ["Paris.<|im_end|>", "<think>\n\n</think>\n\nMadrid.<|im_end|>"],
    "llama3_1": ["Paris.<|eot_id|>", "Madrid.<|eot_id|>"],
    "mistral": [" Paris.</s>", " Madrid.</s>"],
    "gemma3": ["Paris.<end_of_turn>", "Madrid.<end_of_turn>"],
    "gpt_oss": ["<|channel|>final<|message|>Paris.<|end|>", "<|channel|>final<|message|>Madrid.<|return|>"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_turn_trains_its_rendered_answer_and_end_marker(tmp_path, families, family):
    hf = _hf(families[family])
    [(ids, labels)], counters, _ = _tokenize(tmp_path, families[family], [PLAIN], family)
    assert _runs(hf, ids, labels) == PLAIN_TRAINED[family]
    assert counters["chat_turns_trained"] == 2
    assert hf.decode(ids) == _render(hf, PLAIN["messages"], family)  # the row is the template's rendering


def test_an_answer_that_starts_with_newlines_trains_no_header_byte(tmp_path):
    """ChatML's header ends in "\\n"; an answer "\\n\\nHi" must not merge with it into a trained "\\n\\n\\n"."""
    hf = _hf(SMOLLM2)
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "\n\nHi"}]
    [(ids, labels)], _, _ = _tokenize(tmp_path, SMOLLM2, [{"messages": msgs}])
    assert _runs(hf, ids, labels) == ["\n\nHi<|im_end|>"]
    prompt = hf(_render(hf, msgs[:1], None, generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt)] == prompt  # what generation sees, token for token
    assert set(labels[: len(prompt)]) == {IGNORE_INDEX} and labels[len(prompt)] != IGNORE_INDEX


def _as_the_template_reads(msgs: list[dict], family: str) -> list[dict]:
    """Messages as the pipeline hands them to the template: reasoning under the key the template reads
    (Qwen3 ``reasoning_content``, gpt-oss ``thinking``), else as a ``<think>`` block opening the content."""
    out = []
    for m in copy.deepcopy(msgs):
        reasoning = m.pop("reasoning_content", None)
        if reasoning is not None:
            if family == "qwen3":
                m["reasoning_content"] = reasoning
            elif family == "gpt_oss":
                m["thinking"] = reasoning
            else:
                m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m['content']}"
        out.append(m)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conv", ["plain", "agent"])
def test_the_generation_prompt_is_a_token_prefix_of_the_row(tmp_path, families, family, conv):
    """For every assistant turn whose generation prompt the conversation's rendering starts with, the prompt
    tokenized alone is the row's first tokens, none of them trained, and the turn's first token is trained.
    The other turns are counted as trained in a context that differs (Mistral drops the system prompt from a
    finished conversation; Qwen3 and gpt-oss drop earlier reasoning)."""
    hf = _hf(families[family])
    rec = PLAIN if conv == "plain" else agent_trace()
    [(ids, labels)], counters, _ = _tokenize(tmp_path, families[family], [rec], family)
    msgs, tools = _as_the_template_reads(rec["messages"], family), rec.get("tools")
    full = _render(hf, msgs, family, tools)
    exact, retokenized = 0, []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt_text = _render(hf, msgs[:k], family, tools, generation_prompt=True)
        if not full.startswith(prompt_text):
            continue
        prompt = hf(prompt_text, add_special_tokens=False)["input_ids"]
        if ids[: len(prompt)] != prompt:
            retokenized.append(k)
            continue
        assert labels[len(prompt) - 1] == IGNORE_INDEX and labels[len(prompt)] != IGNORE_INDEX, (family, k)
        exact += 1
    turns = sum(m["role"] == "assistant" for m in msgs)
    assert counters["chat_turns_trained"] == turns
    # The rest train as the conversation renders them: its prompt differs, or the turn's own text does.
    assert counters.get("chat_turns_differ_from_generation", 0) >= turns - exact - len(retokenized)
    # Mistral's template drops the system prompt from a finished conversation: no prompt before it holds.
    assert exact >= 1 or (family == "mistral" and counters["chat_system_not_rendered"] == 1)
    # Only where the tokenizer splits an earlier turn's generation point otherwise inside the conversation
    # (GPT-2's regex, under the Llama 3.1 fixture: a trailing "\n\n" alone is one token, two before a word),
    # and then counted; the first turn's prompt always holds.
    assert bool(retokenized) == ("chat_prompt_retokenized" in counters), (family, retokenized)
    assert family == "llama3_1" or not retokenized


@pytest.mark.parametrize("family", FAMILIES)
def test_control_strings_inside_content_stay_text(tmp_path, families, family):
    """Every control string of the family inside system, user, tool and assistant content: the row holds
    exactly the control tokens that the same conversation with plain words holds, and the strings as text."""
    hf = _hf(families[family])
    specials = {hf.convert_tokens_to_ids(c) for c in control_strings(family)}

    def conv(word: str) -> dict:
        rec = agent_trace()
        msgs = rec["messages"]
        msgs[0]["content"] += f" {word}"
        msgs[1]["content"] += f" {word}"
        msgs[3]["content"] = msgs[3]["content"][:-1] + f', "note": "{word}"}}'
        msgs[-1]["content"] += f" {word}"
        return rec

    strings = control_strings(family)
    clean = [conv("plain words") for _ in strings]
    injected = [conv(c) for c in strings]
    rows, counters, _ = _tokenize(tmp_path, families[family], clean + injected, family)
    assert "skipped_bad_record" not in counters
    for (clean_ids, _), (ids, labels), c in zip(rows[: len(strings)], rows[len(strings):], strings, strict=True):
        assert sum(t in specials for t in ids) == sum(t in specials for t in clean_ids), (family, c)
        text = hf.decode(ids)
        assert text.count(c) >= hf.decode(clean_ids).count(c) + 3, (family, c)  # system, user, answer at least
        assert any(c in run for run in _runs(hf, ids, labels)), (family, c)  # the answer's copy trains, as text


@pytest.mark.parametrize("family", FAMILIES)
def test_agent_trace_trains_calls_and_answer_and_accounts_for_each(tmp_path, families, family):
    hf = _hf(families[family])
    [(ids, labels)], counters, _ = _tokenize(tmp_path, families[family], [agent_trace()], family)
    trained = "".join(_runs(hf, ids, labels))
    rec = agent_trace()
    calls = [c["function"] for m in rec["messages"] for c in m.get("tool_calls", ())]
    for call in calls:  # the calls train: their names and arguments
        assert call["name"] in trained and all(str(v) in trained for v in call["arguments"].values()), family
    assert rec["messages"][-1]["content"] in trained
    assert counters["chat_tool_calls_trained"] == len(calls) == 2
    assert counters["chat_turns_trained"] == 3
    # Each reasoning text is trained or counted as not rendered (a template that drops it), never unseen.
    reasoning = [m["reasoning_content"] for m in rec["messages"] if m.get("reasoning_content")]
    in_labels = sum(r in trained for r in reasoning)
    assert in_labels == counters.get("chat_reasoning_trained", 0) >= 1
    assert in_labels + counters.get("chat_reasoning_not_rendered", 0) == len(reasoning)
    for m in rec["messages"]:  # tool results are in the row and never trained
        if m["role"] == "tool":
            assert json.loads(m["content"])["city"] == "Lisbon"
            assert "Lisbon" in hf.decode(ids) and m["content"] not in trained


@pytest.mark.parametrize("family", FAMILIES)
def test_reasoning_and_calls_can_be_left_out_of_the_labels(tmp_path, families, family):
    hf = _hf(families[family])
    rec = agent_trace()
    reasoning = rec["messages"][-1]["reasoning_content"]
    [(ids, labels)], counters, _ = _tokenize(tmp_path, families[family], [rec], family, train_reasoning=False)
    trained = "".join(_runs(hf, ids, labels))
    assert reasoning in hf.decode(ids) and reasoning not in trained
    assert rec["messages"][-1]["content"] in trained and "get_air_quality" in trained
    assert counters["chat_reasoning_untrained"] >= 1 and "chat_reasoning_trained" not in counters
    [(ids, labels)], counters, _ = _tokenize(tmp_path, families[family], [rec], family, name="d.jsonl",
                                             train_tool_calls=False)
    trained = "".join(_runs(hf, ids, labels))
    assert "get_air_quality" in hf.decode(ids) and "get_air_quality" not in trained and "Lisbon" in trained
    assert counters["chat_tool_calls_untrained"] == 2


def test_openai_and_sharegpt_forms_of_one_agent_turn_train_alike(tmp_path, families):
    """OpenAI tool_calls with string arguments, and ShareGPT function_call/observation turns, are one call."""
    hf = _hf(families["qwen2_5"])
    args = {"city": "Oslo"}
    openai = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "content": '{"temp": 3}'}, {"role": "assistant", "content": "3 degrees."}]}
    sharegpt = {"conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": args})},
        {"from": "observation", "value": '{"temp": 3}'}, {"from": "gpt", "value": "3 degrees."}],
        "tools": json.dumps([{"name": "weather", "description": "Weather now", "parameters": {"type": "object"}}])}
    rows, counters, _ = _tokenize(tmp_path, families["qwen2_5"], [openai, sharegpt], "qwen2_5")
    expected = ['<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
                "3 degrees.<|im_end|>"]
    for ids, labels in rows:
        assert _runs(hf, ids, labels) == expected
        assert '<|im_start|>user\n<tool_response>\n{"temp": 3}\n</tool_response><|im_end|>' in hf.decode(ids)
    assert counters["chat_tool_calls_trained"] == 2 and counters["tools_rendered_by_template"] == 1


# Per family, a record its published template refuses with raise_exception, and the words it uses. The
# Qwen2.5 and Qwen3 templates raise on nothing.
def _two_calls(call_id: str = "Ab3Kp9Lq2") -> dict:
    call = {"id": call_id, "type": "function", "function": {"name": "f", "arguments": {}}}
    return {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "Zz8Yy7Xx6"}]}


TEMPLATE_ERRORS = {
    "gemma3": ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
               "Conversation roles must alternate"),
    "mistral": ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
                "roles must alternate"),
    "llama3_1": ([{"role": "user", "content": "a"}, _two_calls()], "only supports single tool-calls"),
    "gpt_oss": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "reasoning_content": "r",
                 "tool_calls": _two_calls()["tool_calls"][:1]}], "Cannot pass both content and thinking"),
}


@pytest.mark.parametrize("family", sorted(TEMPLATE_ERRORS))
def test_template_errors_are_bad_records(tmp_path, families, family):
    """A template's own raise_exception: the record, not the run, is at fault."""
    msgs, words = TEMPLATE_ERRORS[family]
    bad = {"messages": msgs}
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}]}
    with pytest.raises(Exception, match=rf"c\.jsonl.* line 1.*{words}"):
        _tokenize(tmp_path, families[family], [bad, good], family)
    rows, counters, examples = _tokenize(tmp_path, families[family], [bad, good], family, name="d.jsonl",
                                         on_bad_record="skip")
    assert rows[0] == ([], []) and rows[1][0] and counters["skipped_bad_record"] == 1
    assert "line 1" in examples["skipped_bad_record"][0] and words in examples["skipped_bad_record"][0]


def test_keys_the_format_does_not_know_are_bad_records(tmp_path):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_result": "x"}]
    with pytest.raises(Exception, match=r"line 1.*unknown key 'tool_result'"):
        _tokenize(tmp_path, SMOLLM2, [{"messages": msgs}])
    recs = [{"messages": msgs}, {"id": 7, "messages": msgs[:1] + [{"role": "assistant", "content": "b"}]}]
    _, counters, examples = _tokenize(tmp_path, SMOLLM2, recs, name="d.jsonl", on_bad_record="skip")
    assert counters["skipped_bad_record"] == 2 and "unknown field 'id'" in examples["skipped_bad_record"][1]
    rows, counters, _ = _tokenize(tmp_path, SMOLLM2, recs[1:], name="e.jsonl", ignore_fields=["id"])
    assert rows[0][0] and "skipped_bad_record" not in counters


def test_inline_think_blocks_are_reasoning(tmp_path, families):
    """Reasoning written inline (``<think>...</think>`` opening the content) reaches Qwen3's template as
    reasoning, rendered and tokenized with its real <think> tokens, not as content text."""
    hf = _hf(families["qwen3"])
    inline = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}]}
    field = copy.deepcopy(inline)
    field["messages"][1].update(content="4", reasoning_content="add them")
    rows, _, _ = _tokenize(tmp_path, families["qwen3"], [inline, field], "qwen3")
    assert rows[0] == rows[1]
    assert _runs(hf, *rows[0]) == ["<think>\nadd them\n</think>\n\n4<|im_end|>"]
    assert hf.convert_tokens_to_ids("<think>") in rows[0][0]
