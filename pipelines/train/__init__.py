"""Training on the stream: Ray Train ``TorchTrainer`` + DeepSpeed (see ``trainer.build_trainer``).

Modules, one concern each: ``collate`` (packed rows -> tensors + block-diagonal masks), ``loss``
(global token-mean loss), ``model`` (tokenizer + causal LM), ``deepspeed_config``, ``schedule``
(LR), ``step`` (per-worker step, no Ray), ``loop`` (Ray Train worker loop), ``checkpoint``,
``export``, ``metrics``, ``storage``, ``preflight`` (config checks without torch) and ``trainer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.train.preflight import preflight
    from pipelines.train.trainer import build_trainer

__all__ = ["build_trainer", "preflight"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import pipelines.train.collate` (e.g. in the data path or tests) does not import Ray Train.
    if name == "preflight":
        from pipelines.train.preflight import preflight

        return preflight
    if name == "build_trainer":
        from pipelines.train.trainer import build_trainer

        return build_trainer
    raise AttributeError(name)
