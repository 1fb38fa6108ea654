"""The per-worker step without Ray: global token-mean loss and grad norm across ranks, accumulation and
ZeRO stages (zero2, and zero0 in fp32), uneven shards.

Processes are started with torch.multiprocessing (gloo, DeepSpeed CPU accelerator) -- the same code a
Ray Train worker runs, minus Ray, which also shows step.py works standalone.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import spawn_workers

from pipelines.config import config_from_dict
from pipelines.train.collate import collate_rows
from pipelines.train.loss import token_losses

TINY = {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 128}


def _cfg(grad_accum: int, deepspeed: str | dict = "zero2", bf16: bool = False):
    return config_from_dict({
        "model": {"tokenizer": "demo://tokenizer", "init": TINY, "attn_implementation": "sdpa"},
        "data": {"datasets": [{"path": "unused.jsonl"}], "sequence_len": 64},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": grad_accum, "learning_rate": 1e-2,
                  "deepspeed": deepspeed, "bf16": bf16, "max_grad_norm": 100.0, "warmup_steps": 0,
                  "lr_scheduler": "constant", "weight_decay": 0.0},
    })


def _rows() -> list[dict[str, np.ndarray]]:
    """4 packed rows with very different numbers of supervised tokens (2 .. 40)."""
    rng = np.random.default_rng(0)
    rows = []
    for length, supervised in [(40, 40), (12, 3), (60, 20), (30, 2)]:
        ids = rng.integers(4, 260, size=length).astype(np.int32)
        labels = ids.copy()
        labels[: length - supervised] = -100
        half = length // 2  # two packed samples per row
        pos = np.concatenate([np.arange(half), np.arange(length - half)]).astype(np.int32)
        rows.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return rows


def _worker(rank: int, world: int, port: int, cfg_raw: dict, shards: list, out_dir: str, max_steps: int) -> None:
    # The rendezvous store is the test's (see _launch): every rank is its client, as under torchrun's agent.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    from pipelines.train.step import BatchSource, build_engine, init_distributed, micro_batches, train_step

    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_raw)
    init_distributed(use_gpu=False)
    te = build_engine(cfg)
    source = BatchSource(micro_batches(shards[rank], te, cfg.train.micro_batch_size))
    stats = []
    for _ in range(max_steps):
        s = train_step(te, source)
        if s is None:
            break
        stats.append(s)
    from pipelines.train.export import consolidated_state_dict

    weights = consolidated_state_dict(te)
    if rank == 0:
        torch.save({"stats": stats, "weights": weights}, os.path.join(out_dir, "result.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _launch(world: int, cfg, shards, tmp_path, max_steps: int = 10) -> dict:
    # The store binds port 0 here and the workers get the port it read back (no probing for a free port).
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)
    spawn_workers(_worker, (world, store.port, cfg.model_dump(mode="json"), shards, str(tmp_path), max_steps), world)
    del store
    return torch.load(tmp_path / "result.pt", weights_only=False)


def _reference(rows) -> tuple[float, float]:
    """Plain torch, one process: token-mean loss over all rows and the norm of its gradient."""
    from pipelines.train.model import build_model, load_tokenizer

    cfg = _cfg(1)
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg.model, tok, "sdpa")
    total, count = 0.0, 0
    for r in rows:
        b = collate_rows({k: [r[k]] for k in r}, "mask", tok.pad_token_id)
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                       attention_mask=b["attention_mask"]).logits
        losses = token_losses(logits, b["labels"])
        total = total + losses.sum()
        count += int((b["labels"][:, 1:] != -100).sum())
    loss = total / count
    loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), float(norm)


def _mean_of_row_means(rows) -> float:
    """What a per-row average would report -- must differ, or the test could not tell the two apart."""
    from pipelines.train.model import build_model, load_tokenizer

    cfg = _cfg(1)
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg.model, tok, "sdpa")
    means = []
    with torch.no_grad():
        for r in rows:
            b = collate_rows({k: [r[k]] for k in r}, "mask", tok.pad_token_id)
            losses = token_losses(model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                                        attention_mask=b["attention_mask"]).logits, b["labels"])
            means.append(float(losses.sum() / (b["labels"][:, 1:] != -100).sum()))
    return float(np.mean(means))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_global_token_mean_two_workers_vs_one(tmp_path):
    rows = _rows()
    ref_loss, ref_norm = _reference(rows)
    assert abs(_mean_of_row_means(rows) - ref_loss) > 1e-3

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _launch(1, _cfg(4), [rows], tmp_path / "one", max_steps=1)  # 1 worker x 4 micro-batches
    # 2 workers x 2, on DeepSpeed's fp32 path without ZeRO (zero0, bf16 false), whose own norm is discarded.
    two = _launch(2, _cfg(2, deepspeed="zero0"), [rows[:2], rows[2:]], tmp_path / "two", max_steps=1)
    s1, s2 = one["stats"][0], two["stats"][0]
    # Every label except each sample's first token (position 0) is a target.
    expected = sum(int(((r["labels"] != -100) & (r["position_ids"] != 0)).sum()) for r in rows)
    assert s1.supervised_tokens == s2.supervised_tokens == expected
    assert s1.loss == pytest.approx(ref_loss, rel=1e-5)
    assert s2.loss == pytest.approx(ref_loss, rel=1e-5)
    assert s1.grad_norm == pytest.approx(ref_norm, rel=1e-4)
    assert s2.grad_norm == pytest.approx(ref_norm, rel=1e-4)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uneven_shards_same_step_count_zero3(tmp_path):
    """Rank 0 has 5 micro-batches, rank 1 has 1: with G=2 both ranks take 3 steps and nobody hangs."""
    rows = _rows()
    shards = [[rows[0], rows[1], rows[2], rows[3], rows[0]], [rows[2]]]
    zero3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    res = _launch(2, _cfg(2, deepspeed=zero3, bf16=True), shards, tmp_path, max_steps=10)
    stats = res["stats"]
    assert len(stats) == 3
    assert [s.rows for s in stats] == [3, 2, 1]  # step 1: 2 + 1 rows, then rank 0 alone
    assert all(np.isfinite(s.loss) and s.loss > 0 for s in stats)
    assert set(res["weights"]) and all(torch.isfinite(w.float()).all() for w in res["weights"].values())
