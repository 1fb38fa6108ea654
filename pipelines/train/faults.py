"""Fault injection for resilience tests: fail a worker after given optimizer steps, once each.

Set ``PIPELINES_FAULTS`` in the workers' environment to a comma list of ``step:how``, where ``how``
is ``raise`` (an exception, which Ray Train's ``FailureConfig`` handles) or ``kill`` (``SIGKILL`` of
the worker process itself, as the OOM killer or a lost node would). The last rank fails, after the
step and before any checkpoint of it, so the step is undone by the restore. Example::

    PIPELINES_FAULTS="12:raise,24:kill"

Each fault fires once per run directory (a marker file records it), so the restored run goes past it.
"""

from __future__ import annotations

import os
import signal

ENV = "PIPELINES_FAULTS"


def parse(spec: str) -> dict[int, str]:
    """``"12:raise,24:kill"`` -> ``{12: "raise", 24: "kill"}``."""
    out: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        step, _, how = part.partition(":")
        if how not in ("raise", "kill"):
            raise ValueError(f"{ENV}: {part!r} should be <step>:raise or <step>:kill")
        out[int(step)] = how
    return out


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


def maybe_fail(step: int, rank: int, world: int, marker_dir: str) -> None:
    """Fail now if a fault is planned for ``step`` on this rank and has not fired in this run yet."""
    planned = parse(os.environ.get(ENV, "")).get(step)
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
