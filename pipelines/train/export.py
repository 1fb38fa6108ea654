"""The end of a run: a Hugging Face model + tokenizer in ``<run dir>/model``.

Loadable with ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``.
Under ZeRO-3 the weights are spread over the ranks, so every rank takes part in gathering them
(DeepSpeed's ``_zero3_consolidated_16bit_state_dict``, layer by layer onto rank 0's CPU -- the same
call Hugging Face accelerate uses); under ZeRO 0-2 rank 0 already holds full (bf16) weights.
Weights are written in the training precision (bf16 with ``train.bf16``) as safetensors.
"""

from __future__ import annotations

import torch.distributed as dist

from pipelines.train.step import TrainEngine
from pipelines.train.storage import OutputDir


def consolidated_state_dict(te: TrainEngine) -> dict | None:
    """Full weights on rank 0 (None elsewhere). Collective under ZeRO-3: call it on every rank."""
    if te.zero_stage == 3:
        return te.engine._zero3_consolidated_16bit_state_dict()
    if te.rank != 0:
        return None
    return {k: v.detach().cpu() for k, v in te.engine.module.state_dict().items()}


def export_hf_model(te: TrainEngine, out: OutputDir | None) -> None:
    """Write model + tokenizer to ``out`` on rank 0 (other ranks pass None but must call: ZeRO-3 gathers)."""
    state_dict = consolidated_state_dict(te)
    if te.rank == 0 and out is not None:
        model = te.engine.module
        use_cache = model.config.use_cache
        model.config.use_cache = True  # gradient checkpointing turns it off; inference wants it on
        model.save_pretrained(out.local, state_dict=state_dict, safe_serialization=True)
        model.config.use_cache = use_cache
        te.tokenizer.save_pretrained(out.local)
        out.sync()
    if dist.is_initialized():
        dist.barrier()
