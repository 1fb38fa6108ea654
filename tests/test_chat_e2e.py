"""Agent data end to end: the shared Glaive tool-call set and generated agent traces, mixed, through
``build_dataset`` (Ray Data) with the Qwen2.5 template fixture, and one training step on the rows.

Every record is accounted for in the data report: each of its calls and answers trained (or counted as not),
each sample in exactly one row or dropped with its location, each tool schema rendered by the template.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
import torch
from chat_families import agent_traces, family_tokenizer
from conftest import GLAIVE, make_config, needs_shared, spawn_workers, write_jsonl

from pipelines.config import config_from_dict
from pipelines.sources.listing import split_sample_id
from pipelines.stream.dataset import build_dataset, data_report
from pipelines.tokenize.stage import IGNORE_INDEX

pytestmark = [needs_shared, pytest.mark.slow]

SEQ = 2048
N_TRACES = 60


@pytest.fixture(scope="module")
def chat_run(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_e2e")
    tok_dir = family_tokenizer("qwen2_5", root)
    traces = agent_traces(N_TRACES)
    cfg = make_config([{"path": str(GLAIVE), "type": "chat_template", "weight": 1.0},
                       {"path": str(write_jsonl(root / "agent.jsonl", traces)), "type": "chat_template", "weight": 1.0}],
                      tokenizer=tok_dir, sequence_len=SEQ)
    ds = build_dataset(cfg)
    rows = ds.take_all()
    return {"rows": rows, "report": data_report(ds), "tok_dir": tok_dir, "traces": traces, "root": root, "cfg": cfg}


def _samples(row: dict):
    pos = np.asarray(row["position_ids"])
    starts = [*np.flatnonzero(pos == 0).tolist(), len(pos)]
    for sid, a, b in zip(row["sample_ids"], starts[:-1], starts[1:], strict=True):
        yield sid, row["input_ids"][a:b], row["labels"][a:b]


def test_every_call_answer_and_schema_is_accounted_for(chat_run):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chat_run["tok_dir"])
    glaive = json.loads(GLAIVE.read_text())
    traces = chat_run["traces"]
    counters = chat_run["report"]["counters"]
    seen = Counter()
    sources = {}
    for row in chat_run["rows"]:
        assert 0 < len(row["input_ids"]) <= SEQ
        for sid, ids, labels in _samples(row):
            seen[sid] += 1
            source, index = split_sample_id(sid)
            sources.setdefault(source, set()).add(index)
            trained = hf.decode([t for t in labels if t != IGNORE_INDEX])
            if source == 1 and hf.decode(ids).endswith("<|im_end|>\n"):
                rec = traces[index]  # an agent trace, whole: every call and the answer trained
                for m in rec["messages"]:
                    for c in m.get("tool_calls", ()):
                        assert json.dumps(c["function"]["arguments"]) in trained
                assert trained.endswith(rec["messages"][-1]["content"] + "<|im_end|>")
    dropped = counters.get("dropped_no_trained_after_truncation", 0)
    assert set(seen.values()) == {1} and len(seen) + dropped == len(glaive) + len(traces)
    assert "skipped_bad_record" not in counters and "chat_turns_not_rendered" not in counters
    calls = sum(t["from"] == "function_call" for r in glaive for t in r["conversations"])
    calls += sum(len(m.get("tool_calls", ())) for r in traces for m in r["messages"])
    answers = sum(t["from"] == "gpt" and bool(t["value"].strip()) for r in glaive for t in r["conversations"])
    answers += sum(m["role"] == "assistant" for r in traces for m in r["messages"]) - sum(
        bool(m.get("tool_calls")) for r in traces for m in r["messages"])
    assert counters["chat_tool_calls_trained"] == calls
    assert counters["chat_turns_trained"] == answers + calls
    with_tools = sum(1 for r in glaive if json.loads(r.get("tools") or "[]")) + len(traces)
    assert counters["tools_rendered_by_template"] == with_tools  # Qwen2.5 renders the schemas itself
    # Qwen2.5's template has no reasoning field: the traces' reasoning is inlined as <think> blocks.
    reasoning = sum(bool(m.get("reasoning_content")) for r in traces for m in r["messages"])
    assert counters["chat_reasoning_trained"] == counters["chat_reasoning_inlined"] == reasoning
    assert counters["truncated_samples"] >= dropped


def _step_worker(rank: int, port: int, cfg_raw: dict, rows: list, out: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    from pipelines.train.step import BatchSource, build_engine, init_distributed, micro_batches, train_step

    torch.set_num_threads(1)
    init_distributed(use_gpu=False)
    te = build_engine(config_from_dict(cfg_raw))
    source = BatchSource(micro_batches(rows, te, 1))
    stats = [train_step(te, source) for _ in range(2)]
    torch.save(stats, out)
    torch.distributed.destroy_process_group()


def test_one_training_step_on_the_rows(chat_run, tmp_path):
    """The rows train: a tiny model sized to the tokenizer (control tokens included) takes two steps on
    the same two rows; the supervised tokens are exactly the rows' trained labels, and the loss falls."""
    rows = [{k: np.asarray(r[k], dtype=np.int32) for k in ("input_ids", "labels", "position_ids")}
            for r in chat_run["rows"][:1]] * 2
    raw = chat_run["cfg"].model_dump(mode="json")
    raw["model"] = {"tokenizer": str(chat_run["tok_dir"]), "attn_implementation": "sdpa",
                    "init": {"architecture": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "max_position_embeddings": SEQ}}
    raw["train"] = {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "learning_rate": 3e-2, "deepspeed": "zero0",
                    "bf16": False, "warmup_steps": 0, "lr_scheduler": "constant", "weight_decay": 0.0}
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    out = str(tmp_path / "stats.pt")
    spawn_workers(_step_worker, (store.port, raw, rows, out), 1)
    del store
    first, second = torch.load(out, weights_only=False)
    trained = int(sum((r["labels"][1:] != IGNORE_INDEX).sum() for r in rows[:1]))
    assert first.supervised_tokens == trained > 0 and first.tokens == len(rows[0]["input_ids"])
    assert np.isfinite(first.loss) and first.grad_norm > 0
    assert second.loss < first.loss
