"""Checkpoints at an epoch boundary, through the feeder: a 2-epoch run cut right after the last step
of epoch 0 and right after the first step of epoch 1 trains every sample of both epochs once.

Regression: the state after an epoch's last (full) step used to say "epoch 0, not done, position at
the end"; the resumed feeder's first item was then the epoch-end item, the training loop saw an epoch
of 0 steps and stopped, and epoch 1 was never trained.
"""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest
import ray
from test_feeder import N_FILES, PER_FILE, _config, drive

from pipelines.stream.client import FeederClient
from pipelines.stream.feeder import start_feeder
from pipelines.stream.ledger import Ledger, sample_counts
from pipelines.stream.state import DataState

WORLD, K = 2, 3


def _epochs_of(feeder, start: int = 0):
    """Steps per epoch as a training loop sees them: (epoch, step, rows of each rank) per step item."""
    clients = [FeederClient(feeder, r, start) for r in range(WORLD)]
    out = []
    while (items := [c.next() for c in clients])[0] is not None:
        if items[0].kind == "step":
            out.append((items[0].epoch, items[0].step, [it.sample_ids() for it in items]))
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_local):
    """The data, and the 2-epoch run without a cut that both cuts are compared with."""
    tmp_path = tmp_path_factory.mktemp("epochs")
    cfg = _config(tmp_path)
    return tmp_path, cfg, _epochs_of(start_feeder(cfg, WORLD, WORLD * K, None, None, epochs=2))


@pytest.mark.parametrize("cut", ["last_step_of_epoch_0", "first_step_of_epoch_1"])
def test_checkpoint_at_an_epoch_boundary_resumes_into_the_next_epoch(uninterrupted, cut):
    tmp_path, cfg, full = uninterrupted
    per_epoch = [sum(1 for e, _, _ in full if e == epoch) for epoch in (0, 1)]
    assert per_epoch[0] > 5 and per_epoch[1] > 5
    at = per_epoch[0] + (cut == "first_step_of_epoch_1")
    root = str(tmp_path / f"ledger_{cut}")
    first = start_feeder(cfg, WORLD, WORLD * K, None, root, epochs=2)
    head, last = drive(first, WORLD, max_steps=at)  # the epoch-end item is not fetched yet
    state = ray.get(first.commit.remote(last))
    ray.kill(first)
    assert DataState.from_dict(state).next_epoch == 1  # the loop goes on with epoch 1, not an empty rest of epoch 0
    second = start_feeder(cfg, WORLD, WORLD * K, state, root, epochs=2)
    tail = _epochs_of(second)
    assert tail and tail[0][0] == 1 and tail[0][1] == at + 1  # first item: a step of epoch 1
    ray.get(second.commit.remote(len(tail)))  # the epoch-end item: every step into the ledger
    assert head + [ranks for _, _, ranks in tail] == [ranks for _, _, ranks in full]
    entries = Ledger(pafs.LocalFileSystem(), root).entries()
    assert [e.step for e in entries] == list(range(1, sum(per_epoch) + 1))
    for epoch in (0, 1):
        counts = sample_counts(e for e in entries if e.epoch == epoch)
        assert len(counts) == N_FILES * PER_FILE and set(counts.values()) == {1}, f"epoch {epoch}"
