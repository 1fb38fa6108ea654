"""Where one training step of the embedded default spends its time on CPU (no Ray).

    .venv/bin/python benchmarks/cpu_step.py [--steps 8] [--threads 1] [--variants a,b,...] [key=value ...]

Builds the default config's model (``configs/default.yaml`` plus overrides) in this process, feeds it
the demo data packed by the project's own code (``iter_packed_local``) and times one optimizer step
per variant, side by side in one run (each variant: fresh model, same rows, ``--steps`` steps; the
first step is reported apart, the rest as a median). Wall time and this process's CPU time are both
reported: CPU time is the steadier number on a shared machine.

Variants (name: what changes against the step the training job runs):

* ``torch-fp32-nomask``: plain torch AdamW, fp32, causal only (samples NOT isolated: a lower bound),
* ``torch-fp32-mask4d``: plain torch, fp32, the collate's additive 4D block mask,
* ``torch-bf16-mask4d``: plain torch, bf16 weights and mask (what DeepSpeed's bf16 mode computes in),
* ``torch-fp32-flex``: plain torch, fp32, flex-attention document mask (compiled block mask),
* ``ds-zero2-bf16``: DeepSpeed ZeRO-2 bf16, 4D mask (the old default),
* ``ds-zero2-fp32``: DeepSpeed ZeRO-2 fp32, 4D mask,
* ``ds-zero0-fp32``: DeepSpeed ZeRO-0 fp32, 4D mask.

A Ray Train worker with ``resources_per_worker: {CPU: 0.5}`` runs torch with one thread
(Ray sets ``OMP_NUM_THREADS=1``), hence ``--threads 1``. World size is 1 here: gloo's gradient
all-reduce across the 2 workers is measured by the job itself (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

VARIANTS = ["torch-fp32-nomask", "torch-fp32-mask4d", "torch-bf16-mask4d", "torch-fp32-flex",
            "ds-zero2-bf16", "ds-zero2-fp32", "ds-zero0-fp32"]


def packed_rows(cfg, n: int) -> list[dict]:
    """The first ``n`` packed rows of the config's train stream, made in this process."""
    from pipelines.stream.dataset import iter_packed_local

    rows: list[dict] = []
    for table in iter_packed_local(cfg, "train"):
        cols = {c: table.column(c).to_pylist() for c in ("input_ids", "labels", "position_ids")}
        rows += [{c: cols[c][i] for c in cols} for i in range(table.num_rows)]
        if len(rows) >= n:
            return rows[:n]
    assert rows, "no rows"
    return (rows * (n // len(rows) + 1))[:n]


def batches(rows: list[dict], micro: int, mode: str, mask_dtype):
    import numpy as np

    from pipelines.train.collate import collate_rows

    out = []
    for i in range(0, len(rows), micro):
        chunk = rows[i:i + micro]
        cols = {k: [np.asarray(r[k]) for r in chunk] for k in ("input_ids", "labels", "position_ids")}
        b = collate_rows(cols, "mask", 0, mask_dtype)
        if mode == "nomask":
            b.pop("attention_mask")
            b.pop("position_ids")
        elif mode == "flex":
            b.pop("attention_mask")  # transformers builds the document BlockMask from position_ids
        out.append(b)
    return out


def run_variant(name: str, cfg, rows: list[dict], steps: int) -> dict:
    import torch

    from pipelines.train.loss import summed_loss, supervised_tokens
    from pipelines.train.model import build_model, load_tokenizer

    micro = cfg.train.micro_batch_size
    bf16 = "bf16" in name
    mode = "nomask" if "nomask" in name else ("flex" if "flex" in name else "mask4d")
    attn = "flex_attention" if mode == "flex" else "sdpa"
    tok = load_tokenizer(cfg.model)
    t_build = time.perf_counter()
    model = build_model(cfg.model, tok, attn, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.learning_rate, foreach=False)
    if name.startswith("ds-"):
        import deepspeed

        from pipelines.train.deepspeed_config import resolve_deepspeed_config

        train = cfg.train.model_copy(update={"bf16": bf16, "deepspeed": name.split("-")[1]})
        ds_cfg = resolve_deepspeed_config(train, 1, False, cfg.base_dir)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg, dist_init_required=False)

        def step(b):
            s = summed_loss(engine(**inputs(b), use_cache=False).logits, b["labels"])
            engine.backward(s / max(supervised_tokens(b["labels"]), 1))
            engine.step()
            return float(s)
    else:
        if bf16:
            model = model.to(torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.learning_rate, foreach=False)

        def step(b):
            s = summed_loss(model(**inputs(b), use_cache=False).logits, b["labels"])
            (s / max(supervised_tokens(b["labels"]), 1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(s)
    build_s = time.perf_counter() - t_build
    data = batches(rows, micro, mode, torch.bfloat16 if bf16 else torch.float32)
    walls, cpus = [], []
    for b in data[:steps]:
        w0, c0 = time.perf_counter(), time.process_time()
        step(b)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    rest_w, rest_c = walls[1:] or walls, cpus[1:] or cpus
    return {"variant": name, "build_s": build_s, "first_wall_s": walls[0], "first_cpu_s": cpus[0],
            "step_wall_s": statistics.median(rest_w), "step_cpu_s": statistics.median(rest_c)}


def inputs(b: dict) -> dict:
    return {k: b[k] for k in ("input_ids", "position_ids", "attention_mask") if k in b}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "default.yaml"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import torch

    from pipelines.config import load_config
    from pipelines.train.step import init_distributed

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    init_distributed(False)
    rows = packed_rows(cfg, args.steps * cfg.train.micro_batch_size)
    print(f"model {cfg.model.init}; micro_batch {cfg.train.micro_batch_size} x seq {cfg.data.sequence_len}; "
          f"torch threads {torch.get_num_threads()}; load {os.getloadavg()}")
    print("| variant | build s | first step wall s | first step CPU s | steady step wall s | steady step CPU s |")
    print("|---|---|---|---|---|---|")
    for name in args.variants.split(","):
        try:
            r = run_variant(name, cfg, rows, args.steps)
        except Exception as err:  # a variant that does not run here is reported, not fatal
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:120]} | | | | |", flush=True)
            continue
        print(f"| {name} | {r['build_s']:.2f} | {r['first_wall_s']:.3f} | {r['first_cpu_s']:.3f} | "
              f"{r['step_wall_s']:.3f} | {r['step_cpu_s']:.3f} |", flush=True)
    print(f"load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
