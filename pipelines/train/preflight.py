"""``preflight(cfg)``: the checks of a config that need no cluster and no torch.

The job scripts run it right after parsing, so a mistyped value fails with the key's name in about half a
second, before torch, DeepSpeed or Ray are imported (``ray_jobs/_common.py``); ``build_trainer`` runs it again.
Only an adapter's target check builds a meta-device skeleton of the model, which needs torch and transformers:
it is imported when ``model.adapter`` is set.
"""

from __future__ import annotations

import os

from pipelines.config import Config, ConfigError
from pipelines.stream.batch import batch_layout
from pipelines.train.deepspeed_config import resolve_deepspeed_config
from pipelines.train.storage import is_remote

__all__ = ["preflight"]


def preflight(cfg: Config) -> None:
    """Checks that need no cluster; raises :class:`ConfigError` naming the key."""
    try:
        resolve_deepspeed_config(cfg.train, cfg.scaling.max_workers, cfg.scaling.use_gpu, cfg.base_dir,
                                 grad_accum=batch_layout(cfg.train, cfg.scaling, cfg.scaling.max_workers).grad_accum)
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from None
    if cfg.model.attn_implementation == "flash_attention_2" and not cfg.scaling.use_gpu:
        raise ConfigError("model.attn_implementation: flash_attention_2 needs scaling.use_gpu=true")
    resume = cfg.run.resume
    if resume not in ("auto", "never") and not is_remote(resume) and not os.path.exists(os.path.expanduser(resume)):
        raise ConfigError(f"run.resume: {resume!r} is neither auto, never nor an existing checkpoint path")
    if cfg.model.init is None and cfg.model.name_or_path is None:
        raise ConfigError("model: set model.name_or_path or model.init")
    if cfg.model.adapter.enabled:
        from pipelines.train.adapter import preflight_adapter

        preflight_adapter(cfg)  # QLoRA needs GPU + bitsandbytes; target_modules must match the architecture
