"""Streaming LLM fine-tuning on Ray: read shards, tokenize and pack in CPU actors, train with DeepSpeed.

Notebook API::

    from pipelines import load_config, build_dataset, build_trainer
    cfg = load_config("configs/default.yaml", overrides=["data.sequence_len=512"])
    ds = build_dataset(cfg, split="train")      # lazy ray.data.Dataset of packed rows
    result = build_trainer(cfg).fit()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.config import Config, ConfigError, load_config
    from pipelines.sources.listing import locate_sample
    from pipelines.stream.dataset import build_dataset, data_report
    from pipelines.train.trainer import build_trainer

# Resolved on first use, so importing one module (e.g. pipelines.train.collate in
# benchmarks/gpu_check.py, on a GPU box without Ray) does not import Ray through this package.
_HOMES = {"Config": "pipelines.config", "ConfigError": "pipelines.config", "load_config": "pipelines.config",
          "build_dataset": "pipelines.stream.dataset", "data_report": "pipelines.stream.dataset",
          "locate_sample": "pipelines.sources.listing", "build_trainer": "pipelines.train.trainer"}

__all__ = ["Config", "ConfigError", "build_dataset", "build_trainer", "data_report", "load_config", "locate_sample"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
