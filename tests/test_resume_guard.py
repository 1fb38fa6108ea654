"""Resume never continues into a different stream unnoticed, never from a cut-off checkpoint, and never
reports "trained 0 steps" as a success.

The unit tests need no Ray: the stream fingerprint against the config changes that were measured to
lose and repeat samples (pack_buffer_size 64->32, sequence_len 512->256, another shuffle_seed), the
strict DataState reader, checkpoint completeness, the world-size guard and the run directory's
storage layer (on a moto S3 server on loopback).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from conftest import write_jsonl

from pipelines.config import config_from_dict
from pipelines.stream.ledger import Ledger
from pipelines.stream.resume import DataChangeError, resume_state
from pipelines.stream.resume import state_problem as data_state_problem
from pipelines.stream.spec import build_spec, fingerprint_changes, stream_fingerprint
from pipelines.stream.state import DATA_STATE_VERSION, DataState, DataStateError, SourceState
from pipelines.train.checkpoint import (
    MANIFEST,
    STATE_FILE,
    CheckpointError,
    SavedLayout,
    TrainerState,
    checkpoint_dir_name,
    newer_unregistered,
    newest_complete,
    saved_layout,
    unregistered,
)


def _cfg(tmp_path: Path, **data):
    d = tmp_path / "data"
    if not d.exists():
        d.mkdir()
        write_jsonl(d / "a.jsonl", [{"text": f"sample {i}"} for i in range(20)])
        write_jsonl(d / "b.jsonl", [{"text": f"other {i}"} for i in range(10)])
    raw = {"model": {"tokenizer": "demo://tokenizer"},
           "data": {"sequence_len": 512, "pack_buffer_size": 64, "shuffle_seed": 42,
                    "datasets": [{"path": str(d), "type": "completion"}], **data}}
    return config_from_dict(raw)


@pytest.mark.parametrize(("change", "key", "old", "new"), [
    ({"pack_buffer_size": 32}, "data.pack_buffer_size", 64, 32),
    ({"sequence_len": 256}, "data.sequence_len", 512, 256),
    ({"shuffle_seed": 7}, "data.shuffle_seed", 42, 7),
    ({"packing": "concat"}, "data.packing", "bfd", "concat"),
])
def test_fingerprint_names_each_measured_config_change(tmp_path, change, key, old, new):
    saved = stream_fingerprint(_cfg(tmp_path))
    changes = fingerprint_changes(saved, stream_fingerprint(_cfg(tmp_path, **change)))
    assert changes == [f"{key}: {old!r} -> {new!r}"]


def test_fingerprint_covers_files_tokenizer_and_weights_but_not_speed_knobs(tmp_path):
    base = stream_fingerprint(_cfg(tmp_path))
    # Speed and batch knobs do not change the stream: no change reported.
    same = _cfg(tmp_path, read_tasks=3, tokenize={"num_actors": 2, "batch_size": 7})
    assert fingerprint_changes(base, stream_fingerprint(same)) == []
    # A file that grew: the file listing changes.
    with open(tmp_path / "data" / "b.jsonl", "a") as f:
        f.write(json.dumps({"text": "appended"}) + "\n")
    assert [c.split(":")[0] for c in fingerprint_changes(base, stream_fingerprint(_cfg(tmp_path)))] == ["files"]
    # Another dataset type and weight are named by their dotted key.
    raw = _cfg(tmp_path).model_dump(mode="json")
    raw["data"]["datasets"][0].update(type="alpaca", weight=2.0)
    keys = {c.split(":")[0] for c in fingerprint_changes(stream_fingerprint(_cfg(tmp_path)),
                                                          stream_fingerprint(config_from_dict(raw)))}
    assert keys == {"data.datasets[0].type", "data.datasets[0].weight"}


def test_fingerprint_tokenizer_identity_and_chat_template(tmp_path):
    from pipelines.tokenize.tokenizer import resolve_tokenizer_path

    src = Path(resolve_tokenizer_path(_cfg(tmp_path).model))
    copy = tmp_path / "tok"
    copy.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    mine = _cfg(tmp_path).model_copy(deep=True)
    mine.model.tokenizer = str(copy)
    before = stream_fingerprint(mine)
    conf = json.loads((copy / "tokenizer_config.json").read_text())
    conf["chat_template"] = "{{ messages }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(conf))
    keys = {c.split(":")[0] for c in fingerprint_changes(before, stream_fingerprint(mine))}
    assert "chat_template" in keys


def test_data_state_round_trip_and_strict_reading():
    state = DataState(1, 12, [SourceState(passes=1, tokens=99, samples=5)], fingerprint={"data.x": 1})
    d = state.to_dict()
    assert d["version"] == DATA_STATE_VERSION
    assert DataState.from_dict(json.loads(json.dumps(d))) == state
    assert DataState.from_dict(None) is None and DataState.from_dict({}) is None  # no checkpoint: fresh
    for broken, match in [({**d, "version": 0}, "version 0"), ({k: v for k, v in d.items() if k != "version"}, "version"),
                          ({**d, "sources": [{"point": {}}]}, "cannot be read"), ({"epoch": 1}, "version"),
                          ({**d, "step": None}, "cannot be read")]:
        with pytest.raises(DataStateError, match=match):
            DataState.from_dict(broken)


def test_data_state_problem_and_restart_opt_in(tmp_path):
    cfg = _cfg(tmp_path)
    fp = stream_fingerprint(cfg)
    saved = DataState(0, 4, [SourceState()], fingerprint=fp).to_dict()
    assert data_state_problem(saved, 4, fp) is None
    fp2 = stream_fingerprint(_cfg(tmp_path, sequence_len=256))
    assert "data.sequence_len: 512 -> 256" in data_state_problem(saved, 4, fp2)
    assert "no data position" in data_state_problem({}, 4, fp)  # a checkpoint without one: refused
    assert "version" in data_state_problem({**saved, "version": 99}, 4, fp)
    assert "no fingerprint" in data_state_problem({**saved, "fingerprint": {}}, 4, fp)

    spec2 = build_spec(_cfg(tmp_path, sequence_len=256))
    with pytest.raises(DataChangeError, match="data.sequence_len: 512 -> 256"):
        resume_state(saved, 4, 1, spec2, "fail", "step 4")
    restarted = resume_state(saved, 4, 1, spec2, "restart", "step 4")
    state = restarted.state
    assert (state.epoch, state.step, state.epoch_done, state.sources) == (0, 4, True, [])
    assert restarted.kind == "restart" and "sequence_len" in restarted.changes[0]


def _fake_checkpoint(root: Path, step: int) -> Path:
    d = root / checkpoint_dir_name(step)
    (d / "deepspeed" / f"step_{step}").mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"step": step}))
    (d / "deepspeed" / f"step_{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x" * (100 + step))
    files = {str(p.relative_to(d)): p.stat().st_size for p in d.rglob("*") if p.is_file()}
    (d / MANIFEST).write_text(json.dumps({"files": files, "world_size": 2, "zero_stage": 2}))
    return d


def test_a_complete_checkpoint_ray_never_registered_is_resumed_from(tmp_path, caplog):
    older, newest = _fake_checkpoint(tmp_path, 2), _fake_checkpoint(tmp_path, 4)
    for d in (older, newest):
        (d / STATE_FILE).write_text(json.dumps({"step": int(d.name[-2:]), "fit_id": "a"}))
        manifest = json.loads((d / MANIFEST).read_text())
        manifest["files"][STATE_FILE] = (d / STATE_FILE).stat().st_size
        (d / MANIFEST).write_text(json.dumps(manifest))
    assert unregistered(str(tmp_path), "auto", "b").path == str(newest)
    assert "not registered with Ray Train" in caplog.text
    (newest / "deepspeed" / "step_4" / "mp_rank_00_model_states.pt").unlink()  # its copy was cut off
    assert unregistered(str(tmp_path), "auto", "b").path == str(older)
    assert unregistered(str(tmp_path), "never", "a").path == str(older)  # this fit's own: a restart resumes
    assert unregistered(str(tmp_path), "never", "b") is None  # an earlier fit's, under run.resume=never
    assert unregistered(str(tmp_path), "/some/checkpoint", "b") is None  # a path to start from: only its own
    assert unregistered(str(tmp_path), "/some/checkpoint", "a").path == str(older)
    assert unregistered(str(tmp_path / "other"), "auto", "b") is None


def test_cut_off_checkpoint_is_never_picked(tmp_path, caplog):
    fs = pafs.LocalFileSystem()
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    assert newest_complete(fs, str(newest)) == str(newest)
    (newest / "deepspeed" / "step_4" / "mp_rank_00_model_states.pt").unlink()  # the write was cut off
    assert newest_complete(fs, str(newest)) == str(tmp_path / checkpoint_dir_name(2))
    assert "checkpoint_00000004 is incomplete" in caplog.text
    (tmp_path / checkpoint_dir_name(2) / STATE_FILE).write_text("{}")  # truncated: another size
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        newest_complete(fs, str(newest))
    (newest / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="manifest.json"):
        newest_complete(fs, str(newest))


def test_a_complete_checkpoint_ray_did_not_register_is_resumed_from(tmp_path, caplog):
    """A worker killed right after writing checkpoint 16 can die before Ray Train registers it, so
    get_checkpoint() names 8: the newer complete one is taken, an incomplete newer one is not."""
    fs = pafs.LocalFileSystem()
    registered = _fake_checkpoint(tmp_path, 8)
    assert newer_unregistered(fs, str(registered)) == str(registered)  # nothing newer
    newer = _fake_checkpoint(tmp_path, 16)
    assert newer_unregistered(fs, str(registered)) == str(newer)
    assert "checkpoint_00000016 is complete but not registered" in caplog.text
    cut = _fake_checkpoint(tmp_path, 24)
    (cut / MANIFEST).unlink()  # its write was cut off
    assert newer_unregistered(fs, str(registered)) == str(newer)
    assert newer_unregistered(fs, str(newer)) == str(newer)


def test_zero_steps_while_steps_remain_is_an_error(monkeypatch, tmp_path):
    """The loop's stopping rule alone (no Ray): an empty epoch before max_steps raises."""
    from types import SimpleNamespace

    import pipelines.train.loop as loop
    from pipelines.config import AdapterConfig
    from pipelines.train.adapter import ParamCount

    cfg = _cfg(tmp_path).model_copy(deep=True)
    cfg.train.max_steps, cfg.run.storage_path = 8, str(tmp_path / "runs")
    te = SimpleNamespace(rank=0, world_size=1, device=None, collate_fn=lambda: None,
                         params=ParamCount(10, 10), adapter=AdapterConfig())
    shard = SimpleNamespace(iter_torch_batches=lambda **kw: iter(()))
    monkeypatch.setattr(loop, "train_step", lambda te, source: None)
    worker = loop.WorkerLoop(cfg, te, TrainerState(step=4, fit_id="f"), shard)
    with pytest.raises(loop.NoTrainingData, match="train.max_steps=8"):
        worker.run()


def test_a_zero_checkpoint_at_another_world_size_takes_the_universal_path(tmp_path):
    fs = pafs.LocalFileSystem()
    d = _fake_checkpoint(tmp_path, 4)  # saved by 2 workers with ZeRO-2
    layout = saved_layout(fs, str(d))
    assert layout == SavedLayout(2, 2)
    assert not layout.needs_universal(2) and layout.needs_universal(1) and layout.needs_universal(3)
    manifest = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**manifest, "zero_stage": 0}))
    assert not saved_layout(fs, str(d)).needs_universal(1)  # ZeRO-0: every rank holds everything


def test_run_dir_on_s3_uses_the_one_storage_layer(moto_s3, tmp_path):
    """Ray Train gets a bare ``bucket/key`` path with the endpoint's filesystem (a URL together with a
    filesystem raised ``ArrowInvalid: Expected an S3 object path``); outputs and the ledger land there."""
    from pipelines.storage import StorageOptions
    from pipelines.train.storage import OutputDir, ray_storage, run_dir

    moto_s3.make_bucket("runs")
    cfg = _cfg(tmp_path).model_copy(deep=True)
    cfg.run.storage_path, cfg.run.name = "s3://runs/exp/", "r"
    cfg.storage.endpoint_url = moto_s3.endpoint
    path, fs = ray_storage(cfg)
    assert path == "runs/exp" and isinstance(fs, pafs.S3FileSystem)
    fs.create_dir(f"{path}/probe")  # the endpoint (with its http scheme) is honoured
    assert run_dir(cfg) == "s3://runs/exp/r"
    out = OutputDir(run_dir(cfg), StorageOptions.from_config(cfg.storage))
    (Path(out.local) / "metrics.jsonl").write_text('{"step": 1}\n')
    out.sync()
    Ledger(fs, "runs/exp/r/ledger").mark_restart(3, "test")
    s3 = moto_s3.fs()
    with s3.open_input_stream("runs/exp/r/metrics.jsonl") as f:
        assert f.read() == b'{"step": 1}\n'
    assert Ledger(s3, "runs/exp/r/ledger").restarts() == [{"after_step": 3, "reason": "test"}]
    cfg.run.storage_path = str(tmp_path / "runs")
    assert ray_storage(cfg) == (str(tmp_path / "runs"), None)
