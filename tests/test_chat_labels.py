"""chat_template labels with several real templates: exactly the assistant content and its end marker.

Templates: ChatML (the SmolLM2 tokenizer of ../shared/data), Meta's Llama-3 template (``| trim``,
header ids, BOS) on the same vocabulary plus Llama-3's special tokens, and a ChatML template with
``{% generation %}`` markers, whose trained characters Hugging Face's own ``return_assistant_tokens_mask``
machinery computes independently. Edge cases: one-character answers, whitespace-only answers, answers
equal to a piece of the role header, trailing whitespace the template trims, a template that changes
the content (the rendered text trains), and tool definitions.
"""

from __future__ import annotations

import json

import pytest
from conftest import GLAIVE, SMOLLM2, make_config, needs_shared, trained_runs, write_jsonl

from pipelines.errors import RecordError
from pipelines.sources.chat_template import tools_system_text
from pipelines.sources.formats import make_formatter
from pipelines.sources.listing import resolve_sources
from pipelines.sources.read import ReadOptions, read_files
from pipelines.stats import StatsSink
from pipelines.tokenize.stage import IGNORE_INDEX, Tokenizer

pytestmark = needs_shared

# meta-llama/Meta-Llama-3-8B-Instruct's chat template, as published.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# ChatML with generation markers around what an assistant turn trains (as TRL's templates do).
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
)
# A Qwen2.5-style template that renders tool definitions itself.
CHATML_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\nTools:\n' }}{% for t in tools %}{{ t['function']['name'] + ': ' + t['function']['description'] + '\n' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Changes the content beyond whitespace: what it renders is what trains.
CHATML_REWRITES = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | replace('colour', 'color')"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Neither a generation prompt nor generation markers: where an answer starts cannot be known.
CHATML_NO_PROMPT = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Tokenizer directories: the real SmolLM2 one, and copies with other templates (Llama-3 adds its tokens)."""
    from transformers import AutoTokenizer

    out = {"chatml": SMOLLM2}
    for name, template, extra in [
        ("llama3", LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
        ("generation", CHATML_GENERATION, []),
        ("tools", CHATML_TOOLS, []),
        ("rewrites", CHATML_REWRITES, []),
        ("no_prompt", CHATML_NO_PROMPT, []),
    ]:
        tok = AutoTokenizer.from_pretrained(SMOLLM2)
        if extra:
            tok.add_special_tokens({"additional_special_tokens": extra, "bos_token": extra[0]})
        tok.chat_template = template
        path = tmp_path_factory.mktemp(name)
        tok.save_pretrained(path)
        out[name] = path
    return out


def _conv(*answers: str, system: str | None = None) -> dict:
    msgs = [{"role": "system", "content": system}] if system else []
    for i, a in enumerate(answers):
        msgs += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


def _tokenize(tmp_path, tokenizer, records, **data):
    """Read + format + tokenize in-process; returns (Tokenizer, output table, counters)."""
    cfg = make_config([{"path": str(write_jsonl(tmp_path / "c.jsonl", records)), "type": "chat_template"}],
                      tokenizer=tokenizer, **data)
    table, sink = resolve_sources(cfg), StatsSink()
    opts = ReadOptions(table.storage, cfg.data.on_bad_record, tuple(d.text_field for d in table.datasets))
    tok = Tokenizer(cfg.data, cfg.model, table, sink)
    out = [tok(b) for b in read_files(list(table.files), opts, sink)]
    return tok, out[0], dict(sink.local.counters)


def _spans(pieces) -> list[tuple[int, int]]:
    """Character spans of a Pieces' trained runs in its text."""
    spans, pos = [], 0
    for text, trained in zip(pieces.texts, pieces.trained, strict=True):
        if trained and spans and spans[-1][1] == pos:
            spans[-1] = (spans[-1][0], pos + len(text))
        elif trained:
            spans.append((pos, pos + len(text)))
        pos += len(text)
    return spans


def _trained_pieces(tok, ids: list[int], labels: list[int]) -> list[str]:
    return trained_runs(tok.hf.decode, ids, labels)


CASES = [  # (answers, expected trained text per template family: chatml / llama3)
    (["a"], ["a<|im_end|>"], ["a<|eot_id|>"]),
    (["assistant"], ["assistant<|im_end|>"], ["assistant<|eot_id|>"]),  # the whole role name
    (["ssis", "im_start"], ["ssis<|im_end|>", "im_start<|im_end|>"], ["ssis<|eot_id|>", "im_start<|eot_id|>"]),
    (["Paris.\n"], ["Paris.\n<|im_end|>"], ["Paris.<|eot_id|>"]),  # trailing whitespace: Llama-3 trims it
    (["4", "."], ["4<|im_end|>", ".<|im_end|>"], ["4<|eot_id|>", ".<|eot_id|>"]),
    (["end_header_id"], ["end_header_id<|im_end|>"], ["end_header_id<|eot_id|>"]),
]


@pytest.mark.parametrize("family", ["chatml", "llama3", "generation"])
def test_trained_text_is_the_answer_and_its_end_marker(tmp_path, tokenizers, family):
    records = [_conv(*answers) for answers, _, _ in CASES]
    tok, out, _ = _tokenize(tmp_path, tokenizers[family], records)
    ids, labels = out["input_ids"].to_pylist(), out["labels"].to_pylist()
    for k, (answers, chatml, llama3) in enumerate(CASES):
        expected = llama3 if family == "llama3" else chatml
        assert _trained_pieces(tok, ids[k], labels[k]) == expected, (family, answers)
        # Every role header stays masked: the untrained text holds each header whole.
        prompt = tok.hf.decode([t for t, lab in zip(ids[k], labels[k], strict=True) if lab == IGNORE_INDEX])
        header = "<|start_header_id|>assistant<|end_header_id|>" if family == "llama3" else "<|im_start|>assistant"
        assert prompt.count(header) == len(answers)


def test_spans_equal_the_generation_markers(tokenizers):
    """Our character spans == the ``{% generation %}`` blocks as transformers renders them."""
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import render_jinja_template

    hf = AutoTokenizer.from_pretrained(tokenizers["generation"])
    cfg = make_config([{"path": "unused.jsonl", "type": "chat_template"}], tokenizer=tokenizers["generation"])
    fmt = make_formatter(cfg.data.datasets[0], cfg.data, hf)
    for answers, _, _ in CASES:
        msgs = _conv(*answers, system="Be brief.")["messages"]
        rendered, generation = render_jinja_template(conversations=[msgs], chat_template=CHATML_GENERATION,
                                                     return_assistant_tokens_mask=True, **hf.special_tokens_map)
        got = fmt({"messages": msgs})
        assert got.text == rendered[0]
        assert _spans(got) == [tuple(g) for g in generation[0]], answers


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_whitespace_only_answers_train_nothing_and_are_counted(tmp_path, tokenizers, family):
    records = [_conv("   "), _conv(" \n", "Fine.")]
    tok, out, counters = _tokenize(tmp_path, tokenizers[family], records, on_bad_record="skip")
    ids, labels = out["input_ids"].to_pylist(), out["labels"].to_pylist()
    assert ids[0] == [] and labels[0] == []  # nothing to learn: skipped, and counted
    assert counters.get("skipped_no_trained_tokens") == 1
    end = "<|eot_id|>" if family == "llama3" else "<|im_end|>"
    assert _trained_pieces(tok, ids[1], labels[1]) == [f"Fine.{end}"]  # the empty turn trains no end marker


def test_content_the_template_rewrites_trains_as_rendered(tmp_path, tokenizers):
    """What the template renders for a turn is what generation produces after its prompt: that trains."""
    records = [_conv("The colour is red."), _conv("Blue.")]
    tok, out, counters = _tokenize(tmp_path, tokenizers["rewrites"], records)
    ids, labels = out["input_ids"].to_pylist(), out["labels"].to_pylist()
    assert _trained_pieces(tok, ids[0], labels[0]) == ["The color is red.<|im_end|>"]
    assert _trained_pieces(tok, ids[1], labels[1]) == ["Blue.<|im_end|>"]
    assert counters["chat_turns_trained"] == 2 and "skipped_bad_record" not in counters


def test_a_template_without_generation_prompt_or_markers_is_refused(tmp_path, tokenizers):
    with pytest.raises(RecordError, match=r"no_prompt.*role header with the answer.*header cannot be told"):
        _tokenize(tmp_path, tokenizers["no_prompt"], [_conv("Hi")])


def test_glaive_tools_reach_the_text_as_a_system_turn_with_chatml(tmp_path):
    """SmolLM2's template ignores ``tools=``: the schemas go into a system turn, counted per sample."""
    records = json.loads(GLAIVE.read_text())[:20]
    with_tools = [r for r in records if r.get("tools") and json.loads(r["tools"])]
    assert with_tools and len(with_tools) < len(records)  # both kinds in the slice
    tok, out, counters = _tokenize(tmp_path, SMOLLM2, records, sequence_len=4096)
    assert counters.get("tools_in_system_turn") == len(with_tools)
    assert "tools_rendered_by_template" not in counters
    texts = [tok.hf.decode(ids) for ids in out["input_ids"].to_pylist()]
    for rec, text in zip(records, texts, strict=True):
        tools = json.loads(rec["tools"]) if rec.get("tools") else []
        if tools:
            wrapped = [{"type": "function", "function": t} for t in tools]  # the OpenAI form templates read
            assert text.startswith("<|im_start|>system\n" + tools_system_text(wrapped) + "<|im_end|>\n"), text[:300]
            for t in wrapped:  # every schema is there, name and parameters
                assert json.dumps(t, ensure_ascii=False) in text
        else:
            assert "<tools>" not in text and text.startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_tools_go_to_a_template_that_renders_them(tmp_path, tokenizers):
    tools = [{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object"}}]
    records = [{**_conv("Sunny."), "tools": json.dumps(tools)}, {**_conv("Rain."), "tools": tools}]
    tok, out, counters = _tokenize(tmp_path, tokenizers["tools"], records)
    assert counters.get("tools_rendered_by_template") == 2 and "tools_in_system_turn" not in counters
    for ids, labels, answer in zip(out["input_ids"].to_pylist(), out["labels"].to_pylist(), ["Sunny.", "Rain."],
                                   strict=True):
        assert tok.hf.decode(ids).startswith("<|im_start|>system\nTools:\nget_weather: Weather for a city\n")
        assert _trained_pieces(tok, ids, labels) == [f"{answer}<|im_end|>"]


def test_tools_system_turn_joins_an_existing_system_turn(tokenizers):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(SMOLLM2)
    cfg = make_config([{"path": "unused.jsonl", "type": "chat_template"}], tokenizer=SMOLLM2)
    fmt = make_formatter(cfg.data.datasets[0], cfg.data, hf)
    tools = [{"name": "f", "description": "d"}]
    got = fmt({**_conv("ok", system="Be brief."), "tools": tools})
    wrapped = [{"type": "function", "function": tools[0]}]
    assert got.text.startswith(f"<|im_start|>system\nBe brief.\n\n{tools_system_text(wrapped)}<|im_end|>\n")
    assert got.counters == ("tools_in_system_turn", "chat_turns_trained")
    assert [got.text[s:e] for s, e in _spans(got)] == ["ok<|im_end|>"]
    for bad in ('[{"name": ', '{"name": "f"}', "[1, 2]"):
        with pytest.raises(RecordError, match="tools"):
            fmt({**_conv("ok"), "tools": bad})


def test_named_templates_are_chosen_as_transformers_does():
    """A dict of templates: ``tool_use`` for records with tools, ``default`` for the rest."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(SMOLLM2)
    default = hf.chat_template
    hf.chat_template = {"default": default, "tool_use": CHATML_TOOLS}
    cfg = make_config([{"path": "unused.jsonl", "type": "chat_template"}], tokenizer=SMOLLM2)
    fmt = make_formatter(cfg.data.datasets[0], cfg.data, hf)
    tools = [{"name": "get_weather", "description": "Weather for a city"}]
    with_tools = fmt({**_conv("Sunny."), "tools": tools})
    assert with_tools.text.startswith("<|im_start|>system\nTools:\nget_weather: Weather for a city\n")
    assert with_tools.counters[0] == "tools_rendered_by_template"
    plain = fmt(_conv("Rain."))
    assert plain.text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert [plain.text[s:e] for s, e in _spans(plain)] == ["Rain.<|im_end|>"]
