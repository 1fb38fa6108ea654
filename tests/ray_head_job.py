"""A private Ray head on loopback and one ``ray job submit`` of the default job to it (tests/test_train_job_submit.py).

``ray start --head --block`` runs in the foreground as a child of this process, with its own ``--temp-dir``;
every Ray process it starts is a descendant of that one process. It is stopped by terminating exactly those
processes, by pid (never ``ray stop``, which ends *every* Ray process on the machine, other people's included,
nor by matching names or command lines). Its servers bind port 0 where Ray lets them (GCS, dashboard, node and
object managers, agents; not its client server, which must be given a port) and the dashboard's address is
read back from Ray instead of probing for a free port and hoping it stays free.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

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


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass(frozen=True)
class JobSubmitRun:
    """What ``ray job submit`` printed and its exit code, the run directory, and whether every process of the
    head was gone after it was stopped."""

    returncode: int
    output: str
    run_dir: Path
    head_exited: bool
    left_alive: list[int]


# The job: the default config with a smaller model, 6 steps, checkpoints every 3.
JOB_ARGS = ["train.max_steps=6", "train.log_every_steps=3", "train.checkpoint_every_steps=3", "data.eval_fraction=0",
            "run.name=job", "model.init.hidden_size=64", "model.init.num_hidden_layers=2"]


def run_job_submit(tmp: Path) -> JobSubmitRun:
    """Start the head, submit ``python ray_jobs/sft.py`` + :data:`JOB_ARGS` with ``--working-dir .`` (token
    authentication on), wait for it, stop the head."""
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    from conftest import SESSION_ENV  # the session's environment, not a running test's (conftest says why)

    env = {**SESSION_ENV, "PATH": f"{VENV_BIN}:{SESSION_ENV.get('PATH', '')}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        f"{VENV_BIN}/ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
        "--port=0", "--dashboard-port=0", "--num-cpus=2", f"--temp-dir={temp_dir}", "--include-dashboard=true",
        f"--ray-client-server-port={_free_port()}", "--dashboard-agent-listen-port=0", "--dashboard-agent-grpc-port=0",
        "--metrics-export-port=0", "--runtime-env-agent-port=0", "--node-manager-port=0", "--object-manager-port=0",
    ]
    log = tmp / "ray_start.log"
    with log.open("w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        address = _dashboard_url(log, head)
        proc = subprocess.run(
            [f"{VENV_BIN}/ray", "job", "submit", "--address", address, "--working-dir", ".", "--",
             "python", "ray_jobs/sft.py", *JOB_ARGS, f"run.storage_path={tmp}"],
            cwd=ROOT, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=540,
        )
    finally:
        procs = _descendants(head.pid)
        _stop(procs)
        shutil.rmtree(temp_dir, ignore_errors=True)
    return JobSubmitRun(proc.returncode, proc.stdout + proc.stderr, tmp / "job", head.poll() is not None,
                        [p.pid for p in procs if _alive(p)])
