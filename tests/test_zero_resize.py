"""A ZeRO-2 / ZeRO-3 checkpoint resumed with another number of workers (2 -> 1, 1 -> 2).

DeepSpeed refuses a partitioned checkpoint at another data-parallel world size ("The checkpoint
being loaded used a DP world size of 2 but the current world size is 1"); the checkpoint layer
converts it to DeepSpeed's universal format on load. Checked together with the data side: the
ledger across the change holds every sample exactly once, and the resumed run's first loss
continues the curve (the optimizer state came back, not a fresh one).
"""

from __future__ import annotations

import json

import pytest
from test_exactly_once_train import _assert_exactly_once, _config, _fit, _ledger

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize(("stage", "before", "after"), [("zero2", 2, 1), ("zero3", 1, 2)])
def test_zero_checkpoint_resumes_with_another_world_size(ray_local, tmp_path, stage, before, after):
    name = f"{stage}_{before}_{after}"
    _fit(_config(tmp_path, name, before, deepspeed=stage, max_steps=6 if before == 2 else 12))
    head = _ledger(tmp_path, name)
    assert [e.step for e in head] == list(range(1, len(head) + 1)) and len(head) >= 6
    result = _fit(_config(tmp_path, name, after, deepspeed=stage))
    assert result.error is None
    entries = _ledger(tmp_path, name)
    _assert_exactly_once(entries)
    assert {len(e.ranks) for e in entries} == {before, after}
    records = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "resume"] == [len(head)]
