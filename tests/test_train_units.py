"""Small pieces of the training path: metrics windows, log line, checkpoint lookup, what the loop reports to Ray
Train, the fault hook, the lost-peer error (two gloo processes, one killed), and the ninja a CPU worker builds with."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipelines.train.checkpoint import STATE_FILE, TrainerState, checkpoint_dir_name, latest_in_run_dir
from pipelines.train.collate import IGNORE_INDEX, dummy_batch
from pipelines.train.loss import backward_scale, summed_loss, supervised_tokens
from pipelines.train.metrics import Window, format_line
from pipelines.train.step import StepStats


def _stats(loss: float, sup: int, tokens: int, rows: int, wait: float, t: float) -> StepStats:
    return StepStats(loss=loss, lr=1e-3, grad_norm=0.5, tokens=tokens, supervised_tokens=sup, rows=rows,
                     data_wait_s=wait, step_time_s=t)


def test_window_is_token_weighted_and_formats_one_line():
    w = Window()
    w.add(_stats(2.0, sup=30, tokens=400, rows=2, wait=0.01, t=0.5))
    w.add(_stats(4.0, sup=10, tokens=200, rows=1, wait=0.03, t=0.5))
    rec = w.record(step=20, epoch=0, sequence_len=256, wait_s=0.08, time_s=2.0)
    assert rec["loss"] == pytest.approx(2.5)  # (2*30 + 4*10) / 40, not (2 + 4) / 2
    assert rec["tokens_per_s"] == pytest.approx(600.0)
    assert rec["packing_efficiency"] == pytest.approx(600 / (3 * 256))
    assert rec["data_wait_pct"] == pytest.approx(4.0)
    assert rec["supervised_tokens"] == 20
    json.dumps(rec)  # plain data for metrics.jsonl and ray.train.report
    line = format_line(rec, max_steps=100)
    assert line.startswith("step 20/100 | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | tok/s 600")
    assert "pack 78.1%" in line and "data_wait 4.0%" in line and "\n" not in line


def test_dummy_batch_has_no_targets_but_a_graph():
    b = dummy_batch("mask")
    assert supervised_tokens(b["labels"]) == 0 and int(b["num_rows"]) == 0
    assert (b["labels"] == IGNORE_INDEX).all()
    logits = torch.randn(1, b["input_ids"].shape[1], 10, requires_grad=True)
    loss = summed_loss(logits, b["labels"])
    loss.backward()
    assert float(loss.detach()) == 0.0 and logits.grad is not None and (logits.grad == 0).all()
    assert backward_scale(world_size=2, grad_accum=4, global_tokens=40) == pytest.approx(0.2)


def test_latest_checkpoint_in_run_dir(tmp_path):
    for step in (8, 16, 120):
        d = tmp_path / checkpoint_dir_name(step)
        d.mkdir()
        (d / STATE_FILE).write_text(json.dumps({"step": step}))
        size = (d / STATE_FILE).stat().st_size
        (d / "manifest.json").write_text(json.dumps({"files": {STATE_FILE: size}, "world_size": 1}))
    (tmp_path / "model").mkdir()
    assert latest_in_run_dir(str(tmp_path))[1].endswith("checkpoint_00000120")
    assert latest_in_run_dir(str(tmp_path / "checkpoint_00000016"))[1].endswith("checkpoint_00000016")
    with pytest.raises(FileNotFoundError, match="run.resume"):
        latest_in_run_dir(str(tmp_path / "model"))
    assert TrainerState.from_dict({"step": 3, "unknown": 1}).step == 3


def test_the_loop_reports_to_ray_train_only_with_its_checkpoints(monkeypatch, tmp_path):
    """Ray Train drains a worker's reports one per controller poll (2 s by default), so a report of metrics
    every log step made each step wait for that poll. The loop reports only its checkpoints (what Ray Train
    keeps): with a log line every step, 8 steps with a checkpoint every 4 are 2 reports, none between."""
    from types import SimpleNamespace

    import ray.train

    import pipelines.train.loop as loop
    from pipelines.config import AdapterConfig, config_from_dict
    from pipelines.train.adapter import ParamCount

    cfg = config_from_dict({"model": {"tokenizer": "demo://tokenizer"},
                            "data": {"datasets": [{"path": str(tmp_path), "type": "completion"}]},
                            "train": {"max_steps": 8, "log_every_steps": 1, "checkpoint_every_steps": 4},
                            "run": {"storage_path": str(tmp_path / "runs"), "name": "r", "export_model": False}})
    te = SimpleNamespace(rank=0, world_size=1, device=None, collate_fn=lambda: None,
                         params=ParamCount(10, 10), adapter=AdapterConfig())
    feed = SimpleNamespace(commit=lambda: {}, telemetry=dict, report=lambda: {"counters": {}})
    reports, checkpoints = [], []
    monkeypatch.setattr(ray.train, "report", lambda *a, **kw: reports.append(kw))
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: None)
    monkeypatch.setattr(loop, "train_step", lambda te, source: _stats(1.0, 5, 10, 1, 0.0, 0.01))

    def report_checkpoint(te, state, metrics, upload):
        checkpoints.append(metrics["step"])
        ray.train.report(metrics, checkpoint=state.step)
        return checkpoint_dir_name(state.step)

    monkeypatch.setattr(loop, "report_checkpoint", report_checkpoint)
    loop.WorkerLoop(cfg, te, TrainerState(fit_id="f"), feed).run()
    assert checkpoints == [4, 8]
    assert [r.get("checkpoint") for r in reports] == [4, 8]
    lines = (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if json.loads(x)["kind"] == "train"] == list(range(1, 9))


def test_the_fault_hook_reads_its_faults_and_its_step_wait(tmp_path, monkeypatch):
    """PIPELINES_FAULTS: the last rank fails once per planned step; ``slow:`` makes every rank wait."""
    import time

    from pipelines.train import faults

    assert faults.parse("12:raise, 24:kill,slow:0.25") == ({12: "raise", 24: "kill"}, 0.25)
    assert faults.parse("") == ({}, 0.0)
    for bad in ("12:explode", "slow:soon", "slow:-1", "x:raise"):
        with pytest.raises(ValueError, match="PIPELINES_FAULTS"):
            faults.parse(bad)
    monkeypatch.setenv(faults.ENV, "3:raise,slow:0.2")
    faults.maybe_fail(3, 0, 2, str(tmp_path))  # not the last rank
    t0 = time.perf_counter()
    with pytest.raises(faults.InjectedFault, match="after step 3 on rank 1"):
        faults.maybe_fail(3, 1, 2, str(tmp_path))
    assert time.perf_counter() - t0 >= 0.2
    faults.maybe_fail(3, 1, 2, str(tmp_path))  # once per run directory: the restored run goes past it


_LOST_PEER_SCRIPT = """
import os, signal, sys, time
import torch, torch.distributed as dist
from pipelines.train.peers import PeerLost, naming_lost_peers
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # the lost peer: every process of its node goes at once
time.sleep(1.0)
try:
    with naming_lost_peers(rank, 2):
        dist.all_reduce(t)
except PeerLost as err:
    print("PEER_LOST", err, "| CAUSE", type(err.__cause__).__name__, flush=True)
os._exit(0)
"""


def test_a_collective_whose_peer_was_killed_fails_naming_the_lost_peer(tmp_path):
    """Two gloo ranks; rank 1 is SIGKILLed; rank 0's next all_reduce raises PeerLost naming the cause."""
    import socket
    import subprocess
    import sys

    from conftest import ROOT

    from pipelines.train.peers import PeerLost, naming_lost_peers

    script = tmp_path / "peers.py"
    script.write_text(_LOST_PEER_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    peer = subprocess.Popen([sys.executable, str(script), "1", port], env=env)
    out = subprocess.run([sys.executable, str(script), "0", port], env=env, capture_output=True, text=True,
                         timeout=120)
    peer.wait(timeout=60)
    line = next((x for x in out.stdout.splitlines() if x.startswith("PEER_LOST")), out.stdout + out.stderr)
    assert "rank 0 of 2" in line and "its node died" in line and "Connection closed by peer" in line, line
    assert line.endswith("| CAUSE RuntimeError"), line
    with pytest.raises(ValueError, match="other"), naming_lost_peers(0, 2):  # any other error passes unchanged
        raise ValueError("other")
    with pytest.raises(PeerLost), naming_lost_peers(0, 2):
        raise RuntimeError("NCCL error: remote process exited or there was a network error")


def test_a_cpu_worker_finds_pips_ninja_when_path_has_none(tmp_path, monkeypatch):
    """DeepSpeed's CPU op is built with the ``ninja`` on PATH. With the venv not activated and no system ninja,
    the worker's PATH gets pip's (beside the interpreter); a ninja already on PATH stays the one used."""
    import shutil

    import ninja

    from pipelines.train.step import select_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored after the test, as is PATH
    bare = tmp_path / "bare"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    assert shutil.which("ninja") is None
    select_accelerator(use_gpu=False)
    assert os.environ["PATH"].split(os.pathsep) == [str(bare), ninja.BIN_DIR]
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")

    system = tmp_path / "system"
    system.mkdir()
    (system / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (system / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(system))
    select_accelerator(use_gpu=False)
    assert os.environ["PATH"] == str(system) and shutil.which("ninja") == str(system / "ninja")
