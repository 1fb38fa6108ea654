"""The data-quality counters: one ``DataStats`` actor per process, one key per stream.

Proves: the streams one process builds (the feeder opens one per source and per epoch) report to a
single actor, which the process starts once; each stream's report holds its own counts only, equal to
the same stages run without Ray, also when the streams are read side by side; and a new Ray session
in the same process gets a new actor instead of the handle of the one that ended with the old session.
"""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import zip_longest

import pytest
from conftest import ALPACA, GPT2, LIMA, RAY_LOCAL_INIT, ROOT, make_config, needs_shared

from pipelines.stats import StatsSink
from pipelines.stream.dataset import build_dataset, data_report, stats_of
from pipelines.stream.stages import iter_packed_local

pytestmark = needs_shared


def _alive_stats_actors() -> set[str]:
    from ray._private import state

    return {a for a, info in state.actors().items() if info["State"] == "ALIVE" and info["ActorClassName"] == "DataStats"}


def _local_counters(cfg, **kwargs) -> dict[str, int]:
    sink = StatsSink()
    for _ in iter_packed_local(cfg, "train", sink, **kwargs):
        pass
    return dict(sink.local.counters)


def test_streams_of_one_process_share_one_stats_actor_and_keep_their_own_counts(ray_local):
    alpaca = make_config([{"path": str(ALPACA), "type": "alpaca"}], sequence_len=512)
    lima = make_config([{"path": str(LIMA), "type": "alpaca"}], sequence_len=1024)
    before = _alive_stats_actors()
    streams = [build_dataset(alpaca), build_dataset(lima)]
    # Read side by side: batches of both streams reach the actor interleaved.
    iters = [ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0) for ds in streams]
    rows = [0, 0]
    for batches in zip_longest(*iters):
        for i, batch in enumerate(batches):
            rows[i] += 0 if batch is None else batch.num_rows
    streams.append(build_dataset(alpaca, epoch=1))  # the next epoch's stream, opened after
    rows.append(streams[-1].count())
    started = _alive_stats_actors() - before
    assert len(started) <= 1, f"three streams of one process started {len(started)} DataStats actors"
    actors = {stats_of(ds).actor._actor_id.hex() for ds in streams}
    assert len(actors) == 1 and actors <= _alive_stats_actors()
    assert len({stats_of(ds).key for ds in streams}) == 3
    expected = [_local_counters(alpaca), _local_counters(lima), _local_counters(alpaca, epoch=1)]
    assert expected[0] != expected[1] and expected[0]["rows"] > 0 and expected[1]["rows"] > 0
    for ds, want, n_rows in zip(streams, expected, rows, strict=True):
        got = data_report(ds)["counters"]
        assert got == want
        assert got["rows"] == n_rows


_REINIT = """
import json, sys
sys.path.insert(0, {root!r})
import ray
from pipelines.config import config_from_dict
from pipelines.stream.dataset import build_dataset, data_report, stats_of
from pipelines.ray_local import init_local
cfg = config_from_dict({cfg!r})
out = []
for _ in range(2):  # a notebook that restarts Ray
    init_local(**{init!r})
    ds = build_dataset(cfg)
    out.append([ds.count(), data_report(ds)["counters"]["rows"], stats_of(ds).actor._actor_id.hex()])
    del ds
    ray.shutdown()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_a_new_ray_session_in_the_same_process_gets_a_new_stats_actor(tmp_path):
    cfg = {"model": {"tokenizer": str(GPT2)},
           "data": {"datasets": [{"path": str(ALPACA), "type": "alpaca"}], "sequence_len": 512}}
    script = _REINIT.format(root=str(ROOT), cfg=cfg, init=RAY_LOCAL_INIT)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (first, second) = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert first[0] == first[1] == second[0] == second[1] > 0
    assert first[2] != second[2]
