"""``train.deepspeed`` -> a complete DeepSpeed config dict.

``train.deepspeed`` is one of

* a name ``zero0`` .. ``zero3``: ``configs/deepspeed/<name>.json`` shipped with the project,
* a path to a JSON file (relative paths: the config file's folder, then the current directory),
* an inline dict (YAML mapping).

The batch-shape and optimisation keys always come from ``TrainConfig`` -- it is the one place a user
sets them -- whatever the JSON says (a conflicting explicit value is logged and overridden)::

    train_micro_batch_size_per_gpu = train.micro_batch_size
    gradient_accumulation_steps    = the run's accumulation at this world size (pipelines.stream.batch)
    train_batch_size               = micro_batch_size * gradient_accumulation_steps * world_size
    gradient_clipping              = train.max_grad_norm          (0 = off)
    bf16.enabled                   = train.bf16

``zero_optimization.overlap_comm: "auto"`` becomes true on GPU and false on CPU (gloo gains nothing
from it). The optimizer and LR scheduler are *client* objects (torch AdamW + LambdaLR), so any
``optimizer``/``scheduler`` block in the JSON is rejected rather than silently ignored.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

from pipelines.config import TrainConfig

logger = logging.getLogger(__name__)

BUILTIN_NAMES = ("zero0", "zero1", "zero2", "zero3")


def builtin_dirs() -> list[Path]:
    """Where ``zeroN.json`` files are looked up: the project checkout, then ``./configs/deepspeed``."""
    repo_root = Path(__file__).resolve().parents[2]
    return [repo_root / "configs" / "deepspeed", Path.cwd() / "configs" / "deepspeed"]


def load_deepspeed_source(spec: str | dict[str, Any], base_dir: str | None = None) -> dict[str, Any]:
    """Read ``train.deepspeed`` (name, path or dict) into a dict, without filling anything in."""
    if isinstance(spec, dict):
        return copy.deepcopy(spec)
    candidates: list[Path] = []
    if spec in BUILTIN_NAMES:
        candidates = [d / f"{spec}.json" for d in builtin_dirs()]
    else:
        p = Path(os.path.expanduser(spec))
        candidates = [p] if p.is_absolute() else [Path(base_dir or ".") / p, Path.cwd() / p]
    for c in candidates:
        if c.is_file():
            with c.open(encoding="utf-8") as f:
                return json.load(f)
    raise ValueError(
        f"train.deepspeed: {spec!r} not found (looked at {', '.join(str(c) for c in candidates)}); "
        f"use one of {', '.join(BUILTIN_NAMES)}, a JSON path or an inline mapping"
    )


def _set(cfg: dict[str, Any], key: str, value: Any) -> None:
    """Set ``cfg[key]``; log when an explicit (non-"auto") value differs."""
    old = cfg.get(key, "auto")
    if old != "auto" and old != value:
        logger.warning("deepspeed config: %s=%r overridden by the train config (%r)", key, old, value)
    cfg[key] = value


def resolve_deepspeed_config(
    train: TrainConfig, world_size: int, use_gpu: bool = False, base_dir: str | None = None, *,
    grad_accum: int | None = None, load_universal: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config for this run, with batch sizes, clipping and precision from ``train``.

    ``grad_accum``: micro-batches per step at ``world_size`` (:class:`pipelines.stream.batch.BatchLayout`;
    default ``train.gradient_accumulation_steps``). ``load_universal``: the checkpoint to load is in
    DeepSpeed's universal format (saved at another world size; :mod:`pipelines.train.checkpoint`).
    """
    grad_accum = train.gradient_accumulation_steps if grad_accum is None else grad_accum
    cfg = load_deepspeed_source(train.deepspeed, base_dir)
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise ValueError(
                f"train.deepspeed: remove the {key!r} block; the optimizer (AdamW) and LR schedule are set by "
                "train.learning_rate, train.lr_scheduler, ... "
            )
    _set(cfg, "train_micro_batch_size_per_gpu", train.micro_batch_size)
    _set(cfg, "gradient_accumulation_steps", grad_accum)
    _set(cfg, "train_batch_size", train.micro_batch_size * grad_accum * world_size)
    _set(cfg, "gradient_clipping", float(train.max_grad_norm))
    bf16 = dict(cfg.get("bf16") or {})
    if bf16.get("enabled", "auto") not in ("auto", train.bf16):
        logger.warning("deepspeed config: bf16.enabled overridden by train.bf16=%s", train.bf16)
    bf16["enabled"] = train.bf16
    cfg["bf16"] = bf16
    if cfg.get("fp16", {}).get("enabled") is True:
        raise ValueError("train.deepspeed: fp16 is not supported; use train.bf16")
    zero = dict(cfg.get("zero_optimization") or {"stage": 0})
    if zero.get("overlap_comm") == "auto":
        zero["overlap_comm"] = bool(use_gpu)
    cfg["zero_optimization"] = zero
    cfg.setdefault("zero_allow_untested_optimizer", True)  # the client AdamW is "untested" in DS's eyes
    cfg.setdefault("steps_per_print", 10**9)  # we log ourselves
    if load_universal:
        cfg["checkpoint"] = {**(cfg.get("checkpoint") or {}), "load_universal": True}
    _reject_leftover_auto(cfg)
    return cfg


def _reject_leftover_auto(cfg: Any, path: str = "") -> None:
    """Any ``"auto"`` we did not fill would reach DeepSpeed as a string; name it instead."""
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            _reject_leftover_auto(v, f"{path}.{k}" if path else k)
    elif cfg == "auto":
        raise ValueError(f"train.deepspeed: {path}='auto' has no automatic value here; set it explicitly")


def zero_stage(ds_config: dict[str, Any]) -> int:
    """The ZeRO stage of a resolved config (0 when absent)."""
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))
