"""End to end through Ray Train's TorchTrainer: 2 CPU workers, DeepSpeed, rows streamed from build_dataset.

One Ray instance for the module (``ray_local`` in conftest.py). Each fit costs ~30-40 s on 2 cores,
mostly worker and DeepSpeed start-up, so every fit checks several things.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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
    ids = tok("Give the opposite of the word.", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    return tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_zero2_checkpoint_export_and_a_new_job_resumes_exactly(ray_local, tmp_path, monkeypatch):
    """One uninterrupted run, and the same run cut by a crash after checkpoint 16 and resumed by a new job:
    the resumed job's losses and LRs equal the uninterrupted run's, step by step."""
    common = [f"run.storage_path={tmp_path}", "train.deepspeed=zero2", "run.keep_checkpoints=2",
              "train.checkpoint_every_steps=8", "train.eval_every_steps=8", "train.eval_max_batches=2",
              "train.max_steps=24"]
    cfg, result = _fit("default.yaml", [*common, "run.name=whole"])
    run = tmp_path / "whole"
    train = _records(run, "train")
    assert [r["step"] for r in train] == [4, 8, 12, 16, 20, 24]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train  # it learns
    assert all(0 < r["packing_efficiency"] <= 1 and r["tokens_per_s"] > 0 and 0 <= r["data_wait_pct"] <= 100
               and 0 < r["grad_norm"] < 1e3 for r in train)
    evals = _records(run, "eval")
    assert [r["step"] for r in evals] == [8, 16, 24] and all(r["eval_loss"] > 0 for r in evals)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    state = json.loads((run / "checkpoint_00000024" / "trainer_state.json").read_text())
    assert state["step"] == 24 and "data_state" in state
    assert (run / "checkpoint_00000024" / "deepspeed" / "step_24").is_dir()
    assert Path(result.checkpoint.path).name == "checkpoint_00000024"
    assert sorted(p.name for p in run.glob("checkpoint_0*")) == ["checkpoint_00000016", "checkpoint_00000024"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 24 and summary["model_path"] == f"{run}/model"
    _load_and_generate(run / "model")

    # The same run, killed at step 18 (after checkpoint 16, before 24) with no retries: the job fails.
    monkeypatch.setenv("PIPELINES_FAULTS", "18:kill")
    with pytest.raises(Exception):  # noqa: B017 (Ray Train's TrainingFailedError, whatever its module)
        _fit("default.yaml", [*common, "run.name=cut"])
    monkeypatch.delenv("PIPELINES_FAULTS")
    cut = tmp_path / "cut"
    assert not (cut / "checkpoint_00000024").exists() and (cut / "checkpoint_00000016").is_dir()
    # A new job with the same run name resumes at 16 (model, optimizer, LR schedule, data position).
    _fit("default.yaml", [*common, "run.name=cut"])
    assert [r["step"] for r in _records(cut, "resume")] == [16]
    resumed = _records(cut, "train")
    assert [r["step"] for r in resumed] == [4, 8, 12, 16, 20, 24]  # 4..16 by the first job, 20, 24 by the second
    for got, want in zip(resumed, train, strict=True):
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9), (got, want)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-3), (got["step"], got["loss"], want["loss"])
    assert [r["eval_loss"] for r in _records(cut, "eval")] == pytest.approx([r["eval_loss"] for r in evals], rel=1e-3)
    assert json.loads((cut / "summary.json").read_text())["steps_this_run"] == 8


@pytest.mark.slow
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
    _load_and_generate(run / "model")
    # The export holds the trained weights: equal to DeepSpeed's own offline consolidation of the ZeRO-3
    # partitions in the last checkpoint (deepspeed.utils.zero_to_fp32), tensor by tensor.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    reference = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoint_00000012" / "deepspeed"), tag="step_12")
    exported = load_file(run / "model" / "model.safetensors")
    assert set(exported) and set(exported) <= set(reference), sorted(set(exported) - set(reference))[:5]
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name
    initial = _initial_weights(cfg)
    moved = [n for n, t in exported.items() if not torch.equal(t.float(), initial[n].float())]
    assert len(moved) == len(exported), "some exported tensors are still the initial weights"


def _initial_weights(cfg) -> dict:
    """The model a run starts from (same seed and config), built without DeepSpeed."""
    from pipelines.tokenize.tokenizer import load_tokenizer
    from pipelines.train.model import build_model

    return build_model(cfg.model, load_tokenizer(cfg.model), "sdpa").state_dict()


@pytest.mark.slow
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
    # The feeder serves the given rows as one stream: steps of 2 ranks x 2 rows take 4, 4 and the last row
    # (rank 1's share of that step is empty and pads with a no-loss micro-batch): 3 steps per epoch.
    assert summary["step"] == 6 and result.metrics["step"] == 6
    assert not (tmp_path / "odd" / "model").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_worker_failure_resumes_from_checkpoint(ray_local, tmp_path, monkeypatch):
    """run.max_failures=1 on a given dataset: a worker failure mid-run (after step 7, checkpoints every 2 steps)
    restarts the workers, which resume from the last checkpoint, and the feeder serves the given rows from
    there on: every row once."""
    import numpy as np
    import pyarrow.fs as pafs
    import ray

    from pipelines.stream.ledger import Ledger, sample_counts
    from pipelines.train.step import synthetic_rows
    from pipelines.train.trainer import build_trainer

    rows = [{k: np.asarray(v).tolist() for k, v in r.items()} for r in synthetic_rows(60, 64, 260)]
    ds = ray.data.from_items(rows).map_batches(lambda batch: batch, batch_size=4)  # lazy, as users hand them in
    monkeypatch.setenv("PIPELINES_FAULTS", "7:raise")
    cfg = load_config(ROOT / "configs" / "default.yaml", TINY + [
        f"run.storage_path={tmp_path}", "run.name=ft", "run.max_failures=1", "train.max_steps=12",
        "train.micro_batch_size=1", "train.checkpoint_every_steps=2", "train.log_every_steps=1",
        "train.prefetch_batches=0", "run.export_model=false", "data.eval_fraction=0",
    ])
    result = build_trainer(cfg, train_dataset=ds).fit()
    assert (tmp_path / "ft" / ".faults" / "fault_step_7").exists()  # the failure did happen
    (resume,) = _records(tmp_path / "ft", "resume")
    steps = [r["step"] for r in _records(tmp_path / "ft", "train")]
    # Resumed from the checkpoint before the failure, not from scratch; training then continues with the next step.
    assert resume["step"] == 6
    assert steps[steps.index(resume["step"]) + 1] == resume["step"] + 1
    assert steps[-1] == 12 and result.metrics["step"] == 12
    # The given rows are numbered in their order: 12 steps x 2 ranks x 1 row, each row once.
    counts = sample_counts(Ledger(pafs.LocalFileSystem(), str(tmp_path / "ft" / "ledger")).entries())
    assert counts == {i: 1 for i in range(24)}


def test_relative_storage_path_is_resolved_in_the_driver(ray_local, tmp_path, monkeypatch):
    """Workers run in Ray's working directories: the driver must send them an absolute run dir."""
    from pipelines.train.trainer import build_trainer

    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "default.yaml", ["run.storage_path=runs", "data.eval_fraction=0"])
    trainer = build_trainer(cfg)  # no fit: only the payload is checked
    assert trainer.train_loop_config["cfg"]["run"]["storage_path"] == str(tmp_path / "runs")
    assert cfg.run.storage_path == "runs"  # the caller's config is left alone


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trains_from_a_pretrained_model_directory(ray_local, tmp_path):
    """``model.name_or_path`` = a ``save_pretrained`` directory: the run starts from those weights.

    Its first loss equals the saved model's loss on the same rows computed with plain transformers,
    one sample at a time (no packing, no DeepSpeed). Every row is the same row, so the check does not
    depend on which rows each rank gets.
    """
    import numpy as np
    import ray
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pipelines.tokenize.tokenizer import load_tokenizer
    from pipelines.train.step import synthetic_rows
    from pipelines.train.trainer import build_trainer

    cfg0 = load_config(ROOT / "configs" / "default.yaml")
    tok = load_tokenizer(cfg0.model)
    torch.manual_seed(123)  # weights no run would draw from its own seed
    saved = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        saved.lm_head.weight.mul_(40.0)  # confident and wrong: a loss far from any random init's ~ln(260)
    model_dir = tmp_path / "pretrained"
    saved.save_pretrained(model_dir)

    row = {k: np.asarray(v).tolist() for k, v in synthetic_rows(1, 64, len(tok), seed=7)[0].items()}
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "model.init=null", f"model.name_or_path={model_dir}", "model.tokenizer=demo://tokenizer",
        f"run.storage_path={tmp_path}", "run.name=pre", "train.max_steps=2", "train.micro_batch_size=1",
        "train.log_every_steps=1", "train.deepspeed=zero0", "train.bf16=false", "train.warmup_steps=0",
        "train.checkpoint_every_steps=null", "run.export_model=false", "data.eval_fraction=0",
    ])
    build_trainer(cfg, train_dataset=ray.data.from_items([row] * 8)).fit()
    first = _records(tmp_path / "pre", "train")[0]
    assert first["step"] == 1

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, labels, pos = (np.asarray(row[k]) for k in ("input_ids", "labels", "position_ids"))
    starts = [*np.flatnonzero(pos == 0).tolist(), len(ids)]
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(starts[:-1], starts[1:], strict=True):  # each packed sample on its own
            logits = reference(torch.as_tensor(ids[a:b])[None]).logits[0, :-1]
            target = torch.as_tensor(labels[a + 1:b])
            keep = target != -100
            total += float(F.cross_entropy(logits[keep], target[keep], reduction="sum"))
            count += int(keep.sum())
    assert first["supervised_tokens"] == cfg.scaling.num_workers * count  # one whole row per rank
    assert first["loss"] == pytest.approx(total / count, rel=1e-4)
    assert abs(first["loss"] - np.log(len(tok))) > 1.0, first  # not what a random init would give
