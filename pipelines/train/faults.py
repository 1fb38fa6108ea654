"""Fault injection for resilience tests: fail a worker after given optimizer steps, once each.

Set ``PIPELINES_FAULTS`` in the workers' environment to a comma list of ``step:how``, where ``how``
is ``raise`` (an exception, which Ray Train's ``FailureConfig`` handles) or ``kill`` (``SIGKILL`` of
the worker process itself, as the OOM killer or a lost node would). The last rank fails, after the
step and before any checkpoint of it, so the step is undone by the restore. Example::

    PIPELINES_FAULTS="12:raise,24:kill"

Each fault fires once per run directory (a marker file records it), so the restored run goes past it.

``slow:<seconds>`` makes every rank wait that long after each step: a slow cluster, whose run lasts long
enough for a test's chaos to act on nodes mid-run (a tiny model's step takes a fraction of a second)::

    PIPELINES_FAULTS="slow:0.5"
"""

from __future__ import annotations

import os
import signal
import time

ENV = "PIPELINES_FAULTS"


def parse(spec: str) -> tuple[dict[int, str], float]:
    """``"12:raise,24:kill,slow:0.5"`` -> ``({12: "raise", 24: "kill"}, 0.5)``: the faults by step and the
    wait after each step."""
    out: dict[int, str] = {}
    slow = 0.0
    for part in filter(None, (p.strip() for p in spec.split(","))):
        step, _, how = part.partition(":")
        if step == "slow":
            try:
                slow = float(how)
            except ValueError:
                slow = -1.0
            if slow < 0:
                raise ValueError(f"{ENV}: {part!r} should be slow:<seconds>, e.g. slow:0.5")
            continue
        if how not in ("raise", "kill") or not step.isdigit():
            raise ValueError(f"{ENV}: {part!r} should be <step>:raise, <step>:kill or slow:<seconds>")
        out[int(step)] = how
    return out, slow


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


def maybe_fail(step: int, rank: int, world: int, marker_dir: str) -> None:
    """Fail now if a fault is planned for ``step`` on this rank and has not fired in this run yet; then wait
    the ``slow:`` time, if any."""
    faults, slow = parse(os.environ.get(ENV, ""))
    if slow:
        time.sleep(slow)
    planned = faults.get(step)
    if planned is None or rank != world - 1:
        return
    os.makedirs(marker_dir, exist_ok=True)
    marker = os.path.join(marker_dir, f"fault_step_{step}")
    if os.path.exists(marker):
        return
    with open(marker, "w") as f:
        f.write(planned)
    if planned == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault after step {step} on rank {rank}")
