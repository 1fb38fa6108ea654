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
from pathlib import Path

import pytest

# Every Ray the tests start, here or in a child process (job scripts, `ray start`, notebooks), stays on
# 127.0.0.1: Ray's single-machine mode, see pipelines/ray_local.py. Set before anything imports ray.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

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


@pytest.fixture(scope="session")
def ray_local(s3_env):  # noqa: F811 (the fixture imported below)
    """One local Ray instance on 127.0.0.1 for the whole pytest run.

    Started after ``s3_env`` has put the fake S3 credentials in the environment, so its workers have
    them (Ray workers inherit the environment of the ``ray.init`` that started their raylet).
    """
    import ray

    from pipelines.ray_local import init_local

    if not ray.is_initialized():
        init_local(**RAY_LOCAL_INIT)
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
from conftest_s3 import moto_s3, s3_env  # noqa: E402, F401
