"""``run.on_data_change: continue`` through the feeder (no training): datasets added, removed or reweighted
between two runs keep every unchanged source exactly once, and anything else is refused.

Each case runs a first feeder to a mid-epoch checkpoint, then a second one on the changed config that
resumes from it (what rank 0 does after a restart), both writing one ledger; ``mix_exhausted: drop``
(the default), so an epoch holds every sample of every source once. Sample ids are mapped back to their
record's text through each run's own listing, so the check does not assume the ids kept their meaning.
"""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest
import ray
from conftest import make_config, needs_shared, write_jsonl
from test_feeder import drive

from pipelines.sources.listing import split_sample_id
from pipelines.stream.feeder import start_feeder
from pipelines.stream.ledger import Ledger
from pipelines.stream.resume import DataChangeError, resume_state
from pipelines.stream.spec import build_spec

pytestmark = needs_shared  # the GPT-2 tokenizer of ../shared/data

SIZES = {"a": 240, "b": 160, "c": 200}
WORLD, K = 2, 2


def _write(tmp_path, name: str, n: int) -> str:
    path = tmp_path / f"{name}.jsonl"
    if not path.exists():  # each record's text is unique: "<dataset> <row> ..."
        write_jsonl(path, [{"text": f"{name}{i} " + "w " * (4 + (i * 7) % 30)} for i in range(n)])
    return str(path)


def _cfg(tmp_path, weights: dict[str, float], **data):
    datasets = [{"path": _write(tmp_path, name, SIZES[name]), "type": "completion", "weight": w}
                for name, w in weights.items()]
    data.setdefault("pack_buffer_size", 40)
    data.setdefault("sequence_len", 96)
    return make_config(datasets, shuffle_seed=3, **data)


def _texts(cfg) -> list[list[str]]:
    """The record texts of each file of the config's listing (index = file index in sample ids)."""
    return [[json.loads(line)["text"] for line in open(f.path, encoding="utf-8")] for f in build_spec(cfg).table.files]


def _trained(steps, texts) -> list[str]:
    """The dataset name of every sample the steps trained on, each as its record's first word."""
    out = []
    for step in steps:
        for rank in step:
            for row in rank:
                for sid in row:
                    file, r = split_sample_id(sid)
                    out.append(texts[file][r].split()[0])
    return out


def _two_runs(tmp_path, before: dict, after: dict, at_step: int, **data):
    """The first run to step ``at_step`` (committed), then the changed one to the end of the epoch."""
    root = str(tmp_path / "ledger")
    cfg1, cfg2 = _cfg(tmp_path, before, **data), _cfg(tmp_path, after, **data)
    first = start_feeder(cfg1, WORLD, WORLD * K, None, root)
    head, last = drive(first, WORLD, max_steps=at_step)
    saved = ray.get(first.commit.remote(last))
    ray.kill(first)
    second = start_feeder(cfg2, WORLD, WORLD * K, None, root)
    resumed = ray.get(second.resume.remote(saved, at_step, 0, "continue", f"step {at_step}"))
    tail, last2 = drive(second, WORLD)
    ray.get(second.commit.remote(last2))
    ledger = Ledger(pafs.LocalFileSystem(), root)
    return _trained(head, _texts(cfg1)), _trained(tail, _texts(cfg2)), resumed, ledger, (head, tail)


def _all(name: str) -> list[str]:
    return [f"{name}{i}" for i in range(SIZES[name])]


def test_an_added_dataset_starts_at_its_beginning_and_the_others_go_on_exactly_once(tmp_path, ray_local):
    head, tail, resumed, ledger, (h, t) = _two_runs(tmp_path, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, 12)
    trained = head + tail
    for name in "abc":  # every sample of every source, once (drop: the epoch runs until all are out)
        got = sorted(x for x in trained if x.rstrip("0123456789") == name)
        assert got == sorted(_all(name)), name
    assert not any(x.startswith("c") for x in head) and any(x.startswith("c") for x in tail[:20])
    assert resumed.kind == "continue" and any("added" in line for line in resumed.changes)
    # the ledger: every committed step once, and the change marked at the resume step with its listing
    assert [e.step for e in ledger.entries()] == list(range(1, len(h) + len(t) + 1))
    (change,) = ledger.changes()
    assert change["after_step"] == 12 and any("c.jsonl" in line and "added" in line for line in change["changes"])
    assert [u.rsplit("/", 1)[-1] for u in change["files"]] == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_a_removed_dataset_stops_and_the_others_go_on_exactly_once(tmp_path, ray_local):
    head, tail, resumed, _, _ = _two_runs(tmp_path, {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 1.0}, 12)
    for name in "ab":
        got = sorted(x for x in head + tail if x.rstrip("0123456789") == name)
        assert got == sorted(_all(name)), name
    c_head = [x for x in head if x.startswith("c")]
    assert c_head and len(set(c_head)) == len(c_head)  # c trained before the change, once each
    assert not any(x.startswith("c") for x in tail)  # and never after it
    assert any("removed" in line for line in resumed.changes)


def test_new_weights_apply_from_the_resume_step(tmp_path, ray_local):
    """a:b 1:1, then 1:3 at step 10: from there b takes ~3/4 of the tokens (until a source runs out), and each
    source still goes on exactly once."""
    head, tail, resumed, _, (_, steps) = _two_runs(tmp_path, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 3.0}, 10)
    for name in "ab":
        assert sorted(x for x in head + tail if x.rstrip("0123456789") == name) == sorted(_all(name)), name
    assert any("weight" in line for line in resumed.changes)
    def share_b(samples: list[str]) -> float:  # of the tokens (~ words: "<name><i>" + 4 + (7 i) % 30 words)
        words = {x: 5 + (int(x[1:]) * 7) % 30 for x in samples}
        return sum(words[x] for x in samples if x.startswith("b")) / sum(words.values())

    # From the first rows after the change (counters start from zero; kept, b would first catch up alone)
    assert 0.65 < share_b(tail[:40]) < 0.85, share_b(tail[:40])
    assert 0.65 < share_b(tail[:120]) < 0.85, share_b(tail[:120])  # before b (160 samples) can run out
    assert 0.4 < share_b(head) < 0.6, share_b(head)


def test_continue_refuses_a_changed_source_or_another_change(tmp_path, ray_local):
    root = str(tmp_path / "ledger")
    cfg = _cfg(tmp_path, {"a": 1.0, "b": 1.0})
    first = start_feeder(cfg, WORLD, WORLD * K, None, root)
    _, last = drive(first, WORLD, max_steps=5)
    saved = ray.get(first.commit.remote(last))
    ray.kill(first)
    # another sequence_len is not a change of the mix: refused, naming it (the decision the feeder applies,
    # taken here on the new run's spec as the driver takes it before any worker starts)
    with pytest.raises(DataChangeError, match=r"data.sequence_len: 96 -> 128"):
        resume_state(saved, 5, 0, build_spec(_cfg(tmp_path, {"a": 1.0, "b": 1.0}, sequence_len=128)), "continue",
                     "step 5")
    # a record appended to a's file: a is not the stream it was (through the feeder of the resumed run)
    with open(tmp_path / "a.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "a-late w w w"}) + "\n")
    grown = start_feeder(_cfg(tmp_path, {"a": 1.0, "b": 1.0}), WORLD, WORLD * K, None, root)
    with pytest.raises(DataChangeError, match="source '.*a.jsonl' is not the stream it was"):
        ray.get(grown.resume.remote(saved, 5, 0, "continue", "step 5"))
    # under fail (the default) an added dataset is refused too, naming it
    with pytest.raises(DataChangeError, match=r"data.datasets\[1\].path"):
        resume_state(saved, 5, 0, build_spec(_cfg(tmp_path, {"b": 1.0, "c": 1.0})), "fail", "step 5")
    assert Ledger(pafs.LocalFileSystem(), root).changes() == []


def test_a_file_added_mid_run_waits_for_the_next_run_which_applies_on_data_change(tmp_path, ray_local):
    """The spec is the run's: a file that appears under the prefix while the run goes on (a worker group
    restarted from the spec streams the files the run started with) is seen by the next run's spec, whose
    resume refuses it (fail) or restarts the data (restart)."""
    d = tmp_path / "prefix"
    d.mkdir()
    for k in range(2):
        write_jsonl(d / f"part-{k}.jsonl", [{"text": f"p{k}_{i} " + "w " * 6} for i in range(60)])
    cfg = make_config([{"path": str(d), "type": "completion"}], sequence_len=96, pack_buffer_size=20)
    spec = build_spec(cfg)
    first = start_feeder(spec, WORLD, WORLD * K, None, None, 1)
    _, last = drive(first, WORLD, max_steps=4)
    saved = ray.get(first.commit.remote(last))
    ray.kill(first)
    write_jsonl(d / "part-2.jsonl", [{"text": f"late_{i} w w" } for i in range(60)])  # lands mid-run
    again = start_feeder(spec, WORLD, WORLD * K, saved, None, 1)  # the run's restarted worker group: its own spec
    rest, _ = drive(again, WORLD)
    files = {split_sample_id(s)[0] for step in rest for rank in step for row in rank for s in row}
    assert files <= {0, 1} and len(spec.table.files) == 2  # the new file is not in this run
    later = build_spec(cfg)  # the next run lists it
    assert len(later.table.files) == 3
    with pytest.raises(DataChangeError, match="files: '2 files"):
        resume_state(saved, 4, 0, later, "fail", "step 4")
    root = str(tmp_path / "ledger")
    feeder = start_feeder(later, WORLD, WORLD * K, None, root, 1)
    restarted = ray.get(feeder.resume.remote(saved, 4, 0, "restart", "step 4"))
    assert restarted.kind == "restart" and restarted.state.next_epoch == 0 and restarted.state.sources == []
    (mark,) = Ledger(pafs.LocalFileSystem(), root).restarts()
    assert mark["after_step"] == 4 and "files: '2 files" in mark["reason"]
    steps, _ = drive(feeder, WORLD)  # the whole epoch again, the new file in it
    files = {split_sample_id(s)[0] for step in steps for rank in step for row in rank for s in row}
    assert files == {0, 1, 2}
