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
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python ray_jobs/sft.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from pipelines.config import Config, ConfigError, load_config  # noqa: E402


def parse_args(argv: list[str] | None, default_config: Path, description: str) -> tuple[str, list[str]]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=str(default_config), help=f"YAML config (default: {default_config})")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=100")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def load_or_exit(config: str, overrides: list[str]) -> Config:
    """The validated config, or exit(2) with the error (which names the key) on stderr."""
    from pipelines.train.trainer import preflight

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
    # Local instance: its worker processes need to import `pipelines` from this checkout.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    init_local(runtime_env={"env_vars": {"PYTHONPATH": path}})
    print(f"ray: local instance on {', '.join(node_addresses())} (set RAY_ADDRESS to join a cluster)")


def main(argv: list[str] | None, default_config: Path, description: str) -> int:
    config, overrides = parse_args(argv, default_config, description)
    cfg = load_or_exit(config, overrides)
    init_ray()
    from pipelines.train.checkpoint import CheckpointError
    from pipelines.train.trainer import build_trainer

    try:
        trainer = build_trainer(cfg)
    except CheckpointError as err:  # e.g. the data changed since the checkpoint: nothing was trained
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = trainer.fit()
    metrics = result.metrics or {}
    print(f"finished: step {metrics.get('step')} loss {metrics.get('loss', float('nan')):.4f}")
    print(f"run dir:    {result.path}")
    print(f"checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    if cfg.run.export_model:
        print(f"model:      {result.path}/model   (AutoModelForCausalLM.from_pretrained / AutoTokenizer)")
        _show_demo_answers(cfg, f"{result.path}/model")
    return 0


def _show_demo_answers(cfg: Config, model_dir: str) -> None:
    """For the embedded demo (alpaca on demo://sft, local run dir): a few greedy answers of the model."""
    if not any(d.path == "demo://sft" for d in cfg.data.datasets) or "://" in model_dir:
        return
    from pipelines.demo import demo_generations

    print("demo answers (greedy decoding):")
    for question, expected, got in demo_generations(model_dir):
        mark = "ok" if got == expected else "  "
        print(f"  [{mark}] {question!r:40} expected {expected!r:18} got {got!r}")
