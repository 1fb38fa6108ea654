"""``ray start --head`` on loopback, ``ray job submit --working-dir . -- python ray_jobs/sft.py``, outputs exist.

The head gets its own ``--temp-dir`` and free ports, and is stopped by terminating exactly the
processes it started (those naming its temp dir or GCS port, and their descendants). Plain
``ray stop`` is not used: it kills *every* Ray process on the machine, other people's included.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = str(Path(sys.executable).parent)


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _head_processes(temp_dir: str, gcs_port: int) -> set[psutil.Process]:
    """The head's processes: those naming our temp dir or GCS port, plus all their descendants."""
    found: set[psutil.Process] = set()
    for p in psutil.process_iter(["cmdline"]):
        args = p.info["cmdline"] or []
        if any(temp_dir in a or f":{gcs_port}" in a for a in args):
            found.add(p)
            with contextlib.suppress(psutil.NoSuchProcess):
                found.update(p.children(recursive=True))
    return found


def _stop_head(temp_dir: str, gcs_port: int) -> None:
    procs = _head_processes(temp_dir, gcs_port)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(list(procs), timeout=8)
    for p in alive:
        p.kill()


@pytest.fixture()
def ray_head():
    """A private Ray head on 127.0.0.1; yields the dashboard (job API) address."""
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    gcs, dash, client, agent_http, agent_grpc, metrics, renv, nm, om = _free_ports(9)
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        f"{VENV_BIN}/ray", "start", "--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
        f"--port={gcs}", f"--dashboard-port={dash}", "--num-cpus=2", f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={renv}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
        "--include-dashboard=true",
    ]
    try:
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"http://127.0.0.1:{dash}", env
    finally:
        _stop_head(temp_dir, gcs)
        assert not _head_processes(temp_dir, gcs)


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
