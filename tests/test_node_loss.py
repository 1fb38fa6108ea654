"""Node loss, not just process loss: a loopback multi-node Ray cluster loses nodes mid-epoch.

One child process (tests/node_loss_cluster.py) starts a Ray cluster (a head, a CPU-only tokenizer node and two
training nodes, all raylets on 127.0.0.1) and runs every scenario on it, one after another, replacing the
nodes each lost; it is the last of the jobs that run beside the in-process tests (``node_loss_runs`` in
conftest.py), and each test here reads its scenario's outcome, metrics and ledger. All train the tiny Llama of
tests/test_exactly_once_train.py on its 600 samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import NodeLossRuns
from test_exactly_once_train import _assert_exactly_once, _ledger

from pipelines.stream.ledger import sample_counts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture
def run(node_loss_runs: NodeLossRuns):
    """``run(scenario)``: that scenario's result, its chaos plan carried out."""

    def get(scenario: str) -> dict:
        assert scenario in node_loss_runs.results, node_loss_runs.output[-4000:]
        res = node_loss_runs.results[scenario]
        assert res["chaos_error"] is None, res["chaos_error"]
        return res

    return get


@pytest.fixture
def tmp(node_loss_runs: NodeLossRuns) -> Path:
    return node_loss_runs.tmp


def _metrics(tmp: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _checkpoint_steps(tmp: Path, name: str) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (tmp / "runs" / name).glob("checkpoint_*") if p.is_dir())


def test_losing_a_training_node_then_the_tokenizer_node_completes_exactly_once(run, tmp):
    res = run("recover")
    assert res["ok"], res
    placed, first, seen, second = (e for e in res["events"] if "added" not in e)
    assert [e["added"] for e in res["events"] if "added" in e] == [first["killed"] + "'", "cpu'"]
    # Two workers on two nodes; the data feeder on rank 0's node, which is the one lost first.
    assert placed["train_worker_nodes"] == ["train-a", "train-b"], placed
    assert first["killed"] in placed["feeder_node"] and first["killed"].startswith("train"), (placed, first)
    assert seen["tokenizer_nodes"] == ["cpu"], seen  # the restored stream's tokenizer, on the CPU node
    assert second["killed"] == "cpu"
    entries = _ledger(tmp, res["name"])
    assert 4 <= first["ledger_steps"] < len(entries), (res["events"], len(entries))  # mid-epoch
    _assert_exactly_once(entries)
    metrics = _metrics(tmp, res["name"])
    resumes = [r["step"] for r in metrics if r["kind"] == "resume"]
    assert resumes and 2 <= resumes[0] <= first["ledger_steps"], resumes  # restored from a checkpoint
    assert [r for r in metrics if r["kind"] == "summary"][-1]["step"] == len(entries)


def test_node_loss_without_max_failures_fails_clearly_and_records_only_trained_steps(run, tmp):
    res = run("fail")
    assert not res["ok"], res
    assert "died" in res["error"].lower() or "node" in res["error"].lower(), res["error"]
    entries = _ledger(tmp, res["name"])
    ckpts = _checkpoint_steps(tmp, res["name"])
    # The ledger holds the steps of the last saved checkpoint, or (written ahead) of the one being saved
    # when the node died (checkpoint_every_steps 2); steps trained after that are not in it.
    steps = [e.step for e in entries]
    assert entries and steps in (list(range(1, ckpts[-1] + 1)), list(range(1, ckpts[-1] + 3))), (ckpts, steps)
    assert set(sample_counts(entries).values()) == {1}


def _step_losses(tmp: Path, name: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in _metrics(tmp, name):
        if r["kind"] == "train":
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def test_an_elastic_run_shrinks_to_one_worker_and_grows_back_exactly_once_on_the_same_loss_curve(run, tmp):
    res = run("elastic")
    assert res["ok"], res
    events = {k: e for e in res["events"] for k in e}
    assert events["train_worker_nodes"]["train_worker_nodes"] == ["train-a", "train-b"], res["events"]
    assert "shrunk_to" in events and "grown_to" in events, res["events"]
    entries = _ledger(tmp, res["name"])
    _assert_exactly_once(entries)
    metrics = _metrics(tmp, res["name"])
    resumes = [(r["saved_world_size"], r["world_size"]) for r in metrics if r["kind"] == "resume"]
    assert (2, 1) in resumes and (1, 2) in resumes, resumes
    summary = [r for r in metrics if r["kind"] == "summary"][-1]
    assert summary["step"] == len(entries) and summary["world_size"] == 2
    sizes = [(r["from_workers"], r["to_workers"]) for r in summary["recoveries"]]
    assert sizes == [(2, 1), (1, 2)], summary["recoveries"]
    assert all(r["resized"] and r["time_lost_s"] > 0 and r["steps_redone"] >= 0 for r in summary["recoveries"])
    # The same global batch at 1 and 2 workers: every step's loss (redone steps too) follows the fixed
    # 2-worker run's (recover: the same settings; restored at its own world size, it trains each step as an
    # uninterrupted run does, which tests/test_exactly_once_train.py checks), to reduction order.
    elastic, reference = _step_losses(tmp, res["name"]), _step_losses(tmp, "nodeloss_recover")
    assert sorted(elastic) == sorted(reference) == list(range(1, len(entries) + 1))
    for step, losses in elastic.items():
        assert losses == pytest.approx([reference[step][0]] * len(losses), rel=1e-4), step


def test_an_elastic_run_below_its_min_workers_fails_after_the_timeout_recording_only_trained_steps(run, tmp):
    res = run("min_workers")
    assert not res["ok"], res
    assert "scaling.min_workers_timeout_s" in res["error"] and "min of 2 workers" in res["error"], res["error"]
    entries = _ledger(tmp, res["name"])
    ckpts = _checkpoint_steps(tmp, res["name"])
    steps = [e.step for e in entries]
    assert entries and steps in (list(range(1, ckpts[-1] + 1)), list(range(1, ckpts[-1] + 3))), (ckpts, steps)
    assert set(sample_counts(entries).values()) == {1}


def test_a_preemption_notice_writes_a_checkpoint_that_the_restarted_run_resumes_from(run, tmp):
    res = run("preempt")
    assert res["ok"], res
    events = {k: e for e in res["events"] for k in e}
    noticed = events["noticed"]["noticed"]
    assert noticed >= events["drained"]["at_step"] >= 3, res["events"]
    assert noticed in _checkpoint_steps(tmp, res["name"])  # kept: only the final checkpoint came after it
    metrics = _metrics(tmp, res["name"])
    notices = [r for r in metrics if r["kind"] == "checkpoint"]
    assert [r["step"] for r in notices] == [noticed] and "preemption notice" in notices[0]["reason"], notices
    resumes = [(r["step"], r["saved_world_size"], r["world_size"]) for r in metrics if r["kind"] == "resume"]
    assert resumes == [(noticed, 2, 1)], resumes  # no periodic checkpoints: only the notice's could be resumed
    entries = _ledger(tmp, res["name"])
    _assert_exactly_once(entries)
