"""No credentials anywhere a run writes or prints; Ray on loopback; tokenizer actors placed by a custom resource."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAKE_AWS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_job_on_loopback_and_no_credentials_in_anything_it_writes_or_prints(sft_job):
    """The run of ``conftest.sft_job``: the job had fake AWS credentials in its environment and no
    single-machine hint from pytest."""
    assert sft_job.returncode == 0, sft_job.console[-3000:]
    # The default job's local Ray advertises loopback only (the GCS's view of its node, read by the job).
    assert "ray: local instance on 127.0.0.1 (" in sft_job.stdout, sft_job.console[-3000:]
    files = [p for p in sft_job.run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "trainer_state.json" for p in files) and any(p.name == "metrics.jsonl" for p in files)
    assert any(p.parent.name == "model" for p in files)  # the export was written too
    for secret in FAKE_AWS.values():
        assert secret not in sft_job.console
        for p in files:
            assert secret.encode() not in p.read_bytes(), f"{secret[:8]}... found in {p}"


# Runs in a child process with its own Ray instance: the unschedulable case leaves a Ray Data iterator
# blocked for good, and a driver that shuts Ray down under such an iterator keeps a stale core worker
# that ends the whole process (pytest included) 60 s later, when it notices its GCS is gone.
PLACEMENT_CHILD = """
import sys, threading
sys.path.insert(0, sys.argv[1])
import ray
from conftest import ALPACA, RAY_LOCAL_INIT, make_config
from pipelines.stream.dataset import build_dataset
from pipelines.ray_local import init_local

init_local(**RAY_LOCAL_INIT, resources={"cpu_node": 1})
cfg = make_config([{"path": str(ALPACA), "type": "alpaca"}],
                  tokenize={"num_actors": 1, "num_cpus": 0.5, "resources": {"cpu_node": 1}})
print("PLACED_ROWS", len(build_dataset(cfg).take_all()), flush=True)
cfg_bad = make_config([{"path": str(ALPACA), "type": "alpaca"}],
                      tokenize={"num_actors": 1, "num_cpus": 0.5, "resources": {"gpu_node": 1}})
it = iter(build_dataset(cfg_bad).iter_batches(batch_size=None))
got = []
t = threading.Thread(target=lambda: got.append(next(it, None)), daemon=True)
t.start()
t.join(timeout=20)
print("UNPLACED_BLOCKED", t.is_alive() and not got, flush=True)
ray.shutdown()
import os
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tokenizer_actors_run_only_where_the_resource_is():
    """``data.tokenize.resources`` pins the actors: here a custom resource stands in for a CPU node type."""
    from conftest import ALPACA, needs_shared

    if not ALPACA.exists():
        pytest.skip(needs_shared.kwargs["reason"])
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", PLACEMENT_CHILD, str(ROOT / "tests")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    rows = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PLACED_ROWS")]
    assert rows and rows[0] > 0, out[-3000:]  # runs where the resource is
    # Asking for a resource no node has leaves the actor unschedulable instead of running elsewhere.
    assert "UNPLACED_BLOCKED True" in proc.stdout, "a tokenizer ran without the resource it was pinned to"


def test_shared_test_ray_is_on_loopback(ray_local):
    """The session's shared Ray (conftest.py) advertises 127.0.0.1 and listens on nothing else.

    Only its own processes are looked at (what Ray started for it, and their children), not those of the
    jobs the suite runs beside it (conftest's BACKGROUND_JOBS). Not covered: while a fit runs, torch's
    rendezvous store on rank 0 (``TCPStore``, created by Ray Train's ``init_process_group``) listens on
    ``::``, whatever address it is given; torch has no bind address for it."""
    import psutil

    from pipelines.ray_local import node_addresses

    assert node_addresses() == ["127.0.0.1"]
    assert ray_local.get(ray_local.remote(lambda: ray_local.util.get_node_ip_address()).remote()) == "127.0.0.1"
    started = [info.process.pid for infos in ray_local._private.worker._global_node.all_processes.values()
               for info in infos]  # gcs_server, raylet (the workers' parent), dashboard, monitors
    ours = [psutil.Process(pid) for pid in started if psutil.pid_exists(pid)]
    listening = set()  # (process, address) of every listening socket of this Ray's processes
    for proc in ours + [c for p in ours for c in p.children(recursive=True)]:
        try:
            listening |= {(proc.name(), c.laddr.ip) for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    assert any(name.startswith("gcs_server") for name, _ in listening) and any(n == "raylet" for n, _ in listening)
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, sorted(listening)
