"""The per-worker training step, usable without Ray.

Everything a worker does per optimizer step lives here and needs only torch.distributed + DeepSpeed,
so it can be checked alone on a GPU box (``torchrun --nproc-per-node 8 -m pipelines.train.step``)
where Ray is not installed. ``loop.py`` wraps it for Ray Train.

One optimizer step (:func:`train_step`), on every rank:

1. pull up to G = ``gradient_accumulation_steps`` micro-batches from the iterator (timing the wait),
2. one ``all_reduce`` of ``[supervised tokens, tokens, rows, real micro-batches]``; if no rank got a
   micro-batch the epoch is over *for everyone at once* -- no rank waits on a collective another rank
   never joins,
3. a rank that got fewer than G (its shard ran out first) pads with dummy micro-batches whose labels
   are all -100: they join the forward/backward collectives but add no gradient,
4. each micro-batch back-propagates ``summed token loss * W * G / N`` (see ``loss.py``), so the step's
   gradient is the mean over the N supervised tokens of the global batch.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.util
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipelines.config import AdapterConfig, Config
from pipelines.stream.batch import BatchLayout, batch_layout
from pipelines.train.adapter import ParamCount, apply_adapter, count_params
from pipelines.train.collate import CollateMode, PackedCollate, collate_rows, dummy_batch
from pipelines.train.deepspeed_config import resolve_deepspeed_config, zero_stage
from pipelines.train.loss import backward_scale, summed_loss, supervised_tokens
from pipelines.train.model import build_model, collate_mode_for, load_tokenizer, resolve_attn_implementation
from pipelines.train.schedule import build_scheduler

logger = logging.getLogger(__name__)

MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


# --------------------------------------------------------------------------- setup


def select_accelerator(use_gpu: bool) -> None:
    """Point DeepSpeed at the CPU or the GPU accelerator *before* it is used (it caches its choice).

    CPU workers get ``DS_ACCELERATOR=cpu`` (gloo collectives, DeepSpeed's small shm op); GPU workers let
    DeepSpeed detect CUDA (NCCL). Everything else is the same code path.
    """
    if use_gpu:
        if os.environ.get("DS_ACCELERATOR") == "cpu":
            del os.environ["DS_ACCELERATOR"]
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
        ninja_on_path()
    import deepspeed.accelerator.real_accelerator as real

    current = real.ds_accelerator
    if current is not None and (current._name == "cpu") == use_gpu:  # cached the wrong one
        if use_gpu:
            real.ds_accelerator = None  # re-detect on next use
        else:
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            real.set_accelerator(CPU_Accelerator())


def ninja_on_path() -> None:
    """Make sure a ``ninja`` is on PATH: append the one pip installed (a DeepSpeed dependency) if there is none.

    DeepSpeed's CPU accelerator compiles its shared-memory op (``deepspeed_shm_comm``) the first time a process
    group starts on a machine, and torch runs ``ninja`` from PATH to do it. pip puts ninja beside the interpreter
    (``.venv/bin``), which is not on PATH when the venv is not activated, as in the README's ``.venv/bin/python
    ray_jobs/sft.py``: on a machine without a system ninja every worker failed with "Unable to JIT load the
    deepspeed_shm_comm op due to ninja not being installed". A ninja already on PATH stays the one used.
    """
    import shutil

    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:  # DeepSpeed's build then names what is missing
        return
    os.environ["PATH"] = os.pathsep.join(p for p in (os.environ.get("PATH"), ninja.BIN_DIR) if p)


def init_distributed(use_gpu: bool, device: torch.device | None = None) -> None:
    """Join (or create) the process group. Ray Train has already created it; alone we use env:// vars.

    ``device``: this worker's GPU (Ray Train: ``ray.train.torch.get_device()``); default ``LOCAL_RANK``.
    Single process with no launcher: rank 0 of world 1 on a free local port.
    """
    select_accelerator(use_gpu)
    import deepspeed

    if not dist.is_initialized() and "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if use_gpu and torch.cuda.is_available():
        torch.cuda.set_device(device if device is not None else int(os.environ.get("LOCAL_RANK", "0")))
    # On CPU, DeepSpeed loads its shared-memory communication op here and prints "DeepSpeed ... built
    # successfully" from every rank, every run. Ray Train replaces `print` in its workers (the line goes to
    # the root logger), so `print` itself is swapped for the call; anything else printed is passed on.
    original, held = builtins.print, []

    def hold(*objects: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None, flush: bool = False) -> None:
        text = (sep if sep is not None else " ").join(map(str, objects))
        if file is None and text.endswith(" built successfully"):
            return
        held.append((objects, {"sep": sep, "end": end, "file": file, "flush": flush}))

    builtins.print = hold
    try:
        deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo", verbose=False)
    finally:
        builtins.print = original
    for objects, kwargs in held:
        print(*objects, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases and norm weights (1-D tensors), as is standard."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 partitioned params keep their shape in ds_shape
        (decay if len(shape) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _zero3_loading_context(ds_config: dict[str, Any], pretrained: bool) -> list[Any]:
    """Under ZeRO-3, let transformers load a pretrained model straight into partitions when it can.

    That needs ``accelerate`` (transformers' ``HfDeepSpeedConfig`` checks for it; peft pulls it in).
    Without it each rank builds the full model in CPU memory and ``deepspeed.initialize`` partitions
    it: same result, more host memory at start-up (fine for small models; install accelerate for 7B+).
    A random ``model.init`` is always built whole: transformers 4.57's ``_init_weights`` indexes the
    embedding's padding row, which a partitioned (empty) embedding does not have (IndexError), and a
    whole build draws the same weights as :func:`build_model` alone (what an adapter export needs).
    """
    if zero_stage(ds_config) != 3 or not pretrained:
        return []
    if importlib.util.find_spec("accelerate") is None:
        logger.info("ZeRO-3 without accelerate: the full model is built on each rank, then partitioned")
        return []
    from transformers.integrations import HfDeepSpeedConfig

    return [HfDeepSpeedConfig(ds_config)]  # must stay alive while the model is created


@dataclass
class TrainEngine:
    """The DeepSpeed engine plus what the step needs to know about it."""

    engine: Any  # deepspeed.DeepSpeedEngine
    tokenizer: Any
    ds_config: dict[str, Any]
    collate_mode: CollateMode
    mask_dtype: torch.dtype
    device: torch.device
    world_size: int
    rank: int
    layout: BatchLayout  # the step's global batch at this world size
    attn_implementation: str
    adapter: AdapterConfig = field(default_factory=AdapterConfig)  # model.adapter (type none: full fine-tuning)
    params: ParamCount = ParamCount(0, 0)  # trainable / total, counted before DeepSpeed wraps the model
    keepalive: list[Any] = field(default_factory=list)  # e.g. HfDeepSpeedConfig (must outlive loading)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on this rank (the layout's, at this world size)."""
        return self.layout.grad_accum

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    def collate_fn(self) -> PackedCollate:
        return PackedCollate(self.collate_mode, self.tokenizer.pad_token_id, self.mask_dtype)

    def dummy(self) -> dict[str, torch.Tensor]:
        return dummy_batch(self.collate_mode, self.tokenizer.pad_token_id, self.mask_dtype)


def build_engine(cfg: Config, load_universal: bool = False) -> TrainEngine:
    """Tokenizer, model, AdamW, LR schedule and DeepSpeed engine for this rank (process group must exist).

    The accumulation follows from the global batch at this world size (:mod:`pipelines.stream.batch`).
    ``load_universal``: the checkpoint this engine will load was saved at another world size and is
    converted to DeepSpeed's universal format first (:mod:`pipelines.train.checkpoint`).
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    train = cfg.train
    world_size = dist.get_world_size()
    layout = batch_layout(train, cfg.scaling, world_size)
    ds_config = resolve_deepspeed_config(train, world_size, cfg.scaling.use_gpu, cfg.base_dir,
                                         grad_accum=layout.grad_accum, load_universal=load_universal)
    keepalive = _zero3_loading_context(ds_config, pretrained=cfg.model.init is None)
    attn = resolve_attn_implementation(cfg.model.attn_implementation, cfg.scaling.use_gpu)
    tokenizer = load_tokenizer(cfg.model)
    torch.manual_seed(train.seed)
    # Pretrained weights load in bf16 (half the host memory; DeepSpeed keeps fp32 master weights in the
    # optimizer); a random init is drawn in fp32 so it is the same whether or not bf16 is on.
    dtype = torch.bfloat16 if (train.bf16 and cfg.model.init is None) else torch.float32
    model = build_model(cfg.model, tokenizer, attn, dtype, train.gradient_checkpointing)
    if cfg.model.adapter.enabled:  # frozen base + LoRA matrices; only those reach the optimizer
        model = apply_adapter(model, cfg.model.adapter, train.gradient_checkpointing)
    params = count_params(model)
    optimizer = torch.optim.AdamW(
        _param_groups(model, train.weight_decay),
        lr=train.learning_rate,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        foreach=False if not cfg.scaling.use_gpu else None,  # plain per-tensor loop on CPU, no fused kernels
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: build_scheduler(opt, train),
        config=ds_config,
        dist_init_required=False,
    )
    return TrainEngine(
        engine=engine,
        tokenizer=tokenizer,
        ds_config=ds_config,
        collate_mode=collate_mode_for(attn),
        mask_dtype=torch.bfloat16 if train.bf16 else torch.float32,
        device=torch.device(get_accelerator().current_device_name()),
        world_size=world_size,
        rank=dist.get_rank(),
        layout=layout,
        attn_implementation=attn,
        adapter=cfg.model.adapter,
        params=params,
        keepalive=keepalive,
    )


# --------------------------------------------------------------------------- one step


@dataclass
class StepStats:
    """One optimizer step: loss/lr/grad_norm/token and row counts are global (all ranks); ``data_wait_s``
    (blocked in the data iterator) and ``step_time_s`` (fetch + forward/backward + update) are this rank's."""

    loss: float
    lr: float
    grad_norm: float
    tokens: int
    supervised_tokens: int
    rows: int
    data_wait_s: float
    step_time_s: float


class BatchSource:
    """Wraps a micro-batch iterator: remembers exhaustion and accumulates time blocked in ``next()``."""

    def __init__(self, batches: Iterable[dict[str, torch.Tensor]]):
        self._it: Iterator[dict[str, torch.Tensor]] = iter(batches)
        self.exhausted = False
        self.wait_s = 0.0

    def next(self) -> dict[str, torch.Tensor] | None:
        if self.exhausted:
            return None
        t0 = time.perf_counter()
        try:
            return next(self._it)
        except StopIteration:
            self.exhausted = True
            return None
        finally:
            self.wait_s += time.perf_counter() - t0


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks of a few numbers (one small collective; identity when alone)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _forward_sum(te: TrainEngine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: batch[k].to(te.device, non_blocking=True) for k in MODEL_INPUTS if k in batch}
    out = te.engine(**inputs, use_cache=False)
    return summed_loss(out.logits, batch["labels"].to(te.device, non_blocking=True))


def _fp32_plain(engine: Any) -> bool:
    """DeepSpeed's fp32 path without ZeRO (``zero0``, ``bf16: false``): its optimizer is the plain torch
    one and the norm ``clip_fp32_gradients`` computes is discarded, so ``get_global_grad_norm()`` is None."""
    return not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """The 2-norm of all gradients, e.g. grads ``[3, 0]`` and ``[4]`` -> 5.0.

    Called after the accumulation boundary's backward, where DeepSpeed has all-reduced the gradients,
    so every rank holds the global gradient and gets the same norm.
    """
    sq = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
    return float(torch.sqrt(torch.stack(sq).sum())) if sq else 0.0


def train_step(te: TrainEngine, source: BatchSource) -> StepStats | None:
    """One optimizer step over G micro-batches per rank; ``None`` when every rank's data is exhausted."""
    t0 = time.perf_counter()
    wait0 = source.wait_s
    micro = []
    for _ in range(te.grad_accum):
        b = source.next()
        if b is None:
            break
        micro.append(b)
    local = [sum(supervised_tokens(b["labels"]) for b in micro), sum(int(b["num_tokens"]) for b in micro),
             sum(int(b["num_rows"]) for b in micro), len(micro)]
    n_sup, n_tok, n_rows, n_real = all_reduce_sum(local, te.device)
    if n_real == 0:
        return None
    micro += [te.dummy() for _ in range(te.grad_accum - len(micro))]
    scale = backward_scale(te.world_size, te.grad_accum, int(n_sup))
    lr = float(te.engine.optimizer.param_groups[0]["lr"])
    loss_sum = 0.0
    te.engine.train()
    own_norm = None
    for k, b in enumerate(micro):
        s = _forward_sum(te, b)
        te.engine.backward(s * scale)
        if k == len(micro) - 1 and _fp32_plain(te.engine):
            own_norm = grad_norm(te.engine.module.parameters())  # reduced, not yet clipped or applied
        te.engine.step()
        loss_sum += float(s.detach())
    (global_loss,) = all_reduce_sum([loss_sum], te.device)
    norm = te.engine.get_global_grad_norm() if own_norm is None else own_norm
    return StepStats(
        loss=global_loss / max(n_sup, 1),
        lr=lr,
        grad_norm=float(norm) if norm is not None else float("nan"),
        tokens=int(n_tok),
        supervised_tokens=int(n_sup),
        rows=int(n_rows),
        data_wait_s=source.wait_s - wait0,
        step_time_s=time.perf_counter() - t0,
    )


@torch.no_grad()
def evaluate(te: TrainEngine, batches: Iterable[dict[str, torch.Tensor]], max_batches: int | None) -> dict[str, float]:
    """Global token-mean loss and perplexity over an eval stream; ranks step in lock-step (ZeRO-3 safe)."""
    source = BatchSource(batches)
    loss_sum, n_sup, seen = 0.0, 0, 0
    te.engine.eval()
    try:
        while True:
            b = None if (max_batches is not None and seen >= max_batches) else source.next()
            (anyone,) = all_reduce_sum([0.0 if b is None else 1.0], te.device)
            if anyone == 0:
                break
            batch = b if b is not None else te.dummy()
            loss_sum += float(_forward_sum(te, batch))
            n_sup += supervised_tokens(batch["labels"])
            seen += b is not None
    finally:
        te.engine.train()
    total, count = all_reduce_sum([loss_sum, float(n_sup)], te.device)
    loss = total / max(count, 1.0)
    return {"eval_loss": loss, "eval_perplexity": float(np.exp(min(loss, 50.0))), "eval_tokens": int(count)}


# --------------------------------------------------------------------------- standalone check


def synthetic_rows(n: int, sequence_len: int, vocab: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Packed rows of learnable samples (a random word repeated: ``x y z x y z``), no Ray needed."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids, pos = [], []
        while len(ids) < sequence_len - 8:
            word = rng.integers(4, vocab, size=int(rng.integers(3, 8)))
            sample = np.concatenate([word, word])[: sequence_len - len(ids)]
            ids.extend(sample)
            pos.extend(range(len(sample)))
        ids_a = np.asarray(ids, dtype=np.int32)
        rows.append({"input_ids": ids_a, "labels": ids_a.copy(), "position_ids": np.asarray(pos, dtype=np.int32)})
    return rows


def micro_batches(rows: list[dict[str, np.ndarray]], te: TrainEngine, batch_size: int):
    """Collate a list of rows into micro-batches (what Ray Data's iter_torch_batches does in a worker)."""
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        yield collate_rows({k: [r[k] for r in chunk] for k in chunk[0]}, te.collate_mode,
                           te.tokenizer.pad_token_id, te.mask_dtype)


def main(argv: list[str] | None = None) -> None:
    """``[torchrun ...] python -m pipelines.train.step [--config X] [--steps N] [key=value ...]``.

    Trains N steps on synthetic packed rows without Ray and prints the loss per step.
    """
    from pipelines.config import load_config

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "../../configs/default.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.INFO)
    init_distributed(cfg.scaling.use_gpu)
    te = build_engine(cfg)
    per_rank = args.steps * cfg.train.gradient_accumulation_steps * cfg.train.micro_batch_size
    rows = synthetic_rows(per_rank, cfg.data.sequence_len, len(te.tokenizer), seed=te.rank)
    source = BatchSource(micro_batches(rows, te, cfg.train.micro_batch_size))
    for i in range(args.steps):
        stats = train_step(te, source)
        if stats is None:
            break
        if te.rank == 0:
            print(f"step {i + 1} loss {stats.loss:.4f} grad_norm {stats.grad_norm:.3f} "
                  f"tokens/s {stats.tokens / stats.step_time_s:.0f} attn {te.attn_implementation}", flush=True)


if __name__ == "__main__":
    main()
