"""Checkpoints besides every ``train.checkpoint_every_steps``: every ``train.checkpoint_every_minutes``, and at
once on a preemption notice.

A preemption notice comes through Ray: a node that is about to go is *drained* with a deadline, by the
autoscaler on a spot reclaim or, on Kubernetes, by the worker pod's ``preStop`` hook, which turns the pod's
SIGTERM into ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N``
(``cluster/kuberay/rayjob-elastic.yaml``). Ray Train's preemption watcher polls the drains and tells every
worker (``ray.train.get_preemption_info()``); the loop writes a checkpoint at the next step and logs that it
did. Training goes on until the node goes (or Ray Train stops the group at the deadline), and the restarted
group resumes from that checkpoint, so a reclaim with notice loses at most the steps after it.

Both triggers are decided collectively, after every step: rank 0's clock says whether the minutes are up and
whether to ask Ray about preemption (every ``POLL_S`` seconds; the call is a barrier every rank must make
equally often), and one small all_reduce carries that to every rank::

    step 41 -> due() -> None
    step 42 -> due() -> "preemption notice: node 5c1f.. (ranks [1]) goes in 88s"  -> checkpoint now
"""

from __future__ import annotations

import time
from typing import Any

POLL_S = 2.0  # how often rank 0 has every rank ask Ray Train about preemption (a barrier; Ray's watcher polls every 5 s)


class CheckpointTriggers:
    """The unscheduled checkpoints of one worker; every rank calls :meth:`due` after every step."""

    def __init__(self, every_minutes: float | None, rank: int, device: Any, watch_preemption: bool = True) -> None:
        self.every_s = every_minutes * 60.0 if every_minutes else None
        self.rank, self.device, self.watch = rank, device, watch_preemption
        self.last_checkpoint = self.last_poll = time.monotonic()
        self.noticed: set[str] = set()  # preempted nodes already checkpointed for

    def due(self) -> str | None:
        """Why to checkpoint now (the same answer on every rank), or ``None``. Collective."""
        from pipelines.train.step import all_reduce_sum

        now = time.monotonic()
        minutes = poll = 0.0
        if self.rank == 0:
            minutes = float(self.every_s is not None and now - self.last_checkpoint >= self.every_s)
            poll = float(self.watch and now - self.last_poll >= POLL_S)
        minutes, poll = all_reduce_sum([minutes, poll], self.device)
        if poll:
            self.last_poll = now
            notice = self._preemption()
            if notice is not None:
                return notice
        if minutes:
            return f"{self.every_s / 60:g} minutes since the last checkpoint (train.checkpoint_every_minutes)"
        return None

    def checkpointed(self) -> None:
        self.last_checkpoint = time.monotonic()

    def _preemption(self) -> str | None:
        import ray.train

        info = ray.train.get_preemption_info()  # a barrier: every rank calls it here, equally often
        if info is None or set(info.preempted_node_ids) <= self.noticed:
            return None
        self.noticed |= set(info.preempted_node_ids)
        nodes = ", ".join(f"{n[:8]}.. (ranks {r})" for n, r in sorted(info.preempted_node_to_ranks.items()))
        left = f" goes in {max(0.0, info.deadline_ms / 1000 - time.time()):.0f}s" if info.deadline_ms else ""
        return f"preemption notice: node {nodes}{left}"
