"""The tokenizer and the causal LM a worker trains.

``model.name_or_path`` loads a Hugging Face model (hub id or local directory) with
``AutoModelForCausalLM``; ``model.init`` builds a small randomly initialised Llama or Qwen2 from the
inline architecture (demo runs and tests). Either way every rank builds the same weights (seeded), and
``trust_remote_code`` stays off unless the config turns it on (it is logged when on).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

import torch

from pipelines.config import ModelConfig, ModelInit
from pipelines.tokenize.tokenizer import load_tokenizer  # noqa: F401  (re-exported: workers import it from here)
from pipelines.train.collate import CollateMode

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def resolve_attn_implementation(requested: str, use_gpu: bool) -> str:
    """``auto`` -> ``flash_attention_2`` on GPU when ``flash_attn`` is installed, else ``sdpa``.

    An explicit ``flash_attention_2`` without CUDA or without the package is an error, not a silent
    fallback, because the flattened (padding-free) batches only stay isolated under that kernel.
    """
    has_flash = importlib.util.find_spec("flash_attn") is not None
    cuda = use_gpu and torch.cuda.is_available()
    if requested == "auto":
        return "flash_attention_2" if (cuda and has_flash) else "sdpa"
    if requested == "flash_attention_2" and not (cuda and has_flash):
        raise ValueError(
            "model.attn_implementation=flash_attention_2 needs CUDA and the flash_attn package; "
            "use auto, sdpa or eager"
        )
    return requested


def collate_mode_for(attn_implementation: str) -> CollateMode:
    """flash-attention-2 reads sample boundaries from position_ids; everything else needs the 4D mask."""
    return "flatten" if attn_implementation == "flash_attention_2" else "mask"


def init_config(init: ModelInit, tokenizer: PreTrainedTokenizerBase):  # -> PretrainedConfig
    """A transformers config for the inline architecture, sized to the tokenizer's vocabulary."""
    from transformers import LlamaConfig, Qwen2Config

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": init.hidden_size,
        "intermediate_size": init.intermediate_size,
        "num_hidden_layers": init.num_hidden_layers,
        "num_attention_heads": init.num_attention_heads,
        "num_key_value_heads": init.num_key_value_heads or init.num_attention_heads,
        "max_position_embeddings": init.max_position_embeddings,
        "tie_word_embeddings": init.tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if init.architecture == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def qlora_quantization_config(compute_dtype: torch.dtype) -> Any:
    """NF4 + double quantisation; packed storage in ``compute_dtype`` so ZeRO-3 can shard it."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=compute_dtype,
    )


def _qlora_kwargs(model_cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """``from_pretrained`` arguments that load the base in 4 bits (``model.adapter.type: qlora``, GPU).

    Under ZeRO-3 transformers places and partitions the packed weights itself; otherwise they go
    to this rank's GPU.
    """
    if model_cfg.adapter.type != "qlora":
        return {}
    from transformers.integrations import is_deepspeed_zero3_enabled

    kwargs: dict = {"quantization_config": qlora_quantization_config(dtype)}
    if not is_deepspeed_zero3_enabled():
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    return kwargs


def build_model(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    attn_implementation: str,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
) -> PreTrainedModel:
    """Load or initialise the causal LM (under DeepSpeed ZeRO-3 transformers partitions it while loading).

    The base model only: adapters (``model.adapter``) are added by :func:`pipelines.train.adapter.apply_adapter`.
    """
    from transformers import AutoModelForCausalLM

    if model_cfg.init is not None:
        torch.manual_seed(model_cfg.init.seed)  # identical random weights on every rank
        model = AutoModelForCausalLM.from_config(
            init_config(model_cfg.init, tokenizer), attn_implementation=attn_implementation, dtype=dtype
        )
    else:
        if model_cfg.trust_remote_code:
            logger.warning("model.trust_remote_code is on: code shipped with %s will run", model_cfg.name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            model_cfg.name_or_path,
            trust_remote_code=model_cfg.trust_remote_code,
            attn_implementation=attn_implementation,
            dtype=dtype,
            **_qlora_kwargs(model_cfg, dtype),
        )
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            logger.warning("resizing embeddings %d -> %d for the tokenizer",
                           model.get_input_embeddings().num_embeddings, len(tokenizer))
            model.resize_token_embeddings(len(tokenizer))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model
