"""The feeder delivers exactly the rows per rank per step recorded from the feeder before its
columnar rewrite (tests/fixtures/feeder_ledger.json; re-record with
tests/fixtures/record_feeder_ledger.py, see its docstring)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import needs_shared

FIXTURES = Path(__file__).parent / "fixtures"


def _recorder():
    spec = importlib.util.spec_from_file_location("record_feeder_ledger", FIXTURES / "record_feeder_ledger.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # end to end through Ray Data on real data: the full suite runs it, the fast tier does not
@needs_shared
@pytest.mark.timeout(600)
def test_feeder_delivers_the_recorded_rows_per_rank_per_step(ray_local):
    rec = _recorder()
    expected = json.loads((FIXTURES / "feeder_ledger.json").read_text())
    assert expected["rows_per_rank"] == rec.ROWS_PER_RANK
    cfg = rec.fixture_config()
    for world, steps in expected["world_sizes"].items():
        assert len(steps) > 100  # a long stream: both sources, many blocks, many mixing switches
        got = rec.record_world(cfg, int(world))
        assert len(got) == len(steps), f"world {world}: {len(got)} steps, recorded {len(steps)}"
        for s, (a, b) in enumerate(zip(got, steps, strict=True)):
            assert a == b, f"world {world}, step {s + 1}: rows per rank {a} != recorded {b}"
