"""Issue #14 repro through Ray Train: 16 records, 4 steps per epoch, ``train.epochs=2``. Restored from a
checkpoint on the last step of epoch 0, the run used to train 0 steps in "epoch 0", stop, and report
success with epoch 1 never trained; from a checkpoint on the first step of epoch 1 it must go on as well.
One run takes both restores (a fault after step 5, then after step 6): every sample once per epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from conftest import write_jsonl

from pipelines.config import config_from_dict
from pipelines.sources.listing import make_sample_id
from pipelines.stream.ledger import Ledger, sample_counts

N = 16
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _config(tmp_path: Path, name: str, checkpoint_every: int):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    write_jsonl(d / "part-0.jsonl", [{"text": f"record {i} " + "word " * (3 + i % 5)} for i in range(N)])
    return config_from_dict({
        "model": {"tokenizer": "demo://tokenizer",
                  "init": {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 128}},
        "data": {"sequence_len": 64, "packing": "none", "shuffle_seed": 3,
                 "datasets": [{"path": str(d), "type": "completion"}],
                 "tokenize": {"num_actors": 1, "num_cpus": 0.25}},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 2, "epochs": 2, "learning_rate": 1e-3,
                  "warmup_steps": 0, "log_every_steps": 1, "checkpoint_every_steps": checkpoint_every,
                  "deepspeed": "zero0"},
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}},
        "run": {"name": name, "storage_path": str(tmp_path / "runs"), "max_failures": 2, "export_model": False},
    })


def test_faults_after_epoch_boundary_checkpoints_train_both_epochs_once(ray_local, tmp_path, monkeypatch):
    """4 steps per epoch, a checkpoint every step. A fault after step 5 restores the checkpoint of step 4,
    the last of epoch 0 (its data state already says the epoch is done); a fault after step 6 restores the
    checkpoint of step 5, the first of epoch 1. Both restores in one run: every sample once per epoch."""
    from pipelines.train.trainer import build_trainer

    name = "boundary"
    monkeypatch.setenv("PIPELINES_FAULTS", "5:raise,6:raise")
    build_trainer(_config(tmp_path, name, 1)).fit()
    run = tmp_path / "runs" / name
    assert {p.name for p in (run / ".faults").iterdir()} == {"fault_step_5", "fault_step_6"}  # both fired
    resumes = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if json.loads(line).get("kind") == "resume"]
    assert resumes == [4, 5]  # restored from the last step of epoch 0, then from the first of epoch 1
    entries = Ledger(pafs.LocalFileSystem(), str(run / "ledger")).entries()
    assert [e.step for e in entries] == list(range(1, 9)), [e.step for e in entries]
    for epoch in (0, 1):
        counts = sample_counts(e for e in entries if e.epoch == epoch)
        assert counts == {make_sample_id(0, i): 1 for i in range(N)}, f"epoch {epoch}: {counts}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 8 and summary["epochs"] == 2
