"""The tokenizer loaded through ``tokenizers`` alone encodes exactly as the transformers one does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import ALPACA, GPT2, SMOLLM2, needs_shared

from pipelines.config import ModelConfig
from pipelines.tokenizer import load_backend, load_tokenizer


def _texts() -> list[str]:
    recs = json.loads(ALPACA.read_text())[:200]
    return [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}" for r in recs] + ["", " a", "\n\n x<|endoftext|>"]


@needs_shared
@pytest.mark.parametrize("path", [GPT2, SMOLLM2, "demo://tokenizer"], ids=["gpt2", "smollm2", "demo"])
def test_direct_backend_matches_transformers(path):
    model = ModelConfig.model_validate({"tokenizer": str(path), "init": {}})
    direct = load_backend(model)
    assert direct.direct, "a plain tokenizer.json should load without transformers"
    via_hf = load_backend(model, load_tokenizer(model))
    assert not via_hf.direct
    assert (direct.eos_token_id, direct.vocab_size) == (via_hf.eos_token_id, via_hf.vocab_size)
    assert direct.eos_token_id is not None
    texts = _texts()
    for flag in (True, False):
        a = direct.tokenizer.encode_batch(texts, add_special_tokens=flag)
        b = via_hf.tokenizer.encode_batch(texts, add_special_tokens=flag)
        assert [e.ids for e in a] == [e.ids for e in b]
        assert [e.offsets for e in a] == [e.offsets for e in b]
    assert sum(len(e.ids) for e in a) > 10_000  # real text, not a vacuous comparison


@needs_shared
def test_config_that_transformers_applies_falls_back(tmp_path):
    """A tokenizer_config key that transformers applies to the Rust tokenizer: load through transformers."""
    tok = tmp_path / "tok"
    shutil.copytree(GPT2, tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    model = ModelConfig.model_validate({"tokenizer": str(tok), "init": {}})
    assert not load_backend(model).direct


@needs_shared
def test_non_chat_tokenizer_stage_does_not_import_transformers():
    """The tokenizer actor for an Alpaca dataset starts without importing transformers (or torch)."""
    code = f"""
import sys
from pipelines.config import config_from_dict
from pipelines.sources import resolve_sources
from pipelines.stats import StatsSink
from pipelines.tokenize import Tokenizer
cfg = config_from_dict({{"model": {{"tokenizer": "{GPT2}", "init": {{}}}},
                         "data": {{"datasets": [{{"path": "{ALPACA}", "type": "alpaca"}}]}}}}, base_dir=".")
Tokenizer(cfg.data, cfg.model, resolve_sources(cfg), StatsSink())
print(sorted(m for m in ("transformers", "torch") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
