"""Full fine-tuning vs LoRA, side by side: ``python benchmarks/lora.py [--steps N] [--quick]``.

The same model (a randomly initialised Llama, ~25M parameters: hidden 512, 8 layers, MLP 1376, the
demo tokenizer), the same rows and the same DeepSpeed ZeRO-2 engine on 2 CPU worker processes, once
training every weight and once with ``model.adapter: {type: lora, r: 16, target_modules: all-linear}``.
The rows are the demo SFT stream (``build_dataset`` on ``demo://sft``, packed to 256 tokens), taken once
and handed to both runs, so the data path costs both the same (nothing). Each worker is the per-step
code a Ray Train worker runs (``pipelines.train.step``), started by torch.multiprocessing so each
process can measure itself:

* trainable parameters (peft's count for LoRA),
* optimizer-state bytes per rank: what the rank's torch AdamW holds (its fp32 parameters -- ZeRO-2's
  flat master partition -- plus ``exp_avg`` and ``exp_avg_sq``),
* peak RSS per worker (``ru_maxrss``, includes ~0.5 GB of torch/DeepSpeed/transformers imports),
* steps/s over the steps after ``--warmup``, mean of the two ranks' step times.

fp32 throughout (bf16 matmuls are slow on AVX2 CPUs, and would make both runs slower alike).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"architecture": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
         "num_attention_heads": 8, "max_position_embeddings": 512, "seed": 0}
QUICK_MODEL = {**MODEL, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
LORA = {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def config(model: dict, adapter: dict | None, micro_batch: int):
    from pipelines.config import config_from_dict

    raw = {
        "model": {"tokenizer": "demo://tokenizer", "init": model, "attn_implementation": "sdpa"},
        "data": {"datasets": [{"path": "demo://sft", "type": "alpaca"}], "sequence_len": 256,
                 "pack_buffer_size": 512, "tokenize": {"num_actors": 1, "num_cpus": 0.5}},
        "train": {"micro_batch_size": micro_batch, "learning_rate": 2e-3 if adapter else 5e-4, "bf16": False,
                  "deepspeed": "zero2", "lr_scheduler": "constant", "warmup_steps": 0},
        "scaling": {"num_workers": 2},
    }
    if adapter:
        raw["model"]["adapter"] = adapter
    return config_from_dict(raw)


def stream_rows(cfg, n: int) -> list[dict]:
    """The first ``n`` packed rows of the demo stream (read -> tokenize -> pack in Ray), as numpy arrays."""
    import numpy as np
    import ray

    from pipelines.ray_local import init_local
    from pipelines.stream.dataset import build_dataset

    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = build_dataset(cfg, split="train").take(n)
    finally:
        ray.shutdown()
    keep = ("input_ids", "labels", "position_ids")
    return [{k: np.asarray(r[k], dtype=np.int32) for k in keep} for r in rows]


def optimizer_state_bytes(engine) -> int:
    """Bytes the rank's torch optimizer holds: its parameters (ZeRO's fp32 partition) + Adam moments."""
    import torch

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed wraps the client AdamW
    seen, total = set(), 0
    tensors = [p for g in inner.param_groups for p in g["params"]]
    tensors += [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _worker(rank: int, world: int, port: int, cfg_raw: dict, rows: list, steps: int, warmup: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    from pipelines.config import config_from_dict
    from pipelines.train.step import BatchSource, build_engine, init_distributed, micro_batches, train_step

    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_raw)
    init_distributed(use_gpu=False)
    te = build_engine(cfg)
    source = BatchSource(micro_batches(rows[rank::world], te, cfg.train.micro_batch_size))
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        stats = train_step(te, source)
        if stats is None:
            break
        times.append(time.perf_counter() - t0)
        losses.append(stats.loss)
    rec = {"rank": rank, "trainable": te.params.trainable, "total": te.params.total,
           "opt_bytes": optimizer_state_bytes(te.engine), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "step_s": statistics.fmean(times[warmup:]), "steps": len(times), "loss_first": losses[0], "loss_last": losses[-1]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run(cfg, rows: list, steps: int, warmup: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(2, port, cfg.model_dump(mode="json"), rows, steps, warmup, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    return {"trainable": ranks[0]["trainable"], "total": ranks[0]["total"],
            "opt_bytes_per_rank": [r["opt_bytes"] for r in ranks], "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
            "steps_per_s": 1.0 / statistics.fmean(r["step_s"] for r in ranks), "steps": ranks[0]["steps"],
            "loss_first": ranks[0]["loss_first"], "loss_last": ranks[0]["loss_last"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 5 steps: a smoke run")
    args = parser.parse_args(argv)
    steps, warmup = (5, 1) if args.quick else (args.steps, args.warmup)
    model = QUICK_MODEL if args.quick else MODEL

    full_cfg, lora_cfg = config(model, None, args.micro_batch), config(model, LORA, args.micro_batch)
    rows = stream_rows(full_cfg, steps * args.micro_batch * 2)
    results = {"full": run(full_cfg, rows, steps, warmup), "lora": run(lora_cfg, rows, steps, warmup)}

    full, lora = results["full"], results["lora"]
    print(f"lora benchmark: Llama hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, "
          f"{full['total']:,} parameters; ZeRO-2, 2 CPU workers, micro-batch {args.micro_batch} x 256 tokens, fp32; "
          f"{steps} steps ({warmup} warm-up left out of steps/s); same {len(rows)} rows of the demo SFT stream")
    print("| | full fine-tuning | LoRA r=16 all-linear | LoRA / full |")
    print("|---|---|---|---|")
    print(f"| trainable parameters | {full['trainable']:,} | {lora['trainable']:,} ({lora['trainable'] / lora['total']:.2%}) "
          f"| {lora['trainable'] / full['trainable']:.4f} |")
    fo, lo = max(full["opt_bytes_per_rank"]), max(lora["opt_bytes_per_rank"])
    print(f"| optimizer-state bytes per rank (fp32 partition + Adam moments) | {fo / 2**20:,.1f} MiB | {lo / 2**20:,.2f} MiB | {lo / fo:.4f} |")
    fr, lr = max(full["peak_rss_mb"]), max(lora["peak_rss_mb"])
    print(f"| peak RSS per worker (max of 2) | {fr:,.0f} MB | {lr:,.0f} MB | {lr / fr:.3f} |")
    print(f"| steps/s | {full['steps_per_s']:.3f} | {lora['steps_per_s']:.3f} | {lora['steps_per_s'] / full['steps_per_s']:.3f} |")
    print(f"| loss, first -> last step | {full['loss_first']:.3f} -> {full['loss_last']:.3f} "
          f"| {lora['loss_first']:.3f} -> {lora['loss_last']:.3f} | |")
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
