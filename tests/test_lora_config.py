"""``model.adapter`` / ``train.export_merged``: bad input fails before Ray starts, naming the key.

No Ray, no training: config validation, :func:`preflight` on a meta-device skeleton of the model,
and the job script's exit status (``ray.init`` is replaced by a function that fails the test).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
from conftest import load_ray_job

from pipelines.config import ConfigError, config_from_dict

TINY = {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 128}
BASE = {"model": {"tokenizer": "demo://tokenizer", "init": TINY}, "data": {"datasets": [{"path": "x.jsonl"}]}}


def _cfg(adapter: dict | None = None, **sections):
    raw = copy.deepcopy(BASE)
    if adapter is not None:
        raw["model"]["adapter"] = adapter
    raw.update(sections)
    return config_from_dict(raw)


def _preflight(cfg) -> None:
    from pipelines.train.preflight import preflight

    preflight(cfg)


def test_defaults_fill_in_for_lora_and_survive_the_worker_round_trip():
    cfg = _cfg({"type": "lora", "r": 8})
    a = cfg.model.adapter
    assert (a.r, a.alpha, a.dropout, a.target_modules) == (8, 16.0, 0.05, "all-linear")
    again = config_from_dict(cfg.model_dump(mode="json"))  # what a Ray Train worker re-validates
    assert again.model.adapter == a
    plain = config_from_dict(_cfg().model_dump(mode="json"))
    assert plain.model.adapter.type == "none" and plain.model.adapter.r is None


@pytest.mark.parametrize(("adapter", "sections", "needle"), [
    ({"type": "lora", "r": 0}, {}, "model.adapter.r: Input should be greater than 0"),
    ({"type": "lora", "r": -4}, {}, "model.adapter.r"),
    ({"type": "lora", "target_modules": []}, {}, "model.adapter.target_modules"),
    ({"r": 8}, {}, "model.adapter.r set but model.adapter.type is none"),  # used or rejected
    ({"type": "none", "target_modules": ["q_proj"]}, {}, "model.adapter.target_modules set but"),
    ({"type": "lora", "dropout": 1.0}, {}, "model.adapter.dropout"),
    ({"type": "lorax"}, {}, "model.adapter.type"),
    (None, {"train": {"export_merged": True}}, "train.export_merged: needs model.adapter.type"),
    ({"type": "lora"}, {"train": {"export_merged": True}, "run": {"export_model": False}},
     "train.export_merged: needs run.export_model=true"),
])
def test_bad_adapter_config_names_the_key(adapter, sections, needle):
    with pytest.raises(ConfigError) as err:
        _cfg(adapter, **sections)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize(("targets", "needle"), [
    (["q_proj", "c_attn"], "'c_attn' matches no module of LlamaForCausalLM"),  # one of two matches nothing
    ("c_attn|c_proj", "matches no module"),  # a GPT-2 regex on a Llama: the model has no such modules
    (["input_layernorm"], "LlamaRMSNorm), which LoRA cannot adapt"),
    ("(q_proj", "is not a valid regex"),
])
def test_targets_checked_against_the_architecture(targets, needle):
    with pytest.raises(ConfigError) as err:
        _preflight(_cfg({"type": "lora", "target_modules": targets}))
    msg = str(err.value)
    assert msg.startswith("model.adapter.target_modules:") and needle in msg, msg
    assert "q_proj" in msg or "regex" in msg  # the message lists the layers the model does have


def test_good_targets_pass():
    for targets in ("all-linear", ["q_proj", "v_proj"], r".*\.mlp\.(up|down)_proj"):
        _preflight(_cfg({"type": "lora", "target_modules": targets}))


def test_qlora_refused_on_cpu_and_without_bitsandbytes(monkeypatch):
    with pytest.raises(ConfigError, match=r"model.adapter.type: qlora needs a GPU"):
        _preflight(_cfg({"type": "qlora"}))
    gpu = _cfg({"type": "qlora"}, scaling={"use_gpu": True})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"qlora needs the bitsandbytes package .* not installed"):
        _preflight(gpu)


def test_job_script_exits_2_before_ray_starts(monkeypatch, capsys, tmp_path):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init called for a config that preflight should have refused")

    monkeypatch.setattr(ray, "init", no_ray)
    sft = load_ray_job("_common")
    overrides = ["model.adapter.type=qlora", f"run.storage_path={tmp_path}"]
    with pytest.raises(SystemExit) as exit_:
        sft.main(["--config", str(sft.REPO_ROOT / "configs" / "demo-lora.yaml"), *overrides],
                 sft.REPO_ROOT / "configs" / "default.yaml", "test")
    assert exit_.value.code == 2
    assert "model.adapter.type: qlora needs a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        sft.main(["--config", str(sft.REPO_ROOT / "configs" / "demo-lora.yaml"), "model.adapter.target_modules=[wq]"],
                 sft.REPO_ROOT / "configs" / "default.yaml", "test")
    assert exit_.value.code == 2
    assert "model.adapter.target_modules: 'wq' matches no module" in capsys.readouterr().err
