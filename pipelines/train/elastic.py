"""Elastic worker groups: ``scaling.num_workers: [min, max]``.

Ray Train's elastic scaling policy does the placing: the group starts with as many workers as the cluster
can place (up to ``max``), a lost worker or node restarts it with those that can still be placed (no fewer
than ``min``), and while it runs Ray checks every ``scaling.resize_check_s`` whether more could be placed
and, if so, restarts it larger. Every restart resumes from the last checkpoint, so what this project adds
is what makes that restart lossless:

* the checkpoint loads at the new world size, optimizer state included (:mod:`pipelines.train.checkpoint`,
  DeepSpeed's universal checkpoint for ZeRO 1-3);
* a step takes the same global batch at every world size (:mod:`pipelines.stream.batch`), so the loss curve
  goes on as if nothing happened;
* the data position is the feeder's, independent of the world size, so every sample is trained exactly once;
* every restart is logged with what it cost (:func:`pipelines.train.metrics.recovery_record`).

Ray's policy waits without limit while fewer than ``min`` workers can be placed. :class:`MinWorkersTimeout`
bounds that wait by ``scaling.min_workers_timeout_s``: it runs in Ray Train's controller and fails the run
with an error that says what is missing. Nothing is recorded as trained that was not: the ledger holds the
checkpointed steps only.
"""

from __future__ import annotations

import time

from ray.train.v2._internal.execution.callback import ControllerCallback

# Controller states in which no worker group is training (Ray Train V2's controller state names).
WAITING_STATES = frozenset({"InitializingState", "SchedulingState", "ReschedulingState", "RestartingState"})


class MinWorkersTimeout(ControllerCallback):
    """Fail an elastic run that has had no training worker group for ``timeout_s`` seconds.

    A ``ControllerCallback`` (Ray Train's developer API): the controller calls
    ``after_controller_state_update`` on every iteration of its loop; an error raised here ends the run
    (a controller error is not retried).
    """

    def __init__(self, min_workers: int, timeout_s: float, resources_per_worker: dict[str, float]) -> None:
        self.min_workers, self.timeout_s, self.resources = min_workers, timeout_s, dict(resources_per_worker)
        self.since: float | None = None

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if type(current_state).__name__ not in WAITING_STATES:
            self.since = None
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif now - self.since > self.timeout_s:
            raise MinWorkersUnavailable(
                f"elastic run: fewer than scaling.num_workers' min of {self.min_workers} workers "
                f"({self.resources} each) could be placed for {self.timeout_s:.0f}s "
                "(scaling.min_workers_timeout_s); the run stops here. Its last checkpoint and ledger are "
                "intact: the same command resumes once the cluster has the resources.")


class MinWorkersUnavailable(RuntimeError):
    """An elastic run waited ``scaling.min_workers_timeout_s`` for its minimum number of workers."""
