"""Shared fixtures: the real data in ../shared/data, one Ray instance for the whole run, config helpers.

Ray: ``ray_local`` starts one local instance on 127.0.0.1 for the whole pytest session (``ray.init``
costs ~5 s, and every Ray Train fit in it reuses the same GCS and raylet). Tests that need a Ray of
their own (custom node resources, a ``ray start`` head, the job scripts' own start-up) run it in a
child process with :data:`RAY_LOCAL_INIT` or the scripts' ``init_ray``; nothing in this process may
call ``ray.shutdown()`` or ``ray.init()`` with other arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

# Every Ray the tests start, here or in a child process (job scripts, `ray start`, notebooks), stays on
# 127.0.0.1: Ray's single-machine mode, see pipelines/ray_local.py. Set before anything imports ray.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray Train's controller polls its workers every 2 s by default: it notices a finished run, a failed worker and
# a started group that late, ~5 s of every test fit's 22 s on 2 cores. A quarter second here (the tests' runs
# are seconds long, a real run's are hours); every Ray the tests start reads it from this environment, except
# the node-loss cluster's, which keeps Ray's default (tests/node_loss_cluster.py says why).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# DeepSpeed compiles its CPU shared-memory op (shm.cpp, ~100 CPU-s) on first use in a process, with the first
# `ninja` on PATH, into one cache directory. The venv's bin goes first, as an activated venv has it, so every
# process of the session -- Ray workers, `ray start` heads, job scripts, notebook kernels -- runs the venv's
# ninja (1.13, a DeepSpeed dependency): a system ninja (1.11) hashes build commands another way, and each of
# the two saw the other's build as stale and rebuilt it, 2 to 5 times a run of this suite (CI's included). The cache
# lives in the venv: another checkout's venv (CI's clean clone) has other paths and would rebuild ours.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# The environment as the session starts: what the processes of the jobs beside the tests get (BACKGROUND_JOBS
# below). A test's monkeypatch.setenv changes os.environ for the whole process while that test runs, and a job
# started meanwhile inherited it: in CI (2026-12-07) the notebook's fit got a fault test's PIPELINES_FAULTS
# and failed at the injected fault.
SESSION_ENV = dict(os.environ)

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PIPELINES_SHARED_DATA", ROOT.parent / "shared" / "data"))
GPT2 = SHARED / "tokenizers" / "gpt2"
SMOLLM2 = SHARED / "tokenizers" / "smollm2-135m-instruct"
ALPACA = SHARED / "sft" / "alpaca_en_demo.json"
LIMA = SHARED / "sft" / "lima.json"
GLAIVE = SHARED / "chat" / "glaive_toolcall_en_demo.json"
C4 = SHARED / "text" / "c4_demo.jsonl"
SHAKESPEARE = SHARED / "text" / "tinyshakespeare.txt"

needs_shared = pytest.mark.skipif(
    not (SHARED / "SOURCES.md").exists(), reason=f"real test data not found at {SHARED} (../shared/data)"
)


# Keyword arguments of every local Ray the tests start (``pipelines.ray_local.init_local``: on 127.0.0.1).
RAY_LOCAL_INIT = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}


@pytest.fixture(autouse=True)
def _no_pool_actor_outlives_its_test():
    """After each test, kill the Ray Data actor-pool workers it left alive in this process's Ray.

    A stream that fails while its tokenizer actor is still being created can leave that actor alive
    (Ray Data's abort misses it): it keeps its CPU, and a later test's tasks wait for that CPU until
    the test times out. Seen in CI on 2026-12-03: the malformed-JSON case of
    ``test_nothing_is_read_before_iteration`` left one (created 40 ms before the abort), and
    ``test_train_e2e``'s worker-failure run then waited 15 minutes for its map task. No stream of
    these tests is meant to outlive the test that opened it.
    """
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    import logging

    from ray._private import state
    from ray._raylet import ActorID

    left = [a for a, info in state.actors().items()
            if info["State"] == "ALIVE" and info["ActorClassName"].startswith("MapWorker(")]
    for actor_id in left:
        ray._private.worker.global_worker.core_worker.kill_actor(ActorID.from_hex(actor_id), True)
    if left:
        logging.getLogger(__name__).warning("killed %d Ray Data pool actor(s) left alive by the test", len(left))


@pytest.fixture(scope="session")
def ray_local(s3_env):  # noqa: F811 (the fixture imported below)
    """One local Ray instance on 127.0.0.1 for the whole pytest run.

    Started after ``s3_env`` has put the fake S3 credentials in the environment, so its workers have
    them (Ray workers inherit the environment of the ``ray.init`` that started their raylet). Its workers get
    the environment the job scripts give their own local instance (``LOCAL_ENV``: no preemption watcher, an
    actor per fit attempt with nothing to watch on one machine); the node-loss cluster keeps the watcher.
    """
    import ray

    from pipelines.console import LOCAL_ENV
    from pipelines.ray_local import init_local

    if not ray.is_initialized():
        init_local(**RAY_LOCAL_INIT, runtime_env={"env_vars": dict(LOCAL_ENV)})
    yield ray
    ray.shutdown()


def make_config(datasets: list[dict], tokenizer: Path | str = GPT2, **data) -> object:
    """A validated Config for tests; ``data`` keys go under ``data:``."""
    from pipelines.config import config_from_dict

    data.setdefault("tokenize", {"num_actors": 1, "num_cpus": 0.5, "batch_size": 256})
    return config_from_dict({"model": {"tokenizer": str(tokenizer)}, "data": {"datasets": datasets, **data}})


def load_ray_job(name: str):
    """A script of ray_jobs/ as a module (they are scripts, not part of the package), e.g. ``convert``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"ray_jobs_{name}", ROOT / "ray_jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trained_runs(decode, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive trained tokens of one sample (``decode``: a tokenizer's decode)."""
    runs, cur = [], []
    for t, lab in zip(ids, labels, strict=True):
        if lab != -100:
            cur.append(t)
        elif cur:
            runs, cur = [*runs, cur], []
    return [decode(r) for r in [*runs, cur] if r]


# What the training processes of the torch.multiprocessing tests (test_train_step.py, test_lora_step.py,
# test_world_size_resume.py, test_chat_e2e.py) import before their first step, paid once by the fork server
# (spawn_workers) instead of by each of the 25 processes of a run: 244 CPU-s became 41 (2026-12-07).
SPAWN_PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers", "peft", "pipelines.train.step",
                 "pipelines.train.checkpoint", "pipelines.train.model", "pipelines.train.adapter"]


def spawn_workers(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, the processes forked from multiprocessing's
    fork server, which imports :data:`SPAWN_PRELOAD` once per session. Each process is fresh otherwise: it sets
    up its own process group and accelerator. The server is started by the first call and keeps the environment
    it saw then: a process that needs a variable sets it itself (these tests' workers set their ranks and ports).
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(SPAWN_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_op(ds):
    """The read operator of a dataset's plan: ``compute.size`` caps its tasks at once, ``parallelism`` is how
    many it asks for, ``datasource`` is the :class:`pipelines.sources.datasource.ShardDatasource`."""
    from ray.data._internal.logical.operators.read_operator import Read

    op = ds._logical_plan.dag
    while not isinstance(op, Read):
        (op,) = op.input_dependencies
    return op


# A real S3 endpoint on loopback (moto_server), session-scoped; see tests/conftest_s3.py.
from conftest_s3 import moto_s3, s3_env  # noqa: E402, F401
from ray_head_job import JobSubmitRun, run_job_submit  # noqa: E402

# --------------------------------------------------------------------------- the default job, run once

# The default job's entry point with a smaller model: tests/test_console.py reads its console and
# tests/test_security_placement.py its Ray address and everything it wrote, from one run.
SFT_TINY = ["model.init.hidden_size=64", "model.init.intermediate_size=128", "model.init.num_hidden_layers=2",
            "train.micro_batch_size=2", "train.max_steps=6", "train.log_every_steps=2", "train.warmup_steps=1",
            "train.eval_every_steps=3", "train.eval_max_batches=2", "train.checkpoint_every_steps=3"]
# Credentials the job must never print or write (it gets them in its environment).
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEPIPELINESTEST1",
    "AWS_SECRET_ACCESS_KEY": "fake/Secret+Key/For/Pipelines/Tests/0123456789",
    "AWS_SESSION_TOKEN": "FakeSessionTokenForPipelinesTests0123456789abcdef",
}


@dataclass(frozen=True)
class JobRun:
    """One finished run of ``python ray_jobs/sft.py``: its exit code, console and run directory."""

    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def console(self) -> str:
        return self.stdout + self.stderr


def run_sft_job(tmp: Path) -> JobRun:
    """``python ray_jobs/sft.py`` + :data:`SFT_TINY` from a fresh directory ``tmp``, as a user runs it: its own
    local Ray (not the session's), deprecation warnings shown, fake AWS credentials in its environment, and
    no single-machine hint from this process (the job keeps Ray on loopback itself)."""
    from pipelines.ray_local import SINGLE_MACHINE_ENV

    # Ray's socket paths must stay under 108 bytes; pytest's tmp dirs can be too long for them.
    ray_tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    env = {**SESSION_ENV, **FAKE_AWS, "RAY_TMPDIR": ray_tmp, "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "default::DeprecationWarning,default::FutureWarning"}
    for key in ("RAY_ADDRESS", SINGLE_MACHINE_ENV):
        env.pop(key, None)
    cmd = [sys.executable, str(ROOT / "ray_jobs" / "sft.py"), *SFT_TINY, f"run.storage_path={tmp}", "run.name=demo"]
    try:
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=880)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    (tmp / "console.txt").write_text(proc.stdout + proc.stderr)  # what the user saw, kept with pytest's tmp dirs
    return JobRun(proc.returncode, proc.stdout, proc.stderr, tmp / "demo")


@dataclass(frozen=True)
class BenchRun:
    """One finished ``benchmarks/run.py --quick``: its output folder, BENCHMARKS.md, results.json and stdout."""

    out: Path
    md: str
    results: dict
    stdout: str


# The marker line of benchmarks/run.py that keeps the sections below it (read from its text: the tests do not
# import the benchmarks), and a section an earlier BENCHMARKS.md kept there.
BENCH_KEPT_SECTION = "## Measured elsewhere\n\n| x | y |\n|---|---|\n| 1 | 2 |\n"


def bench_kept_marker() -> str:
    import re

    text = (ROOT / "benchmarks" / "run.py").read_text(encoding="utf-8")
    return re.search(r'^KEPT_MARKER = "(.*)"$', text, re.M).group(1)


def run_bench_quick(out: Path) -> BenchRun:
    """``benchmarks/run.py --quick`` into ``out``, over a BENCHMARKS.md from an earlier run (its tables are
    replaced, its kept sections stay). B5-B7 run other people's scripts (train_stall.py, mds_read.py,
    resume.py), each with its own tests and a run time that is not ours to budget; how run.py calls them is
    tested in tests/test_benchmarks_quick.py with stand-in scripts."""
    (out / "BENCHMARKS.md").write_text(f"stale tables\n\n{bench_kept_marker()}\n\n{BENCH_KEPT_SECTION}", encoding="utf-8")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(out), "--skip", "B5,B6,B7"]
    proc = subprocess.run(cmd, cwd=ROOT, env=SESSION_ENV, capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (out / "BENCHMARKS.md").read_text(encoding="utf-8")
    results = json.loads((out / "results" / "results.json").read_text(encoding="utf-8"))
    return BenchRun(out, md, results, proc.stdout)


# --------------------------------------------------------------------------- the node-loss cluster, run once

# recover first: its losses are the elastic run's reference.
NODE_LOSS_SCENARIOS = ["recover", "elastic", "preempt", "fail", "min_workers"]


@dataclass(frozen=True)
class NodeLossRuns:
    """One run of tests/node_loss_cluster.py over :data:`NODE_LOSS_SCENARIOS`: its tmp dir (``runs/<name>``
    per scenario), each scenario's ``NODE_LOSS`` result and the child's output."""

    tmp: Path
    results: dict
    output: str


def run_node_loss(tmp: Path) -> NodeLossRuns:
    """Every node-loss scenario, one after another on one loopback cluster in a child process (its start is paid
    once), with Ray Train's controller polling at its default interval, as on a user's cluster (the child
    drops the variable this module sets)."""
    env = {**SESSION_ENV, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "node_loss_cluster.py"), str(tmp),
                           ",".join(NODE_LOSS_SCENARIOS)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1700)
    out = proc.stdout + proc.stderr
    (tmp / "output.txt").write_text(out)
    assert proc.returncode == 0, out[-4000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("NODE_LOSS "):
            res = json.loads(line.removeprefix("NODE_LOSS "))
            results[res["scenario"]] = res
    return NodeLossRuns(tmp, results, out)


# --------------------------------------------------------------------------- the quickstart notebook, run once

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
NOTEBOOK_MODULES = ("nbformat", "nbclient", "matplotlib")


@dataclass(frozen=True)
class NotebookRun:
    """notebooks/quickstart.ipynb executed top to bottom (12 steps, runs under ``tmp/runs``): the notebook with its
    outputs; ``nb`` is None when one of :data:`NOTEBOOK_MODULES` is not installed."""

    nb: object | None
    tmp: Path


def run_notebook(tmp: Path) -> NotebookRun:
    """The quickstart in a Jupyter kernel of its own (its own local Ray), as a user runs it, with the kernel's
    inline plots."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in NOTEBOOK_MODULES):
        return NotebookRun(None, tmp)
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {**SESSION_ENV, "QUICKSTART_STEPS": "12", "QUICKSTART_STORAGE": str(tmp / "runs")}
    env.pop("MPLBACKEND", None)  # the kernel's inline backend renders the plots
    client = nbclient.NotebookClient(nb, timeout=800, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=env)
    return NotebookRun(nb, tmp)


# --------------------------------------------------------------------------- jobs beside the tests

# Jobs that run as processes of their own, with their own Ray, and that tests read afterwards. They start
# when collection ends (after -m/-k deselection: only for the tests that will run), one after another in a
# thread, while the in-process tests run (those leave CPU idle while they wait on Ray's workers: the suite ran
# at 57% of 2 cores, 2026-12-07); the tests that read them run last (pytest_collection_modifyitems).
# A fixture named after a job returns its result, or runs it then and there when it was not started.
def _make_mosaic_python(tmp: Path) -> Path:
    from mosaic_venv import mosaic_python

    return mosaic_python()


BACKGROUND_JOBS = {"mosaic_python": ("mosaic", _make_mosaic_python), "sft_job": ("sft_job", run_sft_job),
                   "quick_run": ("bench", run_bench_quick), "notebook_run": ("notebook", run_notebook),
                   "job_submit_run": ("job_submit", run_job_submit), "node_loss_runs": ("nodeloss", run_node_loss)}
_started: dict[str, Future] = {}


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: a job no selected test reads is not started
def pytest_collection_modifyitems(session, config, items) -> None:
    wanted = [name for name in BACKGROUND_JOBS if any(name in getattr(it, "fixturenames", ()) for it in items)]
    if config.option.collectonly:
        return
    # Last of all, the node-loss tests: their cluster's run is the last job to end (node_loss_runs).
    last = [it for it in items if "node_loss_runs" in getattr(it, "fixturenames", ())]
    late = [it for it in items if set(getattr(it, "fixturenames", ())) & set(wanted) and it not in last]
    items[:] = [it for it in items if it not in late and it not in last] + late + last
    if not wanted:
        return
    factory = config._tmp_path_factory
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-job")
    for name in wanted:
        folder, run = BACKGROUND_JOBS[name]
        _started[name] = pool.submit(run, factory.mktemp(folder))
    pool.shutdown(wait=False)


def _background(name: str, factory) -> object:
    if name in _started:
        return _started[name].result()
    folder, run = BACKGROUND_JOBS[name]
    return run(factory.mktemp(folder))


@pytest.fixture(scope="session")
def sft_job(tmp_path_factory) -> JobRun:
    """The default job's run (:func:`run_sft_job`): tests/test_console.py reads its console and
    tests/test_security_placement.py its Ray address and everything it wrote."""
    return _background("sft_job", tmp_path_factory)


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory) -> BenchRun:
    """The quick benchmark run (:func:`run_bench_quick`) that tests/test_benchmarks_quick.py reads."""
    return _background("quick_run", tmp_path_factory)


@pytest.fixture(scope="session")
def node_loss_runs(tmp_path_factory) -> NodeLossRuns:
    """The node-loss scenarios' run (:func:`run_node_loss`) that tests/test_node_loss.py reads.

    The last of the jobs beside the tests (it waits more than it computes: its steps are slowed, its restarts
    wait on timeouts), so it runs while the in-process tests finish. Its scenarios are set to stand that load
    (tests/node_loss_cluster.py: ``SLOW_S``, ``MIN_WORKERS_TIMEOUT_S``). Its tests run last.
    """
    return _background("node_loss_runs", tmp_path_factory)


@pytest.fixture(scope="session")
def notebook_run(tmp_path_factory) -> NotebookRun:
    """The quickstart notebook's run (:func:`run_notebook`) that tests/test_notebook.py reads."""
    return _background("notebook_run", tmp_path_factory)


@pytest.fixture(scope="session")
def job_submit_run(tmp_path_factory) -> JobSubmitRun:
    """``ray job submit`` of the default job to a private head (tests/ray_head_job.py), that
    tests/test_train_job_submit.py reads."""
    return _background("job_submit_run", tmp_path_factory)


@pytest.fixture(scope="session")
def mosaic_python(tmp_path_factory) -> Path:
    """A Python with mosaicml-streaming (tests/mosaic_venv.py), for the tests that run mosaic's own code."""
    return _background("mosaic_python", tmp_path_factory)
