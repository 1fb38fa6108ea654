"""``ray start --head`` on loopback, ``ray job submit --working-dir . -- python ray_jobs/sft.py``, outputs exist.

The head runs in the foreground (``ray start --block``) as a child of the test, with its own
``--temp-dir``; every Ray process it starts is a descendant of that one process. It is stopped by
terminating exactly those processes, by pid (never ``ray stop``, which ends *every* Ray process on
the machine, other people's included, nor by matching names or command lines). Its servers bind
port 0 where Ray lets them (GCS, dashboard, node and object managers, agents; not its client server,
which must be given a port) and the test reads the dashboard's address back from Ray instead of
probing for a free port and hoping it stays free.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = str(Path(sys.executable).parent)


def _free_port() -> int:
    """Only for Ray's client server, the one port ``ray start`` refuses as 0 (RayParams wants 1024-65535)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def _stop(procs: list[psutil.Process]) -> None:
    """Terminate exactly these processes (a head and what it started), then kill what is left."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def _dashboard_url(log_path: Path, head: subprocess.Popen, timeout: float = 150.0) -> str:
    """The dashboard's address as ``ray start`` reports it once the head is up (its port was chosen by the OS)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        # Ray 2.60 prints it as RAY_API_SERVER_ADDRESS='http://127.0.0.1:PORT' and "view the dashboard at 127.0.0.1:PORT".
        found = (re.search(r"RAY_API_SERVER_ADDRESS='http://127\.0\.0\.1:(\d+)'", text)
                 or re.search(r"view the dashboard at\s.*?127\.0\.0\.1:(\d+)", text, re.S))
        if "Ray runtime started" in text and found:
            return f"http://127.0.0.1:{found.group(1)}"
        if head.poll() is not None:
            raise AssertionError(f"ray start exited with {head.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no dashboard address from ray start within {timeout} s")


@pytest.fixture()
def ray_head(tmp_path):
    """A private Ray head on 127.0.0.1; yields the dashboard (job API) address and the environment."""
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        f"{VENV_BIN}/ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
        "--port=0", "--dashboard-port=0", "--num-cpus=2", f"--temp-dir={temp_dir}", "--include-dashboard=true",
        f"--ray-client-server-port={_free_port()}", "--dashboard-agent-listen-port=0", "--dashboard-agent-grpc-port=0",
        "--metrics-export-port=0", "--runtime-env-agent-port=0", "--node-manager-port=0", "--object-manager-port=0",
    ]
    log = tmp_path / "ray_start.log"
    with log.open("w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield _dashboard_url(log, head), env
    finally:
        procs = _descendants(head.pid)
        _stop(procs)
        assert head.poll() is not None and not [p for p in procs if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit_sft(ray_head, tmp_path):
    address, env = ray_head
    proc = subprocess.run(
        [f"{VENV_BIN}/ray", "job", "submit", "--address", address, "--working-dir", ".", "--",
         "python", "ray_jobs/sft.py", "train.max_steps=6", "train.log_every_steps=3",
         "train.checkpoint_every_steps=3", "data.eval_fraction=0", f"run.storage_path={tmp_path}",
         "run.name=job", "model.init.hidden_size=64", "model.init.num_hidden_layers=2"],
        cwd=ROOT, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=540,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out
    assert f"  model:     {tmp_path}/job/model" in out  # the summary block (pipelines.train.metrics.format_summary)
    run = tmp_path / "job"
    assert (run / "model" / "config.json").is_file() and (run / "model" / "tokenizer.json").is_file()
    assert (run / "checkpoint_00000006" / "trainer_state.json").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [3, 6]
