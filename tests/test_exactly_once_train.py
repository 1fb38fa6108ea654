"""Exactly-once training data through Ray Train: failures, SIGKILL, and world-size changes.

Every fit trains a tiny Llama on 600 short question/answer samples in two datasets mixed 3:1 by
tokens (the project's byte-level demo tokenizer) with packing on, 2 CPU workers unless said
otherwise, and reads the run's ledger.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from conftest import write_jsonl

from pipelines.config import config_from_dict
from pipelines.sources.listing import make_sample_id, split_sample_id
from pipelines.stream.ledger import Ledger, sample_counts

N_SAMPLES, N_FILES = 600, 3
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


WEIGHTS = (3.0, 1.0)  # files 0-1 are the first dataset, file 2 the second: mixed 3:1 by tokens


def _data(tmp_path: Path) -> tuple[Path, Path]:
    """Two datasets of the same kind of samples: ``qa/`` (files 0 and 1) and ``qa_more/`` (file 2)."""
    dirs = (tmp_path / "qa", tmp_path / "qa_more")
    for d in dirs:
        d.mkdir(exist_ok=True)
    rng = random.Random(0)
    words = ["sun", "moon", "river", "stone", "cloud", "tree", "bird", "fire", "snow", "wind"]
    for f in range(N_FILES):
        recs = []
        for i in range(N_SAMPLES // N_FILES):
            w = " ".join(rng.choice(words) for _ in range(1 + (i + f) % 6))
            recs.append({"segments": [{"text": f"Q: reverse '{w}'\nA:", "label": False},
                                      {"text": " " + " ".join(reversed(w.split())), "label": True}]})
        write_jsonl(dirs[f // 2] / f"part-{f}.jsonl", recs)
    return dirs


def _config(tmp_path: Path, name: str, workers: int, *, tokenize: dict | None = None,
            worker_resources: dict | None = None, max_failures: int = 2, datasets: int = 2,
            on_data_change: str = "fail", **train):
    """The tiny run; ``tokenize``/``worker_resources`` place the actors (tests/test_node_loss.py)."""
    raw = {
        "model": {"tokenizer": "demo://tokenizer",
                  "init": {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}},
        "data": {"sequence_len": 128, "packing": "bfd", "pack_buffer_size": 40, "shuffle_seed": 5,
                 "datasets": [{"path": str(d), "type": "input_output", "weight": w}
                              for d, w in list(zip(_data(tmp_path), WEIGHTS, strict=True))[:datasets]],
                 "tokenize": tokenize or {"num_actors": 1, "num_cpus": 0.25}},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "epochs": 1, "learning_rate": 3e-3,
                  "warmup_steps": 2, "lr_scheduler": "constant", "log_every_steps": 1,
                  "checkpoint_every_steps": 3, "deepspeed": "zero0", **train},
        "scaling": {"num_workers": workers, "resources_per_worker": worker_resources or {"CPU": 0.5}},
        "run": {"name": name, "storage_path": str(tmp_path / "runs"), "max_failures": max_failures,
                "export_model": False, "on_data_change": on_data_change},
    }
    return config_from_dict(raw)


def _fit(cfg):
    from pipelines.train.trainer import build_trainer

    return build_trainer(cfg).fit()


def _ledger(tmp_path: Path, name: str):
    return Ledger(pafs.LocalFileSystem(), str(tmp_path / "runs" / name / "ledger")).entries(0)


def _losses(tmp_path: Path, name: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = defaultdict(list)
    for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]].append(rec["loss"])
    return out


def _assert_exactly_once(entries) -> None:
    counts = sample_counts(entries)
    expected = {make_sample_id(f, i) for f in range(N_FILES) for i in range(N_SAMPLES // N_FILES)}
    assert set(counts) == expected, f"missing {len(expected - set(counts))}, extra {len(set(counts) - expected)}"
    assert set(counts.values()) == {1}, "some samples were trained on twice"
    assert [e.step for e in entries] == list(range(1, len(entries) + 1))


def _schedule(cfg, workers: int) -> list[list[list[list[int]]]]:
    """The rows each rank gets at each step of the run's first epoch, from the feeder alone (no training):
    what a run without faults trains on."""
    import ray

    from pipelines.stream.client import FeederClient
    from pipelines.stream.feeder import start_feeder

    rows = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps * workers
    feeder = start_feeder(cfg, workers, rows, None, None, epochs=1)
    clients = [FeederClient(feeder, r) for r in range(workers)]
    steps = []
    while (items := [c.next() for c in clients])[0] is not None:
        if items[0].kind == "step":
            steps.append([it.sample_ids() for it in items])
    ray.kill(feeder)
    return steps


def test_failures_and_sigkill_mid_epoch_keep_exactly_once_and_the_loss_curve(ray_local, tmp_path, monkeypatch):
    """A raise and a SIGKILL mid-epoch (each after a step that no checkpoint covers): the restored run trains
    every sample once, each step on the rows and ranks of the unbroken schedule, and a step trained again
    after a restore has the loss it had the first time (model, optimizer and data restored together)."""
    cfg = _config(tmp_path, "faulty", 2)
    planned = _schedule(cfg, 2)
    n = len(planned)
    assert n >= 12, f"only {n} steps: too few to fail at 1/3 and 2/3"

    first, second = n // 3 + 1, 2 * n // 3 + 1  # not on a checkpoint: steps after it are undone
    monkeypatch.setenv("PIPELINES_FAULTS", f"{first}:raise,{second}:kill")
    _fit(cfg)
    faulty = _ledger(tmp_path, "faulty")
    run = tmp_path / "runs" / "faulty" / ".faults"
    assert sorted(p.name for p in run.iterdir()) == sorted([f"fault_step_{first}", f"fault_step_{second}"])
    _assert_exactly_once(faulty)
    assert [e.ranks for e in faulty] == planned  # same rows, same ranks, same order

    # Mixing on the real path: while both datasets last, 3 of every 4 samples come from the first (its
    # samples are like the second's, so token shares and sample shares agree), restarts included.
    from_first = [[split_sample_id(sid)[0] < 2 for sid in e.sample_ids()] for e in faulty]
    both = max(i for i, f in enumerate(from_first) if any(f))  # steps before it drew on both datasets
    share = sum(sum(f) for f in from_first[:both]) / sum(len(f) for f in from_first[:both])
    assert both >= n // 2 and abs(share - 0.75) < 0.04, (both, n, share)

    losses = _losses(tmp_path, "faulty")
    redone = {s: v for s, v in losses.items() if len(v) > 1}
    # The steps between the checkpoint a fault restores (every 3 steps) and the fault were logged, then trained
    # again; the faulting step itself is not logged before it fails.
    again = {s for f in (first, second) for s in range((f - 1) // 3 * 3 + 1, f)}
    assert again and again <= set(redone), (sorted(again), sorted(redone))
    for step, values in redone.items():  # a re-run matches the first attempt: the restore lost nothing
        for v in values[1:]:
            assert abs(v - values[0]) < 1e-3 * max(1.0, abs(values[0])), (step, values)
    assert sorted(losses) == list(range(1, n + 1))


def test_world_size_and_dataset_changes_across_resumes_are_exactly_once(ray_local, tmp_path):
    """2 workers on the first dataset alone stop mid-epoch; a new job with 1 worker resumes with the second
    dataset added (run.on_data_change: continue) and stops again; a third with 2 workers finishes. Both
    directions of a world-size change and a dataset joining the mix in one run: every sample exactly once,
    the new dataset from the resume step on, and the change in the ledger. Without continue that resume
    is refused before any worker starts."""
    from pipelines.train.checkpoint import CheckpointError

    name = "resize"
    _fit(_config(tmp_path, name, 2, datasets=1, max_steps=5))
    head = _ledger(tmp_path, name)
    assert len(head) == 5 and len(sample_counts(head)) < N_SAMPLES  # stopped mid-epoch
    assert {split_sample_id(s)[0] for e in head for s in e.sample_ids()} <= {0, 1}  # the first dataset's files
    with pytest.raises(CheckpointError, match=r"data.datasets\[1\].path"):
        _fit(_config(tmp_path, name, 1, max_steps=10))  # fail, the default: refused, nothing trained
    # run.resume=auto: same run name, new job, other world size, one more dataset
    _fit(_config(tmp_path, name, 1, max_steps=10, on_data_change="continue"))
    middle = _ledger(tmp_path, name)
    assert len(sample_counts(middle)) < N_SAMPLES
    assert any(split_sample_id(s)[0] == 2 for s in middle[5].sample_ids())  # joined at the resume step
    _fit(_config(tmp_path, name, 2))
    entries = _ledger(tmp_path, name)
    _assert_exactly_once(entries)
    assert [len(e.ranks) for e in entries] == [2] * 5 + [1] * 5 + [2] * (len(entries) - 10)
    (change,) = Ledger(pafs.LocalFileSystem(), str(tmp_path / "runs" / name / "ledger")).changes()
    assert change["after_step"] == 5 and any("qa_more" in line and "added" in line for line in change["changes"])
