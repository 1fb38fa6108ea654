"""Training on the stream: Ray Train ``TorchTrainer`` + DeepSpeed (see ``trainer.build_trainer``).

Modules, one concern each: ``collate`` (packed rows -> tensors + block-diagonal masks), ``loss``
(global token-mean loss), ``model`` (tokenizer + causal LM), ``deepspeed_config``, ``schedule``
(LR), ``step`` (per-worker step, no Ray), ``loop`` (Ray Train worker loop), ``checkpoint``,
``export``, ``metrics``, ``storage`` and ``trainer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.train.trainer import build_trainer, preflight

__all__ = ["build_trainer", "preflight"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import pipelines.train.collate` (e.g. in the data path or tests) does not import Ray Train.
    if name in __all__:
        from pipelines.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
