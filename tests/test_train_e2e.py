"""End to end through Ray Train's TorchTrainer: 2 CPU workers, DeepSpeed, rows streamed from build_dataset.

One Ray instance for the module (``ray_local`` in conftest.py). Each fit costs ~30-40 s on 2 cores,
mostly worker and DeepSpeed start-up, so every fit checks several things.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.init.hidden_size=64", "model.init.intermediate_size=128", "model.init.num_hidden_layers=2",
    "model.init.num_attention_heads=4", "data.sequence_len=256", "data.pack_buffer_size=256",
    "train.micro_batch_size=2", "train.learning_rate=5e-3", "train.warmup_steps=2", "train.log_every_steps=4",
]
ZERO3_PARTITIONED = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                           "stage3_gather_16bit_weights_on_model_save": True}}


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _fit(config: str, overrides: list[str]):
    from pipelines.train.trainer import build_trainer

    cfg = load_config(ROOT / "configs" / config, TINY + overrides)
    return cfg, build_trainer(cfg).fit()


def _load_and_generate(model_dir: Path) -> str:
    """The export loads with the stock HF classes, has every weight, and generates."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(p.numel() > 0 and torch.isfinite(p).all() for p in model.parameters())
    ids = tok("Uppercase the text.", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    return tok.decode(out[0, ids.shape[1]:])


@pytest.mark.timeout(600)
def test_sft_zero2_checkpoint_export_and_resume(ray_local, tmp_path):
    common = [f"run.storage_path={tmp_path}", "run.name=sft", "train.deepspeed=zero2", "run.keep_checkpoints=2",
              "train.checkpoint_every_steps=8", "train.eval_every_steps=8", "train.eval_max_batches=2"]
    cfg, result = _fit("default.yaml", [*common, "train.max_steps=16"])
    run = tmp_path / "sft"
    train = _records(run, "train")
    assert [r["step"] for r in train] == [4, 8, 12, 16]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train  # it learns
    assert all(0 < r["packing_efficiency"] <= 1 and r["tokens_per_s"] > 0 and 0 <= r["data_wait_pct"] <= 100
               for r in train)
    evals = _records(run, "eval")
    assert [r["step"] for r in evals][:1] == [8] and all(r["eval_loss"] > 0 for r in evals)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    state = json.loads((run / "checkpoint_00000016" / "trainer_state.json").read_text())
    assert state["step"] == 16 and "data_state" in state
    assert (run / "checkpoint_00000016" / "deepspeed" / "step_16").is_dir()
    assert Path(result.checkpoint.path).name == "checkpoint_00000016"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 16 and summary["model_path"] == f"{run}/model"
    _load_and_generate(run / "model")

    # Same run again with more steps: resumes at 16 (model, optimizer, LR schedule, step) and continues.
    _, result2 = _fit("default.yaml", [*common, "train.max_steps=24"])
    assert [r["step"] for r in _records(run, "resume")] == [16]
    train2 = _records(run, "train")[len(train):]
    assert [r["step"] for r in train2] == [20, 24]
    assert train2[0]["loss"] < train[0]["loss"] - 0.5  # continues the curve, not a fresh model
    assert abs(train2[0]["loss"] - train[-1]["loss"]) < 0.6
    # The LR picks up where the cosine schedule was, not from warmup.
    from pipelines.train.schedule import lr_multiplier

    assert train2[0]["lr"] == pytest.approx(cfg.train.learning_rate * lr_multiplier(
        cfg.train.model_copy(update={"max_steps": 24}))(19), rel=1e-6)
    kept = sorted(p.name for p in run.glob("checkpoint_0*"))
    assert kept == ["checkpoint_00000016", "checkpoint_00000024"]  # run.keep_checkpoints=2
    assert json.loads((run / "summary.json").read_text())["steps_this_run"] == 8


@pytest.mark.timeout(600)
def test_pretrain_zero3_concat_export(ray_local, tmp_path):
    cfg, result = _fit("pretrain.yaml", [
        f"run.storage_path={tmp_path}", "run.name=pt", f"train.deepspeed={json.dumps(ZERO3_PARTITIONED)}",
        "train.gradient_accumulation_steps=2", "train.max_steps=12", "data.eval_fraction=0",
        "model.init.architecture=qwen2",
    ])
    run = tmp_path / "pt"
    train = _records(run, "train")
    assert train[-1]["step"] == 12
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train
    assert train[-1]["packing_efficiency"] > 0.95  # concat packing fills rows
    assert (run / "checkpoint_00000012" / "deepspeed" / "step_12").is_dir()
    text = _load_and_generate(run / "model")  # ZeRO-3 weights were consolidated for the export
    assert isinstance(text, str)


@pytest.mark.timeout(300)
def test_odd_row_count_epochs_no_hang(ray_local, tmp_path):
    """9 rows over 2 workers, 2 epochs, no max_steps: both ranks finish every epoch together."""
    import numpy as np
    import ray

    from pipelines.train.step import synthetic_rows
    from pipelines.train.trainer import build_trainer

    rows = [{k: np.asarray(v).tolist() for k, v in r.items()} for r in synthetic_rows(9, 64, 260)]
    cfg = load_config(ROOT / "configs" / "default.yaml", TINY + [
        f"run.storage_path={tmp_path}", "run.name=odd", "train.max_steps=null", "train.epochs=2",
        "train.micro_batch_size=1", "train.gradient_accumulation_steps=2", "train.checkpoint_every_steps=null",
        "run.export_model=false", f"train.deepspeed={json.dumps(ZERO3_PARTITIONED)}",
    ])
    result = build_trainer(cfg, train_dataset=ray.data.from_items(rows)).fit()
    summary = json.loads((tmp_path / "odd" / "summary.json").read_text())
    assert summary["epochs"] == 2
    # Ray Train's streaming_split(equal=True) hands each rank 4 of the 9 rows: 2 steps per epoch.
    assert summary["step"] == 4 and result.metrics["step"] == 4
    assert not (tmp_path / "odd" / "model").exists()


@pytest.mark.timeout(400)
def test_worker_failure_resumes_from_checkpoint(ray_local, tmp_path):
    """run.max_failures=1: a failure mid-run restarts the workers, which resume from the last checkpoint."""
    import numpy as np
    import ray

    from pipelines.train.step import synthetic_rows
    from pipelines.train.trainer import build_trainer

    rows = [{k: np.asarray(v).tolist() for k, v in r.items()} for r in synthetic_rows(60, 64, 260)]
    marker, trigger = str(tmp_path / "failed"), str(tmp_path / "ft" / "checkpoint_00000004")

    def fail_once(batch):
        """Slow pass-through (training waits on data) that raises once, as soon as checkpoint 4 exists.
        Defined here so cloudpickle ships it by value to the Ray Data tasks."""
        import os
        import time

        time.sleep(0.2)
        if os.path.exists(trigger) and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("injected data failure")
        return batch

    # One task at a time, 0.2 s a row: the stream stays behind training, so the failure lands mid-run.
    ds = ray.data.from_items(rows).map_batches(fail_once, batch_size=1, compute=ray.data.TaskPoolStrategy(size=1))
    cfg = load_config(ROOT / "configs" / "default.yaml", TINY + [
        f"run.storage_path={tmp_path}", "run.name=ft", "run.max_failures=1", "train.max_steps=12",
        "train.micro_batch_size=1", "train.checkpoint_every_steps=2", "train.log_every_steps=1",
        "train.prefetch_batches=0", "run.export_model=false", "data.eval_fraction=0",
    ])
    result = build_trainer(cfg, train_dataset=ds).fit()
    assert Path(marker).exists()  # the failure did happen
    (resume,) = _records(tmp_path / "ft", "resume")
    steps = [r["step"] for r in _records(tmp_path / "ft", "train")]
    # Resumed from a checkpoint (every 2 steps) taken before the failure, not from scratch; training
    # then continues with the next step.
    assert resume["step"] >= 2 and resume["step"] % 2 == 0
    assert steps[steps.index(resume["step"]) + 1] == resume["step"] + 1
    assert steps[-1] == 12 and result.metrics["step"] == 12


def test_relative_storage_path_is_resolved_in_the_driver(ray_local, tmp_path, monkeypatch):
    """Workers run in Ray's working directories: the driver must send them an absolute run dir."""
    from pipelines.train.trainer import build_trainer

    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "default.yaml", ["run.storage_path=runs", "data.eval_fraction=0"])
    trainer = build_trainer(cfg)  # no fit: only the payload is checked
    assert trainer.train_loop_config["cfg"]["run"]["storage_path"] == str(tmp_path / "runs")
    assert cfg.run.storage_path == "runs"  # the caller's config is left alone
