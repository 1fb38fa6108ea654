"""Experiment trackers (pipelines/train/trackers.py): W&B offline and MLflow on a real local store get the
same scalars as metrics.jsonl, the run config once, the same tracker run again on resume; a tracker that
cannot be reached or is not installed is one warning, and the others go on.

Read back through each tracker's own reader: ``wandb leet inspect --json`` on the offline run, and MLflow's
``MlflowClient``. A training run with all three loggers is in tests/test_lora_e2e.py.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config import config_from_dict
from pipelines.train.trackers import Trackers, redact, scalars, wandb_run_id

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

SECRET = "s3cretPassw0rd"


def _cfg(tmp_path: Path, **run) -> object:
    return config_from_dict({"model": {"tokenizer": "demo://tokenizer", "init": {}},
                             "data": {"datasets": [{"path": "demo://sft", "name": "demo"}]},
                             "train": {"max_steps": 4},
                             "storage": {"endpoint_url": f"http://minio:{SECRET}@127.0.0.1:9000"},
                             "run": {"storage_path": str(tmp_path), "name": "trk", **run}})


def _records(steps: list[int]) -> list[dict]:
    out = []
    for s in steps:
        out.append({"kind": "train", "step": s, "epoch": 0, "loss": 3.0 / s, "lr": 1e-3 * s, "grad_norm": 0.5,
                    "tokens_per_s": 1000.0 + s, "packing_efficiency": 0.9, "data_wait_pct": 1.5,
                    "mix_share": {"alpaca": 0.6, "s3://b/lima.jsonl": 0.4}, "data_quality": {"records_skipped": s}})
    out.append({"kind": "eval", "step": steps[-1], "eval_loss": 2.5, "note": "text is not a scalar"})
    return out


def _feed(cfg, run_dir: Path, steps: list[int]) -> list[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    trackers = Trackers(cfg, str(run_dir), str(run_dir))
    for rec in _records(steps):
        trackers.log(rec)
    names = trackers.names
    trackers.close()
    return names


def test_scalars_flatten_nested_numbers_and_skip_the_rest():
    rec = _records([2])[0]
    got = dict(scalars({**rec, "flag": True, "nan": float("nan"), "name": "x"}))
    assert got["loss"] == 1.5 and got["mix_share/s3_b_lima.jsonl"] == 0.4 and got["data_quality/records_skipped"] == 2.0
    assert not {"kind", "step", "flag", "nan", "name"} & set(got)
    assert redact(f"file:///x https://bob:{SECRET}@h:1/p s3://k@b/c") == "file:///x https://h:1/p s3://b/c"


def _wandb_history(run_dir: Path) -> tuple[list[dict], dict]:
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    proc = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(wandb_file)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return history, run


def test_wandb_offline_run_holds_the_scalars_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = _cfg(tmp_path, loggers=["wandb"], wandb={"project": "pipelines-tests", "tags": ["ci"]})
    run_dir = tmp_path / "trk"
    assert _feed(cfg, run_dir, [2, 4]) == ["wandb"]
    history, run = _wandb_history(run_dir)
    train = [h for h in history if "train/loss" in h]
    assert [(h["_step"], h["train/loss"], h["train/mix_share/alpaca"]) for h in train] == [(2, 1.5, 0.6), (4, 0.75, 0.6)]
    assert train[1]["train/tokens_per_s"] == 1004 and train[1]["train/data_quality/records_skipped"] == 4
    assert [h["eval/eval_loss"] for h in history if "eval/eval_loss" in h] == [2.5]
    assert run["run_id"] == wandb_run_id(str(run_dir)) and run["project"] == "pipelines-tests"
    config = run["config"]["update"]
    assert config["train"]["max_steps"] == 4 and config["run"]["loggers"] == ["wandb"]
    assert SECRET not in json.dumps(config) and config["storage"]["endpoint_url"] == "http://127.0.0.1:9000"


def test_mlflow_file_store_gets_the_scalars_once_per_run_and_the_resume_appends(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    cfg = _cfg(tmp_path, loggers=["mlflow"], mlflow={"tracking_uri": uri, "experiment": "pipelines-tests"})
    run_dir = tmp_path / "trk"
    assert _feed(cfg, run_dir, [2, 4]) == ["mlflow"]
    assert _feed(cfg, run_dir, [6]) == ["mlflow"]  # a resumed fit: the same MLflow run
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("pipelines-tests")
    (run,) = client.search_runs([exp.experiment_id])
    loss = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(loss) == [(2, 1.5), (4, 0.75), (6, 0.5)]
    shares = client.get_metric_history(run.info.run_id, "train/mix_share/s3_b_lima.jsonl")  # a URL key, made safe
    assert sorted(m.step for m in shares) == [2, 4, 6] and {m.value for m in shares} == {0.4}
    assert run.data.params["train.max_steps"] == "4" and run.data.tags["pipelines.run_dir"] == str(run_dir)
    config = json.loads(Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))).read_text())
    assert config["run"]["mlflow"]["experiment"] == "pipelines-tests" and SECRET not in json.dumps(config)


def test_an_unreachable_tracker_is_one_warning_and_the_others_go_on(tmp_path, caplog):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _cfg(tmp_path, loggers=["tensorboard", "mlflow"],
               mlflow={"tracking_uri": f"http://ci:{SECRET}@127.0.0.1:{port}"})
    with caplog.at_level(logging.WARNING, logger="pipelines.train.trackers"):
        assert _feed(cfg, tmp_path / "trk", [2, 4]) == ["tensorboard"]
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "pipelines.train.trackers"]
    assert warning.startswith("run.loggers: mlflow could not start") and "training goes on" in warning
    assert SECRET not in warning and f"127.0.0.1:{port}" in warning
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "trk" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(2, 1.5), (4, 0.75)]


def test_a_tracker_that_is_not_installed_names_its_extra(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = _cfg(tmp_path, loggers=["wandb", "tensorboard"])
    with caplog.at_level(logging.WARNING, logger="pipelines.train.trackers"):
        assert _feed(cfg, tmp_path / "trk", [2]) == ["tensorboard"]
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "pipelines.train.trackers"]
    assert "wandb could not start" in warning and "pip install 'pipelines[wandb]'" in warning


def test_loggers_are_checked_in_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"run.loggers.1: Input should be 'tensorboard', 'wandb' or 'mlflow'"):
        _cfg(tmp_path, loggers=["tensorboard", "neptune"])
    with pytest.raises(ValueError, match="more than once"):
        _cfg(tmp_path, loggers=["wandb", "wandb"])
