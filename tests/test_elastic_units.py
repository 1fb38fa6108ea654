"""The pieces of an elastic run that need no cluster: the global batch at each world size, the config rules,
the recovery record and the checkpoint triggers."""

from __future__ import annotations

import pytest

from pipelines.config import ConfigError, config_from_dict
from pipelines.stream.batch import batch_layout, rank_rows
from pipelines.train.metrics import recovery_record
from pipelines.train.trainer import scaling_config
from pipelines.train.triggers import CheckpointTriggers


def _raw(**sections) -> dict:
    raw = {"model": {"tokenizer": "demo://tokenizer"}, "data": {"datasets": [{"path": "x.jsonl"}]}}
    return {**raw, **sections}


@pytest.mark.parametrize("rows,world,shares", [(8, 1, [8]), (8, 2, [4, 4]), (8, 3, [3, 3, 2]), (2, 3, [1, 1, 0])])
def test_rank_rows_cuts_a_step_as_evenly_as_it_gets(rows, world, shares):
    assert rank_rows(rows, world) == shares and sum(shares) == rows


def test_the_global_batch_is_kept_and_the_accumulation_follows_the_world_size():
    cfg = config_from_dict(_raw(train={"micro_batch_size": 2, "gradient_accumulation_steps": 2},
                                scaling={"num_workers": [1, 4]}, run={"max_failures": -1}))
    # default: micro x accumulation x max workers = 16 rows, at every world size
    assert [(w, batch_layout(cfg.train, cfg.scaling, w).step_rows, batch_layout(cfg.train, cfg.scaling, w).grad_accum)
            for w in (1, 2, 3, 4)] == [(1, 16, 8), (2, 16, 4), (3, 16, 3), (4, 16, 2)]
    # a fixed-size run without global_batch_size: micro x accumulation rows per worker, at whatever world it runs
    plain = config_from_dict(_raw(train={"micro_batch_size": 2, "gradient_accumulation_steps": 3}))
    assert [(batch_layout(plain.train, plain.scaling, w).step_rows, batch_layout(plain.train, plain.scaling, w).grad_accum)
            for w in (1, 2)] == [(6, 3), (12, 3)]
    fixed = config_from_dict(_raw(train={"micro_batch_size": 2, "global_batch_size": 6}, scaling={"num_workers": 4}))
    assert batch_layout(fixed.train, fixed.scaling, 4).grad_accum == 1  # 2, 2, 1, 1 rows
    assert batch_layout(fixed.train, fixed.scaling, 1).grad_accum == 3


@pytest.mark.parametrize("sections,message", [
    ({"scaling": {"num_workers": [3, 2]}, "run": {"max_failures": -1}}, "1 <= min <= max"),
    ({"scaling": {"num_workers": [0, 2]}, "run": {"max_failures": -1}}, "1 <= min <= max"),
    ({"scaling": {"num_workers": [1, 2]}}, "run.max_failures=0 forbids any restart"),
    ({"train": {"global_batch_size": 8, "gradient_accumulation_steps": 2}}, "not both"),
    ({"train": {"global_batch_size": 3}, "scaling": {"num_workers": 4}}, "cannot give each of 4 workers"),
])
def test_elastic_config_mistakes_are_refused_naming_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_raw(**sections))


def test_num_workers_min_max_maps_to_an_elastic_ray_scaling_config():
    cfg = config_from_dict(_raw(scaling={"num_workers": [2, 4], "resize_check_s": 7}, run={"max_failures": -1}))
    sc = scaling_config(cfg)
    assert sc.elasticity_enabled and (sc.min_workers, sc.max_workers) == (2, 4)
    assert sc.elastic_resize_monitor_interval_s == 7
    same = config_from_dict(_raw(scaling={"num_workers": [3, 3]}))
    assert same.scaling.num_workers == 3 and not scaling_config(same).elasticity_enabled


def test_a_recovery_is_measured_from_the_last_logged_step_of_the_attempt_before():
    earlier = [{"kind": "params", "step": 0}, {"kind": "train", "step": 5, "time": 100.0},
               {"kind": "params", "step": 4}, {"kind": "train", "step": 6, "time": 130.0},
               {"kind": "train", "step": 7, "time": 131.5}]
    rec = recovery_record(earlier, "fit", 4, 2, 1, now=190.0)
    assert rec["steps_redone"] == 3 and rec["time_lost_s"] == 58.5 and rec["resized"]
    assert (rec["from_workers"], rec["to_workers"], rec["last_logged_step"]) == (2, 1, 7)
    # the attempt before logged nothing: no measure (not the one before it)
    assert recovery_record(earlier + [{"kind": "params", "step": 4}], "fit", 4, 2, 2, now=200.0) is None


def test_the_minutes_trigger_fires_once_per_interval(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("pipelines.train.triggers.time.monotonic", lambda: clock[0])
    t = CheckpointTriggers(every_minutes=0.5, rank=0, device=None, watch_preemption=False)
    clock[0] += 29
    assert t.due() is None
    clock[0] += 2
    assert "0.5 minutes" in t.due()
    t.checkpointed()
    clock[0] += 10
    assert t.due() is None
    assert CheckpointTriggers(None, 0, None, watch_preemption=False).due() is None
