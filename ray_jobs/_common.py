"""Shared by the job scripts: parse ``--config X key=value ...``, validate, start/join Ray, train.

Validation (YAML, keys, types, the DeepSpeed config, resume path) happens before ``ray.init``: a bad
config exits with status 2 and a message naming the key, without starting anything.

Ray: inside ``ray job submit`` (or with ``RAY_ADDRESS`` set) the script joins that cluster; otherwise
a local instance starts for the duration of the script, on 127.0.0.1 (``pipelines.ray_local``; by
default Ray would advertise the machine's network address).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python ray_jobs/sft.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from pipelines.config import Config, ConfigError, load_config  # noqa: E402
from pipelines.stream.batch import global_rows  # noqa: E402


def parse_args(argv: list[str] | None, default_config: Path, description: str) -> tuple[str, list[str]]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=str(default_config), help=f"YAML config (default: {default_config})")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=100")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def load_or_exit(config: str, overrides: list[str]) -> Config:
    """The validated config, or exit(2) with the error (which names the key) on stderr."""
    from pipelines.train.preflight import preflight

    try:
        cfg = load_config(config, overrides)
        preflight(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


def init_ray() -> None:
    """Join the cluster of ``ray job submit`` / ``RAY_ADDRESS``, or start a local instance on 127.0.0.1."""
    import ray

    from pipelines.ray_local import init_local, node_addresses

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return
    from pipelines.console import LOCAL_ENV, SETUP_HOOK, quiet_driver

    # Local instance: its worker processes need to import `pipelines` from this checkout; they print only what
    # a user can act on (pipelines.console).
    quiet_driver()
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ctx = init_local(runtime_env={"env_vars": {"PYTHONPATH": path, **LOCAL_ENV}, "worker_process_setup_hook": SETUP_HOOK})
    dashboard = f"dashboard http://{ctx.dashboard_url}, " if ctx.dashboard_url else ""
    auth = "token authentication off" if os.environ.get("RAY_AUTH_MODE") == "disabled" else "token authentication on"
    print(f"ray: local instance on {', '.join(node_addresses())} ({dashboard}{auth}; set RAY_ADDRESS to join a cluster)")


def main(argv: list[str] | None, default_config: Path, description: str) -> int:
    started_at = time.time()
    config, overrides = parse_args(argv, default_config, description)
    cfg = load_or_exit(config, overrides)
    from pipelines.train.metrics import format_summary, read_summary, startup_line

    print(startup_line(time.time() - started_at, "config", describe(cfg, config, overrides)), flush=True)
    if note := cpu_bf16_note(cfg):
        print(f"note: {note}", flush=True)
    init_ray()
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 0))
    how = "joined " + os.environ["RAY_ADDRESS"] if os.environ.get("RAY_ADDRESS") else "local Ray started"
    print(startup_line(time.time() - started_at, "cluster up", f"{how}, {cpus} CPUs"), flush=True)
    from pipelines.train.checkpoint import CheckpointError
    from pipelines.train.storage import run_dir, storage_filesystem
    from pipelines.train.trainer import build_trainer

    try:
        trainer = build_trainer(cfg, started_at=started_at)
    except CheckpointError as err:  # e.g. the data changed since the checkpoint: nothing was trained
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = trainer.fit()
    try:
        summary = read_summary(run_dir(cfg), storage_filesystem(cfg))
    except (OSError, ValueError) as err:  # e.g. the run stopped before writing it
        print(f"run dir: {result.path} (no summary.json: {err})")
        return 0
    extra: dict[str, float] = {}
    full_model = summary.get("model_path") if summary.get("model_path") != summary.get("adapter_path") else None
    if full_model and _is_local_demo(cfg, full_model):
        t0 = time.time()
        _show_demo_answers(full_model)
        extra["demo answers"] = time.time() - t0
    print(format_summary(summary, extra), flush=True)
    return 0


def describe(cfg: Config, config: str, overrides: list[str]) -> str:
    """One line: config file, model, workers, precision, steps x global batch, run dir."""
    t, s = cfg.train, cfg.scaling
    model = (f"{cfg.model.init.architecture} init (hidden {cfg.model.init.hidden_size}, "
             f"{cfg.model.init.num_hidden_layers} layers)") if cfg.model.init else cfg.model.name_or_path
    rows = global_rows(t, s)
    workers = f"{s.min_workers}-{s.max_workers} (elastic)" if s.elastic else str(s.num_workers)
    steps = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs} epoch(s)"
    ds = t.deepspeed if isinstance(t.deepspeed, str) else "inline"
    return (f"{config}{f' (+{len(overrides)} overrides)' if overrides else ''} | {model} | "
            f"{workers} {'GPU' if s.use_gpu else 'CPU'} workers, DeepSpeed {ds}, {'bf16' if t.bf16 else 'fp32'} | "
            f"{steps} x {rows} rows x {cfg.data.sequence_len} tokens | run {cfg.run.storage_path}/{cfg.run.name}")


def cpu_bf16_note(cfg: Config) -> str | None:
    """A warning for bf16 on CPU workers of a CPU without native bf16 (there it is ~9x slower than fp32)."""
    if cfg.scaling.use_gpu or not cfg.train.bf16:
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None
    if any(f in flags.split() for f in ("avx512_bf16", "amx_bf16")):
        return None
    return ("train.bf16 on CPU workers, and this CPU has no native bf16 (avx512_bf16/amx_bf16): a step is "
            "~9x slower than fp32 here (BENCHMARKS.md); set train.bf16=false for CPU runs")


def _is_local_demo(cfg: Config, model_dir: str) -> bool:
    return any(d.path == "demo://sft" for d in cfg.data.datasets) and "://" not in model_dir


def _show_demo_answers(model_dir: str) -> None:
    """For the embedded demo (alpaca on demo://sft, local run dir): a few greedy answers of the model."""
    from pipelines.console import quiet_progress_bars
    from pipelines.demo import demo_generations

    quiet_progress_bars()  # transformers 5's "Loading weights" bar
    answers = demo_generations(model_dir)
    right = sum(got == expected for _, expected, got in answers)
    print(f"demo answers (greedy decoding, {right}/{len(answers)} right):")
    for question, expected, got in answers:
        mark = "ok" if got == expected else "  "
        print(f"  [{mark}] {question!r:40} expected {expected!r:18} got {got!r}")
