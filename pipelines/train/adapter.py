"""LoRA / QLoRA adapters (``model.adapter``), built on peft.

The base model is loaded as for full fine-tuning (:func:`pipelines.train.model.build_model`), then
:func:`apply_adapter` checks ``target_modules`` against it and wraps it with
``peft.get_peft_model(model, LoraConfig(...))``: the base weights are frozen, only the ``lora_A`` /
``lora_B`` matrices train. Example, a 2-layer Llama (hidden 64, MLP 128) with ``r: 8`` on
``all-linear`` (q, k, v, o, gate, up, down; not the output head)::

    per layer: q,k,v,o 4 x 8*(64+64) + gate,up 2 x 8*(64+128) + down 8*(128+64) = 8,704
    2 layers -> 17,408 trainable of ~100k parameters

``qlora`` loads the base in 4 bits (bitsandbytes NF4, double quantisation) with
``bnb_4bit_quant_storage`` set to the compute dtype, so ZeRO-3 can partition the packed weights like
any bf16 tensor (the recipe of the PEFT/accelerate docs). It needs CUDA, ``bitsandbytes`` and a
pretrained ``model.name_or_path``; :func:`preflight_adapter` refuses anything else before Ray starts.

What was written by hand, and why: the per-name check of ``target_modules`` (peft only says "not
found" for the whole list, and only inside a worker); peft's own matching
(``check_target_module_exists``) decides what a name matches.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipelines.config import AdapterConfig, Config, ConfigError, ModelConfig

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["ParamCount", "apply_adapter", "check_targets", "count_params", "lora_config", "preflight_adapter"]

logger = logging.getLogger(__name__)

KEY = "model.adapter.target_modules"


@dataclass(frozen=True)
class ParamCount:
    """Trainable and total parameters of the model a worker trains (full size under ZeRO-3 and 4 bits)."""

    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / max(self.total, 1)

    def line(self) -> str:
        """``"trainable params 17,408 of 101,312 (17.18%)"``."""
        return f"trainable params {self.trainable:,} of {self.total:,} ({self.fraction:.2%})"


def lora_config(adapter: AdapterConfig) -> LoraConfig:
    """The peft ``LoraConfig`` for ``model.adapter`` (causal LM, no bias training)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules,
        bias="none",
    )


def _lora_layer_types() -> tuple[type, ...]:
    """Module types peft's LoRA can wrap (what a target name must resolve to)."""
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, Conv1D)


def _is_linear(module: torch.nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    # bitsandbytes' Linear4bit subclasses nn.Linear, so QLoRA bases count too.
    return isinstance(module, (torch.nn.Linear, Conv1D))


def check_targets(model: torch.nn.Module, adapter: AdapterConfig) -> None:
    """Raise :class:`ConfigError` naming ``model.adapter.target_modules`` when a target matches nothing.

    Each listed name is checked on its own (peft only fails when *all* of them match nothing), with
    peft's own matching rule: ``q_proj`` matches ``model.layers.0.self_attn.q_proj``; a string other
    than ``all-linear`` is a regex over full module names. A match on a module LoRA cannot wrap
    (a norm, a whole block) is an error too. The message lists the linear layers the model has.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    named = [(n, m) for n, m in model.named_modules() if n]
    linear_leaves = sorted({n.rsplit(".", 1)[-1] for n, m in named if _is_linear(m)})
    arch = type(model).__name__
    hint = f"{arch} has the linear layers {', '.join(linear_leaves) or '(none)'}"
    targets = adapter.target_modules
    if targets == "all-linear":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not any(_is_linear(m) and m is not head for _, m in named):
            raise ConfigError(f"{KEY}: all-linear matches no linear layer of {arch} (besides the output head)")
        return
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as err:
            raise ConfigError(f"{KEY}: {targets!r} is not a valid regex ({err})") from None
    wanted = [targets] if isinstance(targets, str) else list(targets)
    supported = _lora_layer_types()
    for target in wanted:
        probe = LoraConfig(target_modules=target if isinstance(targets, str) else [target])
        hits = [(n, m) for n, m in named if check_target_module_exists(probe, n)]
        if not hits:
            raise ConfigError(f"{KEY}: {target!r} matches no module of {arch}; {hint}")
        bad = [n for n, m in hits if not isinstance(m, supported)]
        if bad:
            raise ConfigError(f"{KEY}: {target!r} matches {bad[0]} ({type(dict(hits)[bad[0]]).__name__}), "
                              f"which LoRA cannot adapt; {hint}")


def apply_adapter(model: torch.nn.Module, adapter: AdapterConfig, gradient_checkpointing: bool = False):
    """Freeze ``model`` and add LoRA adapters (a ``peft.PeftModel``); checks the targets first.

    QLoRA bases go through ``prepare_model_for_kbit_training`` (fp32 norms, input grads for
    checkpointing). With gradient checkpointing the inputs must require grad, or the frozen
    embeddings cut the graph and the adapters get no gradient.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    check_targets(model, adapter)
    if adapter.type == "qlora":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif gradient_checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, lora_config(adapter))


def count_params(model: torch.nn.Module) -> ParamCount:
    """Trainable / total parameters; peft's count for adapters (ZeRO-3 ``ds_numel`` and 4-bit aware)."""
    if hasattr(model, "get_nb_trainable_parameters"):
        trainable, total = model.get_nb_trainable_parameters()
        return ParamCount(int(trainable), int(total))
    trainable = total = 0
    for p in model.parameters():
        n = p.numel() or int(getattr(p, "ds_numel", 0))
        total += n
        trainable += n if p.requires_grad else 0
    return ParamCount(trainable, total)


def skeleton(model_cfg: ModelConfig) -> torch.nn.Module | None:
    """The model's module tree on the meta device (no weights): what the target check needs.

    None when the architecture cannot be read here (e.g. a hub id without network on the driver);
    the workers run the same check when they build the model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipelines.tokenize.tokenizer import load_tokenizer
    from pipelines.train.model import init_config

    try:
        if model_cfg.init is not None:
            hf_config = init_config(model_cfg.init, load_tokenizer(model_cfg))
        else:
            hf_config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        logger.warning("model.adapter: cannot read the architecture of %s here (%s); the workers check "
                       "model.adapter.target_modules when they load it", model_cfg.name_or_path, err)
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=model_cfg.trust_remote_code)


def preflight_adapter(cfg: Config) -> None:
    """Adapter checks that need no cluster: QLoRA's requirements, and targets against the architecture."""
    adapter = cfg.model.adapter
    if not adapter.enabled:
        return
    if adapter.type == "qlora":
        if not cfg.scaling.use_gpu:
            raise ConfigError("model.adapter.type: qlora needs a GPU (bitsandbytes 4-bit kernels are CUDA-only); "
                              "set scaling.use_gpu=true, or use type lora on CPU")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("model.adapter.type: qlora needs the bitsandbytes package (pip install bitsandbytes), "
                              "which is not installed")
        if cfg.model.init is not None or cfg.model.name_or_path is None:
            raise ConfigError("model.adapter.type: qlora quantizes pretrained weights; set model.name_or_path "
                              "(model.init builds a random model)")
    model = skeleton(cfg.model)
    if model is not None:
        check_targets(model, adapter)
