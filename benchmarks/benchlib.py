"""Shared helpers for the benchmark scripts: data preparation, child-process runs with process-tree
peak RSS, medians, packing baselines, machine and version info, markdown tables.

Every measured system runs in its own child process (``benchmarks/systems.py NAME PARAMS``) so that
imports, ``ray.init`` and memory of one system never leak into another; the parent samples the RSS
of the child's whole process tree (Ray's raylet, GCS and workers included) with psutil.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
SHARED = Path(os.environ.get("PIPELINES_SHARED_DATA", ROOT.parent / "shared" / "data"))
ALPACA = SHARED / "sft" / "alpaca_en_demo.json"
LIMA = SHARED / "sft" / "lima.json"
SHAKESPEARE = SHARED / "text" / "tinyshakespeare.txt"
GPT2 = SHARED / "tokenizers" / "gpt2"
SMOLLM2 = SHARED / "tokenizers" / "smollm2-135m-instruct"
DEFAULT_WORK = BENCH_DIR / ".work"
PY = sys.executable
# Systems that run mosaic-streaming's own code: in the venv that has it (tests/mosaic_venv.py; mosaic 0.13
# pins transformers<5 and numpy<2.2, so it cannot share the project's environment).
MOSAIC_SYSTEMS = ("prep_mds", "mosaic")
RESULT_TAG = "BENCH_RESULT "

# No hub access at run time; every child runs with these.
CHILD_ENV = {
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "RAY_DEDUP_LOGS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONWARNINGS": "ignore",
}


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot, from ``/proc/stat`` (``nice``
    counts as busy: Ray's worker processes run niced)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_quiet(max_busy: float = 0.15, window_s: float = 0.5, timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until the machine's CPUs are at most ``max_busy`` busy over ``window_s``, at most ``timeout_s``.

    Before a timed run: right after ``ray.init`` or after starting actors, Ray keeps starting worker
    processes in the background (each imports ``ray`` on the shared cores), and a clock started then
    measures their start-up too. Measured on the feeder benchmark (2 ranks, 2026-12-02): two such
    workers took 1.7 of the 3.0 CPU-s of a 1.5 s run. Returns the wait and the last window's busy share.
    """
    t0 = time.perf_counter()
    busy = 1.0
    while time.perf_counter() - t0 < timeout_s:
        b0, n0 = _busy_jiffies()
        time.sleep(window_s)
        b1, n1 = _busy_jiffies()
        busy = (b1 - b0) / max(1, n1 - n0)
        if busy <= max_busy:
            break
    return {"waited_s": round(time.perf_counter() - t0, 2), "busy": round(busy, 3)}


def shared_available() -> bool:
    return ALPACA.is_file() and (GPT2 / "tokenizer.json").is_file()


# --------------------------------------------------------------------------- data


def alpaca_records() -> list[dict[str, Any]]:
    return json.loads(ALPACA.read_text(encoding="utf-8"))


def write_alpaca_jsonl(work: Path, n_records: int) -> Path:
    """The Alpaca demo cycled to ``n_records`` records, as JSONL shards of one copy each (999 records, 0.84 MB).

    Cached under ``work/data/alpaca_<n>``; written to a temp dir and renamed, so a crash leaves no half set.
    """
    out = work / "data" / f"alpaca_{n_records}"
    if out.is_dir():
        return out
    recs = alpaca_records()
    shard_records = len(recs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".alpaca_{n_records}_"))
    lines = [json.dumps(recs[i % len(recs)], ensure_ascii=False) + "\n" for i in range(n_records)]
    for shard, start in enumerate(range(0, n_records, shard_records)):
        (tmp / f"part-{shard:04d}.jsonl").write_text("".join(lines[start : start + shard_records]), encoding="utf-8")
    try:
        tmp.rename(out)
    except OSError:  # another run made it first
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return out


def jsonl_files(data_dir: Path) -> list[str]:
    return sorted(str(p) for p in Path(data_dir).glob("*.jsonl"))


def data_bytes(data_dir: Path) -> int:
    return sum(os.path.getsize(p) for p in jsonl_files(data_dir))


def use_checkout(root: Path) -> Path:
    """Run this process, and the Ray workers it starts, on ``root``'s ``pipelines`` (to compare two checkouts on
    one host): Ray's local workers import from the driver's working directory. Resolve relative paths first."""
    root = root.resolve()
    os.chdir(root)
    sys.path[:0] = [str(root), str(Path(__file__).resolve().parent)]
    return root


def iter_ray_blocks(ds: Any) -> Any:
    """A Ray dataset's blocks as pyarrow tables, each as soon as it is ready (as the feeder reads them).

    ``prefetch_batches=0``: with ``batch_size=None``, Ray 2.60's prefetching window hands a block out only
    once the next one has arrived (``prefetch_batches_locally``), which holds the first row back by a block.
    Empty blocks are passed over: a read task that yields no unit leaves one without columns (as in the feeder).
    """
    return (b for b in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0) if b.num_rows)


# --------------------------------------------------------------------------- child runs


class TreeRSS:
    """Samples the summed RSS of a process and all its descendants every ``interval`` seconds.

    RSS sums count shared pages (Ray's object store, shared libraries) once per process that maps
    them, so this is an upper bound on the tree's real footprint, the same way for every system.
    """

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        import psutil

        self._psutil = psutil
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.cpu: dict[tuple[int, float], float] = {}  # (pid, create_time) -> user+system seconds, last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        ps = self._psutil
        try:
            root = ps.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except ps.Error:
            return 0
        total = 0
        for p in procs:
            with contextlib.suppress(ps.Error):
                total += p.memory_info().rss
                t = p.cpu_times()
                self.cpu[(p.pid, p.create_time())] = t.user + t.system
        return total

    @property
    def cpu_s(self) -> float:
        """CPU seconds used by the tree (processes seen by the sampler; a short-lived one may be missed)."""
        return sum(self.cpu.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


@functools.cache
def mosaic_python() -> Path:
    """The interpreter of the venv with mosaicml-streaming, made on first use (tests/mosaic_venv.py)."""
    proc = subprocess.run([PY, str(ROOT / "tests" / "mosaic_venv.py")], capture_output=True, text=True, check=True)
    return Path(proc.stdout.strip().splitlines()[-1])


def run_system(name: str, params: dict[str, Any], timeout: float = 600, env: dict[str, str] | None = None,
               log_dir: Path | None = None) -> dict[str, Any]:
    """Run ``systems.py name params`` in a child; its result dict plus ``peak_rss_mb`` and ``wall_s``.

    Never raises for a failing system: the dict then has ``error`` (the last lines of its stderr).
    """
    child_env = {**os.environ, **CHILD_ENV, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(BENCH_DIR), child_env.get("PYTHONPATH", "")])
    log_dir = Path(log_dir or tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    err_path = log_dir / f"{name}-{os.getpid()}-{time.monotonic_ns()}.stderr"
    cmd = [str(mosaic_python()) if name in MOSAIC_SYSTEMS else PY, str(BENCH_DIR / "systems.py"), name,
           json.dumps(params)]
    t0, t_spawn = time.perf_counter(), time.time()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=child_env, cwd=ROOT, text=True,
                                start_new_session=True)
        try:
            with TreeRSS(proc.pid) as rss:
                out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, _ = proc.communicate()
            return {"error": f"timed out after {timeout:.0f} s", "system": name}
    wall = time.perf_counter() - t0
    result: dict[str, Any] | None = None
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
    if proc.returncode != 0 or result is None:
        tail = _tail(err_path)
        return {"error": f"exit {proc.returncode}: {tail}", "system": name}
    result.update(system=name, peak_rss_mb=rss.peak / 2**20, wall_s=wall, cpu_s=rss.cpu_s)
    if result.get("first_row_unix"):  # from process start: imports, tokenizer load and init included
        result["cold_ttfb_s"] = result["first_row_unix"] - t_spawn
    if result.get("tokens") and "pass_s" not in result:  # raw repeats passes in one process: no per-token CPU
        result["cpu_s_per_mtok"] = rss.cpu_s / (result["tokens"] / 1e6)
    with contextlib.suppress(OSError):
        err_path.unlink()
    return result


def kill_group(proc: subprocess.Popen) -> None:
    """End the child's own session (it was started with start_new_session, so only what it started)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _tail(path: Path, n: int = 6) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no stderr)"
    return " | ".join(lines[-n:])[-1200:]


NUMERIC_KEYS = ("init_s", "ttfb_s", "total_s", "steady_tok_s", "e2e_tok_s", "peak_rss_mb", "wall_s",
                "baseline_rss_mb", "efficiency", "tokens", "rows", "cpu_s", "cpu_s_per_mtok", "cold_ttfb_s")


def repeat_system(name: str, params: dict[str, Any], repeats: int, **kw: Any) -> dict[str, Any]:
    """``repeats`` runs; numeric keys are medians, ``runs`` holds every run. Errors win if all fail."""
    return summarize_runs(name, [run_system(name, params, **kw) for _ in range(repeats)])


def interleave_systems(systems: dict[str, tuple[str, dict[str, Any], dict[str, str] | None]], repeats: int,
                       **kw: Any) -> dict[str, dict[str, Any]]:
    """Each of ``systems`` (key -> (system, params, env)) once per round, ``repeats`` rounds, in the same order:
    a slow spell of the machine falls on every system alike. Per key, :func:`summarize_runs` of its rounds."""
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in systems}
    for _ in range(repeats):
        for key, (name, params, env) in systems.items():
            runs[key].append(run_system(name, params, env=env, **kw))
    return {key: summarize_runs(systems[key][0], rs) for key, rs in runs.items()}


def summarize_runs(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one system: numeric keys are medians, ``runs`` holds every run, ``steady_spread`` the min and max
    steady tokens/s. Errors win if all fail."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"], "system": name, "runs": runs}
    out = dict(ok[-1])
    for key in NUMERIC_KEYS:
        vals = [r[key] for r in ok if isinstance(r.get(key), int | float)]
        if vals:
            out[key] = statistics.median(vals)
    out["repeats"] = len(ok)
    out["runs"] = [{k: r.get(k) for k in NUMERIC_KEYS if k in r} for r in runs]
    steady = [r["steady_tok_s"] for r in ok if isinstance(r.get("steady_tok_s"), int | float)]
    if steady:
        out["steady_spread"] = [min(steady), max(steady)]
    if len(ok) < len(runs):
        out["failed_runs"] = len(runs) - len(ok)
    return out


# --------------------------------------------------------------------------- packing baselines


def first_fit(lengths: np.ndarray, capacity: int, order: np.ndarray | None = None) -> list[list[int]]:
    """First-fit bin packing: each item (in ``order``) goes to the first open bin with room.

    Arrival order gives the greedy streaming baseline; decreasing length order gives FFD (multipack).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(len(lengths)) if order is None else order
    room = np.empty(len(lengths), dtype=np.int64)
    bins: list[list[int]] = []
    for i in order:
        n = int(lengths[i])
        k = -1
        if bins:
            fits = room[: len(bins)] >= n
            k = int(fits.argmax())
            if not fits[k]:
                k = -1
        if k < 0:
            room[len(bins)] = capacity - n
            bins.append([int(i)])
        else:
            room[k] -= n
            bins[k].append(int(i))
    return bins


def ffd(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit decreasing over the whole dataset (what multipack-style samplers do)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return first_fit(lengths, capacity, np.argsort(-lengths, kind="stable"))


# --------------------------------------------------------------------------- environment


def machine_info() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_model": cpu,
        "memory_gib": round(vm.total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def git_state() -> dict[str, Any]:
    """The checkout a benchmark ran from: ``{"commit": short sha, "dirty": [changed tracked files]}``
    (``commit`` is ``None`` outside a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": []}
    return {"commit": commit, "dirty": [line[3:] for line in status.splitlines() if line.strip()]}


LIBRARIES = ("ray", "tokenizers", "transformers", "datasets", "mosaicml-streaming", "litdata", "pyarrow",
             "numpy", "torch", "matplotlib", "psutil", "pydantic")


def versions() -> dict[str, str]:
    """The version of each library in :data:`LIBRARIES`; mosaicml-streaming's from the venv its peers run in
    (:func:`mosaic_python`, which this does not make) when it is not installed here."""
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = "not installed"
    if out["mosaicml-streaming"] == "not installed":
        python = Path(os.environ.get("PIPELINES_MOSAIC_PYTHON") or ROOT / ".venv-mosaic" / "bin" / "python")
        probe = "import importlib.metadata as m; print(m.version('mosaicml-streaming'))"
        proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True) if python.exists() else None
        if proc is not None and proc.returncode == 0:
            out["mosaicml-streaming"] = f"{proc.stdout.strip()} ({python.parent.parent.name})"
    return out


def fmt_num(v: float | None) -> str:
    """A table's number: 3 significant digits below 1,000, whole with separators above; ``-`` for none."""
    return "-" if v is None else f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None or isinstance(v, float):
            return fmt_num(v)
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.3f} M"


# ----------------------------------------------------------------------------- the opening table


def figures(label: str, total_s: float | None, first_s: float | None = None, steady: float | None = None,
            runs_s: list[float] | None = None) -> dict[str, Any]:
    """One system's figures for the opening table of BENCHMARKS.md (:func:`headline`): its median ``total_s``,
    its first batch or row (``first_s``, start-up), its ``steady`` rate after that, and the spread of its runs'
    totals. Example: ``figures("mosaic", 0.55, 0.10, 28.7e6, [1.24, 0.47, 0.61])``."""
    runs = [r for r in runs_s or [] if r is not None]
    return {"label": label, "total_s": total_s, "first_s": first_s, "steady": steady,
            "spread_s": [min(runs), max(runs)] if runs else None, "runs": len(runs) or 1}


def headline(workload: str, unit: str, ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """A row of the opening table: ``ours`` against the best variant of one peer (both :func:`figures`) on the
    same work, ``unit`` the steady rate's (e.g. ``M tok/s``). The scripts put these rows in their ``RESULT``
    line under ``headline``; ``benchmarks/run.py`` gathers them into one table."""
    return {"workload": workload, "unit": unit, "ours": ours, "peer": peer}
