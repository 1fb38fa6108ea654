"""Streaming LLM fine-tuning on Ray: read shards, tokenize and pack in CPU actors, train with DeepSpeed.

Notebook API::

    from pipelines import load_config, build_dataset, build_trainer
    cfg = load_config("configs/default.yaml", overrides=["data.sequence_len=512"])
    ds = build_dataset(cfg, split="train")      # lazy ray.data.Dataset of packed rows
    result = build_trainer(cfg).fit()
"""

from pipelines.config import Config, ConfigError, load_config
from pipelines.dataset import build_dataset, data_report
from pipelines.sources import locate_sample


def build_trainer(cfg: Config, **kwargs):
    """A Ray Train ``TorchTrainer`` for ``cfg`` (see :mod:`pipelines.train.trainer`)."""
    from pipelines.train.trainer import build_trainer as _build

    return _build(cfg, **kwargs)


__all__ = ["Config", "ConfigError", "build_dataset", "build_trainer", "data_report", "load_config", "locate_sample"]
