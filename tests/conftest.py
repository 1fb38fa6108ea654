"""Shared fixtures: the real data in ../shared/data, one Ray instance per test module, config helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for a test module (ray.init costs ~5 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
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


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# A real S3 endpoint on loopback (moto_server), session-scoped; see tests/conftest_s3.py.
from conftest_s3 import moto_s3  # noqa: E402, F401
