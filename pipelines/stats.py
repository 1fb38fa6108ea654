"""Data-quality counters shared by read tasks, tokenizer actors and packing tasks.

Nothing is dropped silently: every skipped record, truncated or dropped sample, sample without
trained tokens and concat remainder is counted here, with the first few locations as examples.
Each stage accumulates a :class:`Counts` per batch and sends it to one small ``DataStats`` actor
(one small call per batch); ``data_report()`` reads the totals.

One ``DataStats`` actor serves every stream a process builds, each under a key of its own
(:func:`stats_sink`). An actor is a worker process of its own, and the feeder opens a stream per source
and per epoch: an actor per stream would keep one process alive per stream, each started on the path of
its stream's first row (docs/design.md, "Placement and timing notes").
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray

MAX_EXAMPLES = 5


@dataclass
class Counts:
    """Counters and example locations of one batch (merged into the actor's totals)."""

    counters: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, key: str, n: int = 1, example: str | None = None) -> None:
        self.counters[key] += n
        if example is not None:
            ex = self.examples.setdefault(key, [])
            if len(ex) < MAX_EXAMPLES:
                ex.append(example)

    def merge(self, counters: dict[str, int], examples: dict[str, list[str]]) -> None:
        """Add another batch's counters and examples (at most ``MAX_EXAMPLES`` kept per key)."""
        for key, n in counters.items():
            self.counters[key] += n
        for key, ex in examples.items():
            have = self.examples.setdefault(key, [])
            have.extend(ex[: MAX_EXAMPLES - len(have)])

    def snapshot(self) -> dict[str, Any]:
        """``{"counters": {...}, "examples": {...}}``, as ``data_report()`` returns it."""
        return {"counters": dict(self.counters), "examples": dict(self.examples)}

    def __bool__(self) -> bool:
        return bool(self.counters)


@ray.remote(num_cpus=0, max_restarts=-1)
class DataStats:
    """Totals of each stream (one ``build_dataset`` call) by its key. Lives as long as the process that
    started it (:func:`stats_sink`)."""

    def __init__(self) -> None:
        self._counts: dict[str, Counts] = {}

    def add(self, key: str, counters: dict[str, int], examples: dict[str, list[str]]) -> None:
        self._counts.setdefault(key, Counts()).merge(counters, examples)

    def snapshot(self, key: str) -> dict[str, Any]:
        """The totals of stream ``key`` (empty before its first batch)."""
        return self._counts.get(key, Counts()).snapshot()


class StatsSink:
    """A picklable handle stages report to: one stream's key in a ``DataStats`` actor, or local ``Counts``
    without Ray."""

    def __init__(self, actor: Any | None = None, key: str = "") -> None:
        self.actor, self.key = actor, key
        self.local = Counts()

    def send(self, counts: Counts) -> None:
        """Add a batch's counts; waits for the actor so a report read after iteration is complete."""
        if not counts:
            return
        if self.actor is None:
            self.local.merge(counts.counters, counts.examples)
            return
        ray.get(self.actor.add.remote(self.key, dict(counts.counters), counts.examples))

    def snapshot(self) -> dict[str, Any]:
        """The totals so far: ``{"counters": {...}, "examples": {...}}``."""
        if self.actor is None:
            return self.local.snapshot()
        return ray.get(self.actor.snapshot.remote(self.key))


# This process's DataStats actor, by who this process is in its Ray session (its node and worker ids; a
# driver's worker id alone is the job's, the same in every new local instance): after Ray is shut down and
# started again the pair differs, and the new session's first stream starts a new actor.
_SHARED: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()  # the feeder actor opens streams from several threads


def stats_sink() -> StatsSink:
    """A sink for one stream: a new key in this process's ``DataStats`` actor, started by its first stream.

    The process holds the actor's handle, so the actor outlives the streams and serves the next ones
    (Ray ends an actor once no handle to it is left). Example: the feeder's sources ``a`` and ``b`` over
    two epochs -> four streams, four keys, one actor.
    """
    ctx = ray.get_runtime_context()
    session = f"{ctx.get_node_id()}/{ctx.get_worker_id()}"
    with _SHARED_LOCK:
        if session not in _SHARED:
            _SHARED.clear()  # a handle from an earlier session (its actor ended with it)
            _SHARED[session] = DataStats.remote()
        return StatsSink(_SHARED[session], uuid.uuid4().hex)


def packing_efficiency(tokens: int | float, capacity: int | float) -> float | None:
    """The one packing-efficiency formula: tokens in rows / capacity, capacity = rows x sequence_len.

    Example: 3 rows of sequence_len 256 holding 600 tokens -> 600 / 768 = 0.78; no rows -> None.
    """
    return float(tokens) / capacity if capacity else None


def efficiency(snapshot: dict[str, Any]) -> float | None:
    """Packing efficiency of a counters snapshot (``row_tokens`` / ``row_capacity``)."""
    c = snapshot["counters"]
    return packing_efficiency(c.get("row_tokens", 0), c.get("row_capacity", 0))


def format_report(snapshot: dict[str, Any]) -> str:
    """A short multi-line summary for logs."""
    c = snapshot["counters"]
    lines = [
        f"samples read {c.get('records_read', 0)}, tokenized {c.get('samples_tokenized', 0)}, "
        f"packed rows {c.get('rows', 0)}"
    ]
    eff = efficiency(snapshot)
    if eff is not None:
        lines.append(f"packing efficiency {eff:.2%}")
    for key in sorted(k for k in c if k.startswith(("skipped_", "truncated", "dropped_", "concat_"))):
        ex = "; ".join(snapshot["examples"].get(key, [])[:2])
        lines.append(f"{key}: {c[key]}" + (f" (e.g. {ex})" if ex else ""))
    return "\n".join(lines)
