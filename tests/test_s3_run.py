"""A run directory on object storage (moto on loopback): ``run.storage_path=s3://...`` with
``storage.endpoint_url``, a SIGKILL of a training worker mid-epoch, and everything under the bucket.

This failed before any training (Ray Train got ``s3://`` URLs together with a custom filesystem:
``ArrowInvalid: Expected an S3 object path of the form 'bucket/key...'``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from conftest import write_jsonl

from pipelines.config import config_from_dict
from pipelines.sources.listing import make_sample_id
from pipelines.stream.ledger import Ledger, sample_counts

N = 96
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _data(tmp_path: Path) -> Path:
    rng = random.Random(1)
    words = ["sun", "moon", "river", "stone", "cloud", "tree"]
    recs = []
    for i in range(N):
        w = " ".join(rng.choice(words) for _ in range(1 + i % 5))
        recs.append({"segments": [{"text": f"Q: reverse '{w}'\nA:", "label": False},
                                  {"text": " " + " ".join(reversed(w.split())), "label": True}]})
    return write_jsonl(tmp_path / "qa.jsonl", recs)


def test_s3_run_dir_with_sigkill_mid_epoch_is_exactly_once(moto_s3, ray_local, tmp_path, monkeypatch):
    from pipelines.train.trainer import build_trainer

    moto_s3.make_bucket("runs")
    raw = {
        "model": {"tokenizer": "demo://tokenizer",
                  "init": {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 128}},
        "data": {"sequence_len": 64, "packing": "bfd", "pack_buffer_size": 16, "shuffle_seed": 3,
                 "datasets": [{"path": str(_data(tmp_path)), "type": "input_output"}],
                 "tokenize": {"num_actors": 1, "num_cpus": 0.25}},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "epochs": 1, "learning_rate": 3e-3,
                  "lr_scheduler": "constant", "log_every_steps": 1, "checkpoint_every_steps": 3,
                  "deepspeed": "zero2"},
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}},
        "run": {"name": "r", "storage_path": "s3://runs/exp", "max_failures": 1, "export_model": True},
        "storage": {"endpoint_url": moto_s3.endpoint},
    }
    monkeypatch.setenv("PIPELINES_FAULTS", "5:kill")  # SIGKILL of the last rank after step 5
    result = build_trainer(config_from_dict(raw)).fit()
    assert result.error is None

    fs = moto_s3.fs()
    root = "runs/exp/r"
    names = {i.path[len(root) + 1:] for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
             if i.type == pafs.FileType.File}
    ckpts = sorted({n.split("/")[0] for n in names if n.startswith("checkpoint_0")})
    assert ckpts and all(f"{c}/manifest.json" in names and f"{c}/trainer_state.json" in names for c in ckpts)
    assert any(n.startswith("tensorboard/") and "tfevents" in n for n in names), names
    assert {"model/config.json", "summary.json", "metrics.jsonl"} <= names

    with fs.open_input_stream(f"{root}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f.read().decode().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "resume"] == [3]  # the kill undid steps 4-5

    entries = Ledger(fs, f"{root}/ledger").entries()
    counts = sample_counts(entries)
    assert set(counts) == {make_sample_id(0, i) for i in range(N)}
    assert set(counts.values()) == {1}
    assert [e.step for e in entries] == list(range(1, len(entries) + 1))
    assert len(entries) > 5
