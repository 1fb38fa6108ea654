"""GPU self-check of the training path, without Ray: packed == unpacked loss per attention kernel,
tokens/s, MFU and peak memory, for a few model sizes built from local configs (nothing downloaded).

On one GPU (not yet run on one: no GPU has been available to this project; see BENCHMARKS.md)::

    # 1. where the project is installed (Ray importable; no cluster is started): packed rows made by
    #    the project's own reader, tokenizer and packer (``iter_packed_local``) from the demo SFT data
    python benchmarks/gpu_check.py --save-rows rows.npz --seq-len 2048
    # 2. on the GPU box: needs torch, transformers, numpy, pydantic, pyyaml and this checkout's
    #    ``pipelines/`` (Ray is not imported); flash-attn optional
    python benchmarks/gpu_check.py --rows rows.npz --sizes 125m,350m,1b --seq-len 2048 --micro-batch 4
    # (with Ray installed there too, step 1 can be skipped: the rows are then made in-process)

CPU smoke mode, run by ``tests/test_gpu_check.py`` so the script cannot rot::

    python benchmarks/gpu_check.py --save-rows rows.npz --seq-len 1024
    python benchmarks/gpu_check.py --tiny --rows rows.npz

What it checks, per size and per attention implementation available:

* ``equal``: the packed micro-batch's summed token loss (samples kept apart by the implementation's
  mask) equals the sum of each sample's loss run alone, unpacked: relative difference of the sums
  <= 1e-5 (fp32) / 2e-2 (bf16) and every token's loss within 1e-4 / 0.1 nats. Implementations:
  ``sdpa`` + the collate's 4D block mask (``pipelines.train.collate``, mode ``mask``),
  ``flash_attention_2`` on the flattened batch (mode ``flatten``; varlen kernel from position_ids),
  ``flex_attention`` with transformers' document mask built from position_ids (no 4D tensor).
* ``tok/s``: real (unpadded) tokens per second of forward + backward + AdamW steps after warm-up.
* ``MFU`` = achieved FLOP/s / peak FLOP/s, with training FLOPs per token (PaLM, appendix B)::

      flops_per_token = 6 * N + 12 * n_layers * d_model * S
      N = parameters without the input embedding;  S = mean sample length (a packed token attends
      within its own sample only);  peak = --peak-tflops, or a table of dense bf16 peaks by GPU name.

* ``peak mem``: ``torch.cuda.max_memory_allocated`` (CPU: the process's max RSS).

Output: a markdown table and one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines.train.collate import collate_rows  # noqa: E402  (Ray-free)
from pipelines.train.loss import summed_loss, supervised_tokens, token_losses  # noqa: E402

# Llama-style sizes: (hidden, intermediate, layers, heads, kv heads, vocab)
SIZES = {
    "tiny": (64, 128, 2, 4, 4, 260),
    "125m": (768, 2048, 12, 12, 12, 32000),
    "350m": (1024, 2816, 24, 16, 16, 32000),
    "1b": (2048, 5632, 22, 32, 4, 32000),  # the TinyLlama-1.1B shape
}
# Dense bf16 peak TFLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0,
               "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "4090": 165.0}
ATTNS = ("sdpa", "flash_attention_2", "flex_attention")


# --------------------------------------------------------------------------- rows


def make_rows(seq_len: int) -> list[dict[str, np.ndarray]]:
    """Packed rows of the demo SFT data, made by the project's pipeline in this process (needs Ray importable)."""
    from pipelines.config import load_config
    from pipelines.stream.stages import iter_packed_local

    cfg = load_config(REPO / "configs" / "default.yaml", [f"data.sequence_len={seq_len}", "data.eval_fraction=0"])
    rows = []
    for table in iter_packed_local(cfg, "train"):
        cols = {c: table.column(c).to_pylist() for c in ("input_ids", "labels", "position_ids")}
        rows += [{c: np.asarray(cols[c][i], dtype=np.int64) for c in cols} for i in range(table.num_rows)]
    return rows


def save_rows(rows: list[dict[str, np.ndarray]], path: str) -> None:
    """Flat arrays + offsets: loadable with numpy alone."""
    lengths = np.asarray([len(r["input_ids"]) for r in rows])
    np.savez_compressed(path, lengths=lengths, **{c: np.concatenate([r[c] for r in rows])
                                                  for c in ("input_ids", "labels", "position_ids")})


def load_rows(path: str) -> list[dict[str, np.ndarray]]:
    with np.load(path) as z:  # each z[key] decompresses the whole array: read each once
        cols = {c: z[c] for c in ("input_ids", "labels", "position_ids")}
        lengths = z["lengths"]
    ends = np.cumsum(lengths)
    return [{c: v[a:b] for c, v in cols.items()} for a, b in zip(ends - lengths, ends, strict=True)]


# --------------------------------------------------------------------------- model


def build(size: str, attn: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    return model.to(device)


def available_attns(device: torch.device) -> dict[str, str]:
    """Implementation -> "" when usable here, else why not."""
    import importlib.util

    out = {"sdpa": ""}
    if device.type != "cuda":
        out["flash_attention_2"] = "needs CUDA"
    elif importlib.util.find_spec("flash_attn") is None:
        out["flash_attention_2"] = "flash_attn not installed"
    else:
        out["flash_attention_2"] = ""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        out["flex_attention"] = ""
    except ImportError as err:
        out["flex_attention"] = f"not in this torch ({err})"
    if device.type == "cpu" and not out["flex_attention"]:
        # torch 2.14 on CPU: "FlexAttention does not support backward on CPU", and transformers compiles
        # the block mask (inductor, C++) which took > 4 min on the 2-core dev machine: GPU only here.
        out["flex_attention"] = "CPU: no flex-attention backward in this torch; block-mask compile takes minutes"
    return out


def collate_for(attn: str, rows: list[dict[str, np.ndarray]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The project's collate: sdpa gets the 4D block mask, FA2 the flattened row, flex position_ids only."""
    cols = {k: [r[k] for r in rows] for k in ("input_ids", "labels", "position_ids")}
    mode = "flatten" if attn == "flash_attention_2" else "mask"
    batch = collate_rows(cols, mode, 0, dtype)
    if attn == "flex_attention":
        batch.pop("attention_mask")  # transformers builds a document BlockMask from position_ids
    return batch


def _inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: batch[k].to(device) for k in ("input_ids", "position_ids", "attention_mask") if k in batch}


def samples_of(row: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Split a packed row back into its samples (positions restart at 0)."""
    starts = np.flatnonzero(row["position_ids"] == 0).tolist() + [len(row["input_ids"])]
    return [{k: v[a:b] for k, v in row.items()} for a, b in zip(starts[:-1], starts[1:], strict=True)]


# --------------------------------------------------------------------------- checks


@torch.no_grad()
def equality(model, attn: str, rows, device, dtype) -> tuple[float, float, float]:
    """(packed summed loss, sum of the samples' losses run alone, max per-token |difference|) over ``rows``.

    Per token, not only the sums: a leaking mask changes every later sample's token losses, by little
    on a random-init model, and errors of both signs could cancel in a sum.
    """
    packed = collate_for(attn, rows, dtype)
    packed_tl = token_losses(model(**_inputs(packed, device), use_cache=False).logits, packed["labels"].to(device))
    flat = attn == "flash_attention_2"  # one concatenated row
    alone_sum, max_diff, offset = 0.0, 0.0, 0
    for i, row in enumerate(rows):
        base = offset if flat else 0
        for sample in samples_of(row):
            b = collate_rows({k: [v] for k, v in sample.items()}, "mask", 0, dtype, pad_to_multiple_of=1)
            b.pop("attention_mask")  # one sample, no padding: plain causal attention
            tl = token_losses(model(**_inputs(b, device), use_cache=False).logits, b["labels"].to(device))[0]
            n = tl.shape[0]
            mine = packed_tl[0 if flat else i, base:base + n]
            max_diff = max(max_diff, float((mine - tl).abs().max()) if n else 0.0)
            alone_sum += float(tl.sum())
            base += n + 1
        offset += len(row["input_ids"])
    return float(packed_tl.sum()), alone_sum, max_diff


def throughput(model, attn: str, rows, micro: int, steps: int, device, dtype) -> dict[str, float]:
    """Forward + backward + AdamW over packed micro-batches; tokens/s after one warm-up step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if len(rows) < (steps + 1) * micro:
        raise ValueError(f"need {(steps + 1) * micro} rows, have {len(rows)}")
    batches = [collate_for(attn, rows[i * micro:(i + 1) * micro], dtype) for i in range(steps + 1)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens, elapsed = 0, 0.0
    for i, b in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        loss = summed_loss(model(**_inputs(b, device), use_cache=False).logits, b["labels"].to(device))
        (loss / max(supervised_tokens(b["labels"]), 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i:  # the first step compiles kernels / allocates: warm-up
            elapsed += time.perf_counter() - t0
            tokens += int(b["num_tokens"])
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"tokens_per_s": tokens / elapsed, "peak_mem_gib": peak / 2**30, "steps": len(batches) - 1}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(model, mean_sample_len: float) -> float:
    """6 N + 12 L d S (see the module docstring); N excludes the input embedding."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * mean_sample_len


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny model, fp32, seq 1024, 2 steps")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--sizes", default="125m,350m,1b")
    p.add_argument("--attn", default=",".join(ATTNS))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--check-rows", type=int, default=2, help="packed rows in the equality check")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--rows", default=None, help="packed rows saved by --save-rows (else made in-process)")
    p.add_argument("--save-rows", default=None, help="make the packed rows, save them here, exit")
    args = p.parse_args(argv)
    if args.tiny:
        # demo samples are ~250 byte-level tokens: 1024 packs ~4 per row, so the masks matter
        args.device, args.sizes, args.seq_len, args.micro_batch, args.steps, args.check_rows = "cpu", "tiny", 1024, 1, 2, 1
    if args.save_rows:
        rows = make_rows(args.seq_len)
        save_rows(rows, args.save_rows)
        print(f"saved {len(rows)} packed rows (sequence_len {args.seq_len}) to {args.save_rows}")
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # relative, on the summed loss
    token_tol = 1e-1 if dtype == torch.bfloat16 else 1e-4  # absolute, per token (nats)
    rows = load_rows(args.rows) if args.rows else make_rows(args.seq_len)
    if max(len(r["input_ids"]) for r in rows) > args.seq_len:
        raise SystemExit(f"--rows were packed for a longer sequence than --seq-len {args.seq_len}")
    mean_len = float(np.mean([len(s["input_ids"]) for r in rows[:64] for s in samples_of(r)]))
    if min(len(samples_of(r)) for r in rows[: args.check_rows]) < 2:
        raise SystemExit("the equality check needs rows of >= 2 samples; use a longer --seq-len")
    usable = available_attns(device)
    peak = peak_flops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name} | {dtype} | seq {args.seq_len} | micro-batch {args.micro_batch} | rows {len(rows)} "
          f"(mean sample {mean_len:.0f} tokens) | torch {torch.__version__} | peak {peak and peak / 1e12} TFLOP/s")
    print("| size | attention | packed loss | unpacked loss | rel diff | max token diff | equal | backward | tok/s | MFU "
          "| peak mem GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results, failures = [], 0
    for size in args.sizes.split(","):
        for attn in args.attn.split(","):
            res = {"size": size, "attn": attn, "device": name, "dtype": str(dtype)}
            if usable.get(attn):
                res["skipped"] = usable[attn]
                print(f"| {size} | {attn} | - | - | - | - | skipped: {usable[attn]} | | | | |")
                results.append(res)
                continue
            model = build(size, attn, device, dtype)
            got, alone, token_diff = equality(model, attn, rows[: args.check_rows], device, dtype)
            rel = abs(got - alone) / max(abs(alone), 1e-9)
            res.update(packed_loss=got, unpacked_loss=alone, rel_diff=rel, max_token_diff=token_diff,
                       equal=rel <= tol and token_diff <= token_tol)
            failures += not res["equal"]
            try:
                res.update(throughput(model, attn, rows, args.micro_batch, args.steps, device, dtype))
                res["backward"] = "ok"
            except NotImplementedError as err:  # e.g. flex-attention has no backward on CPU (torch 2.14)
                res["backward"] = f"unsupported: {str(err).split('.')[0]}"
            if "tokens_per_s" in res:
                fpt = flops_per_token(model, mean_len)
                res["flops_per_token"] = fpt
                res["mfu"] = res["tokens_per_s"] * fpt / peak if peak else None
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            mfu = f"{100 * res['mfu']:.1f}%" if res.get("mfu") is not None else "n/a"
            tps = f"{res['tokens_per_s']:,.0f}" if "tokens_per_s" in res else "-"
            mem = f"{res['peak_mem_gib']:.2f}" if "peak_mem_gib" in res else "-"
            print(f"| {size} | {attn} | {got:.4f} | {alone:.4f} | {rel:.1e} | {token_diff:.1e} | "
                  f"{'yes' if res['equal'] else 'NO'} | "
                  f"{res['backward']} | {tps} | {mfu} | {mem} |", flush=True)
            results.append(res)
    print("RESULT " + json.dumps({"results": results, "failures": failures, "tolerance": tol, "token_tolerance": token_tol},
                                 default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v)))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
