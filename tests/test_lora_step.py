"""LoRA through the per-worker step, 2 processes, without Ray (gloo + DeepSpeed's CPU accelerator).

One run per ZeRO stage (2 and 3) trains a tiny Llama with LoRA for a few steps and checks:

* only adapter parameters change: every base weight, gathered before and after, is bit-identical,
  and every LoRA ``B`` matrix (initialised to zero by peft) has moved;
* the exported adapter (PEFT format) is complete (no empty tensors: the ZeRO-3 pitfall) and, loaded
  with ``PeftModel.from_pretrained`` onto a freshly built base, gives the training engine's logits on
  fixed inputs; the merged export (``train.export_merged``) loads with ``AutoModelForCausalLM`` and
  gives them too. Tolerance: fp32 throughout, max |logit difference| <= 1e-4 (adapter) and 2e-4
  (merged: ``W + s B A`` is rounded once more than ``W x + s B (A x)``); logits are O(1).
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from conftest import spawn_workers

from pipelines.config import config_from_dict

TINY = {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 128, "seed": 3}
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
STEPS = 4


def _cfg(deepspeed, run_dir: str):
    return config_from_dict({
        "model": {"tokenizer": "demo://tokenizer", "init": TINY, "attn_implementation": "sdpa",
                  "adapter": {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.1,
                              "target_modules": ["q_proj", "v_proj", "down_proj"]}},
        "data": {"datasets": [{"path": "unused.jsonl"}], "sequence_len": 64},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "learning_rate": 2e-2,
                  "deepspeed": deepspeed, "bf16": False, "warmup_steps": 0, "lr_scheduler": "constant",
                  "export_merged": True},
        "run": {"storage_path": os.path.dirname(run_dir), "name": os.path.basename(run_dir)},
    })


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fixed_batch():
    from pipelines.train.collate import collate_rows
    from pipelines.train.step import synthetic_rows

    rows = synthetic_rows(2, 48, 260, seed=99)
    return collate_rows({k: [r[k] for r in rows] for k in rows[0]}, "mask", 0, torch.float32)


def _worker(rank: int, world: int, port: int, cfg_raw: dict, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from pipelines.train.export import consolidated_state_dict, export_run
    from pipelines.train.step import (
        BatchSource,
        build_engine,
        init_distributed,
        micro_batches,
        synthetic_rows,
        train_step,
    )

    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_raw)
    init_distributed(use_gpu=False)
    te = build_engine(cfg)
    before = {k: v.clone() for k, v in (consolidated_state_dict(te) or {}).items()}  # ZeRO-2: views of live params
    rows = synthetic_rows(STEPS * 2, 64, 260, seed=rank)
    source = BatchSource(micro_batches(rows, te, cfg.train.micro_batch_size))
    losses = [train_step(te, source).loss for _ in range(STEPS)]
    after = consolidated_state_dict(te)
    te.engine.eval()
    batch = _fixed_batch()
    with torch.no_grad():
        logits = te.engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           attention_mask=batch["attention_mask"]).logits.float()
    export_run(te, cfg, run_dir, None)
    if rank == 0:
        torch.save({"before": before, "after": after, "logits": logits, "losses": losses,
                    "params": (te.params.trainable, te.params.total)}, os.path.join(run_dir, "result.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _peft_entry(state_dict: dict, key: str) -> torch.Tensor:
    """A base model's ``key`` in a PeftModel state dict (adapted layers keep it under ``base_layer``)."""
    adapted = "base_model.model." + key.replace(".weight", ".base_layer.weight")
    return state_dict[adapted] if adapted in state_dict else state_dict["base_model.model." + key]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_lora_trains_only_adapters_and_exports_match(tmp_path, stage):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipelines.train.model import build_model, load_tokenizer

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg = _cfg(ZERO3 if stage == "zero3" else stage, run_dir)
    spawn_workers(_worker, (2, _free_port(), cfg.model_dump(mode="json"), run_dir), 2)
    res = torch.load(os.path.join(run_dir, "result.pt"), weights_only=False)
    before, after = res["before"], res["after"]

    # Only adapters train: the base is bit-identical, every LoRA B left zero.
    lora_keys = {k for k in after if "lora_" in k}
    base_keys = set(after) - lora_keys
    # r * (in + out) per adapted linear, 2 layers.
    per_layer = 4 * (32 + 32) + 4 * (32 + 32) + 4 * (64 + 32)  # q_proj, v_proj, down_proj
    assert res["params"][0] == 2 * per_layer
    assert len(lora_keys) == 2 * 3 * 2 and len(base_keys) > 10
    for k in base_keys:
        assert torch.equal(before[k], after[k]), f"base weight {k} changed"
    for k in lora_keys:
        if "lora_B" in k:
            assert before[k].abs().max() == 0 and after[k].abs().max() > 0, k

    # The adapter export is complete and equals the trained LoRA weights.
    adapter_dir = os.path.join(run_dir, "adapter")
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert len(saved) == len(lora_keys) and all(v.numel() > 0 for v in saved.values())
    for k, v in saved.items():  # peft strips the adapter name: ...q_proj.lora_A.weight
        trained = after[k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")]
        assert torch.equal(v, trained), k
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4

    tok = load_tokenizer(cfg.model)
    base = build_model(cfg.model, tok, "sdpa").eval()
    for k, v in base.state_dict().items():  # the base a user rebuilds is the one that was trained on
        assert torch.equal(v, _peft_entry(before, k)), k
    batch = _fixed_batch()
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask")}
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, adapter_dir).eval()(**inputs).logits
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "model")).eval()
        merged_logits = merged(**inputs).logits
    trained = res["logits"]
    assert (trained - peft_logits).abs().max() <= 1e-4
    assert (trained - merged_logits).abs().max() <= 2e-4
    # Not vacuous: without the adapter the base gives other logits.
    with torch.no_grad():
        plain = build_model(cfg.model, tok, "sdpa").eval()(**inputs).logits
    assert (trained - plain).abs().max() > 1e-2
    assert not any("lora" in k for k in merged.state_dict())
