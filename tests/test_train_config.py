"""Training config plumbing without a cluster: LR schedule, DeepSpeed config resolution, failing early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config import ConfigError, TrainConfig, load_config
from pipelines.train.deepspeed_config import resolve_deepspeed_config, zero_stage
from pipelines.train.preflight import preflight
from pipelines.train.schedule import effective_scheduler, lr_multiplier

ROOT = Path(__file__).resolve().parents[1]


def test_cosine_schedule_worked_example():
    t = TrainConfig(learning_rate=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1, lr_scheduler="cosine")
    f = lr_multiplier(t)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    lin = lr_multiplier(t.model_copy(update={"lr_scheduler": "linear"}))
    assert lin(60) == pytest.approx(0.55) and lin(35) == pytest.approx(0.775)


def test_schedule_without_max_steps_is_constant_after_warmup():
    t = TrainConfig(warmup_steps=4, lr_scheduler="cosine", epochs=3)
    assert effective_scheduler(t) == "constant"
    f = lr_multiplier(t)
    assert [f(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_builtin_deepspeed_configs_fill_from_train(name):
    t = TrainConfig(deepspeed=name, micro_batch_size=3, gradient_accumulation_steps=5, max_grad_norm=0.5, bf16=False)
    ds = resolve_deepspeed_config(t, world_size=4, use_gpu=False)
    assert zero_stage(ds) == int(name[-1])
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 60 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": False}
    assert "auto" not in json.dumps(ds)
    if name in ("zero2", "zero3"):
        assert ds["zero_optimization"]["overlap_comm"] is False  # CPU
        assert resolve_deepspeed_config(t, 4, use_gpu=True)["zero_optimization"]["overlap_comm"] is True


def test_deepspeed_path_inline_and_errors(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 99}))
    ds = resolve_deepspeed_config(TrainConfig(deepspeed=str(path)), world_size=2)
    assert zero_stage(ds) == 1 and ds["train_micro_batch_size_per_gpu"] == 1  # train config wins
    ds = resolve_deepspeed_config(TrainConfig(deepspeed="ds.json"), world_size=2, base_dir=str(tmp_path))
    assert zero_stage(ds) == 1  # relative to the config file's folder
    assert zero_stage(resolve_deepspeed_config(TrainConfig(deepspeed={"zero_optimization": {"stage": 3}}), 1)) == 3
    with pytest.raises(ValueError, match="train.deepspeed: 'zero7' not found"):
        resolve_deepspeed_config(TrainConfig(deepspeed="zero7"), 1)
    with pytest.raises(ValueError, match="'optimizer' block"):
        resolve_deepspeed_config(TrainConfig(deepspeed={"optimizer": {"type": "Adam"}}), 1)
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size='auto'"):
        resolve_deepspeed_config(TrainConfig(deepspeed={"zero_optimization": {"reduce_bucket_size": "auto"}}), 1)


def test_preflight_names_the_key(tmp_path):
    cfg = load_config(ROOT / "configs" / "default.yaml", ["train.deepspeed=nope"])
    with pytest.raises(ConfigError, match="train.deepspeed"):
        preflight(cfg)
    cfg = load_config(ROOT / "configs" / "default.yaml", [f"run.resume={tmp_path}/missing"])
    with pytest.raises(ConfigError, match="run.resume"):
        preflight(cfg)
    preflight(load_config(ROOT / "configs" / "default.yaml"))
    preflight(load_config(ROOT / "configs" / "pretrain.yaml"))


@pytest.mark.parametrize(
    ("script", "override", "key"),
    [
        ("sft.py", "train.learning_rate=-1", "train.learning_rate"),
        ("sft.py", "scaling.num_wrkers=2", "scaling.num_wrkers"),
        ("pretrain.py", "train.deepspeed=zero9", "train.deepspeed"),
    ],
)
def test_bad_config_fails_before_ray_starts(script, override, key):
    # RAY_ADDRESS points nowhere: had the script reached ray.init() it would fail with a connection
    # error (after retrying), not with the config error checked here.
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}
    proc = subprocess.run([sys.executable, str(ROOT / "ray_jobs" / script), override],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr
    assert "Ray" not in proc.stdout and "ray.init" not in proc.stderr


def test_a_bad_config_is_refused_before_torch_or_ray_is_imported():
    """The job scripts check the config first: a typo costs ~0.4 s, not the ~5 s of importing torch and Ray."""
    code = ("import runpy, sys\n"
            "sys.argv = ['sft.py', 'train.learning_rate=-1']\n"
            "sys.path.insert(0, 'ray_jobs')  # as `python ray_jobs/sft.py` puts the script's directory first\n"
            "try:\n"
            "    runpy.run_path('ray_jobs/sft.py', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('EXIT', e.code, sorted(m for m in ('torch', 'ray', 'deepspeed', 'transformers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "EXIT 2 []", proc.stdout + proc.stderr
    assert "train.learning_rate" in proc.stderr
