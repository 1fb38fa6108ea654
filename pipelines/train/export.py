"""The end of a run: a Hugging Face model + tokenizer, or a PEFT adapter (and a merged model).

Full fine-tuning (``model.adapter.type: none``) writes ``<run dir>/model``, loadable with
``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``.

With an adapter (``lora`` / ``qlora``):

* ``<run dir>/adapter``: PEFT's own format (``adapter_config.json`` + ``adapter_model.safetensors``)
  and the tokenizer, loadable with ``PeftModel.from_pretrained(base, path)``;
* ``<run dir>/model`` when ``train.export_merged: true``: the base with ``W + (alpha/r) B A`` merged in
  by peft's ``merge_and_unload``, a plain model for ``AutoModelForCausalLM.from_pretrained``.

Under ZeRO-3 the weights are spread over the ranks, so every rank takes part in gathering them
(DeepSpeed's ``_zero3_consolidated_16bit_state_dict``, layer by layer onto rank 0's CPU -- the same
call Hugging Face accelerate uses). Saving a ZeRO-3 PeftModel without gathering writes empty (0-element)
LoRA tensors, a known pitfall: the adapter is always written from the gathered state dict. Under
ZeRO 0-2 rank 0 already holds full weights. Weights are written in the training precision (bf16 with
``train.bf16``) as safetensors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from pipelines.config import Config
from pipelines.storage import StorageOptions
from pipelines.train.step import TrainEngine
from pipelines.train.storage import OutputDir

__all__ = ["consolidated_state_dict", "export_adapter", "export_hf_model", "export_run", "merged_model"]

logger = logging.getLogger(__name__)


def consolidated_state_dict(te: TrainEngine, trainable_only: bool = False) -> dict | None:
    """Full weights on rank 0 (None elsewhere). Collective under ZeRO-3: call it on every rank.

    ``trainable_only``: just the parameters that train (the LoRA matrices), so an adapter export does
    not gather the whole base.
    """
    if te.zero_stage == 3:
        return te.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=trainable_only)
    if te.rank != 0:
        return None
    module = te.engine.module
    if trainable_only:
        return {k: p.detach().cpu().clone() for k, p in module.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def export_hf_model(te: TrainEngine, out: OutputDir | None) -> None:
    """Write model + tokenizer to ``out`` on rank 0 (other ranks pass None but must call: ZeRO-3 gathers)."""
    state_dict = consolidated_state_dict(te)
    if te.rank == 0 and out is not None:
        _save_model(te.engine.module, state_dict, te.tokenizer, out)
    _barrier()


def _save_model(model, state_dict: dict | None, tokenizer, out: OutputDir) -> None:
    use_cache = model.config.use_cache
    model.config.use_cache = True  # gradient checkpointing turns it off; inference wants it on
    model.save_pretrained(out.local, state_dict=state_dict, safe_serialization=True)
    model.config.use_cache = use_cache
    tokenizer.save_pretrained(out.local)
    out.sync()


def export_adapter(te: TrainEngine, out: OutputDir | None) -> None:
    """Write the LoRA adapter in PEFT's format + the tokenizer to ``out`` on rank 0 (collective)."""
    lora = consolidated_state_dict(te, trainable_only=True)
    if te.rank == 0 and out is not None:
        empty = [k for k, v in lora.items() if v.numel() == 0]
        if not lora or empty:  # an invariant: the gather above is what prevents it
            raise RuntimeError(f"adapter export: {len(empty)} of {len(lora)} LoRA tensors are empty (not gathered)")
        peft_model = te.engine.module
        # save_embedding_layers=False: the embeddings are frozen (never adapted), and "auto" would ask the Hub.
        peft_model.save_pretrained(out.local, state_dict=lora, safe_serialization=True, save_embedding_layers=False)
        te.tokenizer.save_pretrained(out.local)
        out.sync()
    _barrier()


@contextlib.contextmanager
def _no_hf_zero3() -> Iterator[None]:
    """Build a plain model on one rank while a ZeRO-3 ``HfDeepSpeedConfig`` is alive: without this,
    transformers would wrap the constructor in ``deepspeed.zero.Init``, a collective the other ranks never join."""
    from transformers.integrations import deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def merged_model(te: TrainEngine, cfg: Config, state_dict: dict) -> torch.nn.Module:
    """A plain causal LM with the adapter merged in, built on rank 0's CPU from the gathered weights.

    LoRA: a fresh copy of the trained PeftModel (module tree on the meta device, then allocated and
    filled from ``state_dict`` -- which holds base and adapter), merged by peft's ``merge_and_unload``.
    The merge runs in fp32 and the result is cast back to the training precision.
    QLoRA: the gathered base is 4-bit; the base is re-read from ``model.name_or_path`` in the compute
    dtype (not quantized) and the adapter merged into that, as the QLoRA paper does for deployment.
    """
    from peft import get_peft_model, set_peft_model_state_dict

    from pipelines.train.adapter import lora_config

    dtype = next(iter(state_dict.values())).dtype
    base = te.engine.module.get_base_model()
    with _no_hf_zero3():
        if te.adapter.type == "qlora":
            from peft.utils import get_peft_model_state_dict
            from transformers import AutoModelForCausalLM

            fresh = AutoModelForCausalLM.from_pretrained(
                cfg.model.name_or_path, dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code)
            if len(te.tokenizer) > fresh.get_input_embeddings().num_embeddings:
                fresh.resize_token_embeddings(len(te.tokenizer))
            peft_model = get_peft_model(fresh, lora_config(te.adapter))
            lora = {k: v for k, v in state_dict.items() if "lora_" in k}
            set_peft_model_state_dict(peft_model, get_peft_model_state_dict(peft_model, state_dict=lora))
        else:
            with torch.device("meta"):
                peft_model = get_peft_model(type(base)(base.config), lora_config(te.adapter))
            peft_model.to_empty(device="cpu")
            peft_model.float().load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
            peft_model.get_base_model().tie_weights()  # to_empty gave tied weights separate storage
    merged = peft_model.merge_and_unload()
    return merged.to(dtype)


def export_merged(te: TrainEngine, cfg: Config, out: OutputDir | None) -> None:
    """Gather everything (collective), merge on rank 0 and write a plain HF model + tokenizer to ``out``."""
    state_dict = consolidated_state_dict(te)
    if te.rank == 0 and out is not None:
        merged = merged_model(te, cfg, state_dict)
        del state_dict
        _save_model(merged, None, te.tokenizer, out)
    _barrier()


def export_run(te: TrainEngine, cfg: Config, run_dir: str, storage: StorageOptions | None = None) -> str:
    """Everything a run exports (see the module docstring); returns the main path (model or adapter)."""
    def out(name: str) -> OutputDir | None:
        return OutputDir(f"{run_dir}/{name}", storage) if te.rank == 0 else None

    if not te.adapter.enabled:
        export_hf_model(te, out("model"))
        return f"{run_dir}/model"
    export_adapter(te, out("adapter"))
    if cfg.train.export_merged:
        export_merged(te, cfg, out("model"))
        return f"{run_dir}/model"
    return f"{run_dir}/adapter"
