"""benchmarks/gpu_check.py in its tiny CPU mode, so the GPU self-check cannot rot before a GPU arrives.

Two processes, as on a GPU box: the packed rows are made by the project's pipeline (Ray importable, no
cluster started), then the check runs with every ``ray`` import blocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
BLOCK_RAY = """
import importlib.abc, sys
class _NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"ray is blocked in this test ({name})")
sys.meta_path.insert(0, _NoRay())
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_check_tiny_cpu_mode_without_ray(tmp_path):
    rows = tmp_path / "rows.npz"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    made = subprocess.run([sys.executable, str(SCRIPT), "--save-rows", str(rows), "--seq-len", "1024"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]

    (tmp_path / "sitecustomize.py").write_text(BLOCK_RAY)  # imported at start-up: no Ray from here on
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--rows", str(rows)],
                          env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    res = {r["attn"]: r for r in json.loads(line[len("RESULT "):])["results"]}

    sdpa = res["sdpa"]  # the 4D block mask keeps packed samples apart: same loss as run alone
    assert sdpa["equal"] is True and float(sdpa["rel_diff"]) <= 1e-5 and float(sdpa["max_token_diff"]) <= 1e-4
    assert float(sdpa["packed_loss"]) > 0 and sdpa["backward"] == "ok" and float(sdpa["tokens_per_s"]) > 0
    assert "skipped" in res["flash_attention_2"]  # needs CUDA: reported, not run
    assert "no flex-attention backward" in res["flex_attention"]["skipped"]  # GPU only (see gpu_check.py)


def test_equality_check_would_catch_a_leaking_mask(monkeypatch):
    """Break the mask on purpose (plain causal over the whole row): the packed loss must differ."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    row = {"input_ids": rng.integers(4, 260, 96), "labels": rng.integers(4, 260, 96),
           "position_ids": np.concatenate([np.arange(40), np.arange(30), np.arange(26)])}
    model = gpu_check.build("tiny", "sdpa", torch.device("cpu"), torch.float32)
    got, alone, token_diff = gpu_check.equality(model, "sdpa", [row], torch.device("cpu"), torch.float32)
    assert abs(got - alone) / alone < 1e-5 and token_diff < 1e-4

    real = gpu_check.collate_for

    def leaky(attn, rows, dtype):
        b = real(attn, rows, dtype)
        b.pop("attention_mask")
        b["position_ids"] = torch.arange(b["input_ids"].shape[1])[None]  # one long sample: attention leaks
        return b

    monkeypatch.setattr(gpu_check, "collate_for", leaky)
    got, alone, token_diff = gpu_check.equality(model, "sdpa", [row], torch.device("cpu"), torch.float32)
    assert token_diff > 1e-3, token_diff  # the per-token check sees it (the sums differ by ~3e-4 only)
