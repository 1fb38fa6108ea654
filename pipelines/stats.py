"""Data-quality counters shared by read tasks, tokenizer actors and packing tasks.

Nothing is dropped silently: every skipped record, truncated or dropped sample, sample without
trained tokens and concat remainder is counted here, with the first few locations as examples.
Each stage accumulates a :class:`Counts` per batch and sends it to one small ``DataStats`` actor
(one small call per batch); ``data_report()`` reads the totals.
"""

from __future__ import annotations

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

    def __bool__(self) -> bool:
        return bool(self.counters)


@ray.remote(num_cpus=0, max_restarts=-1)
class DataStats:
    """Totals for one dataset build. Lives as long as the driver that built the dataset."""

    def __init__(self) -> None:
        self._counts = Counts()

    def add(self, counters: dict[str, int], examples: dict[str, list[str]]) -> None:
        for key, n in counters.items():
            self._counts.counters[key] += n
        for key, ex in examples.items():
            have = self._counts.examples.setdefault(key, [])
            have.extend(ex[: MAX_EXAMPLES - len(have)])

    def snapshot(self) -> dict[str, Any]:
        return {"counters": dict(self._counts.counters), "examples": dict(self._counts.examples)}


class StatsSink:
    """A picklable handle stages report to: the ``DataStats`` actor, or local ``Counts`` without Ray."""

    def __init__(self, actor: Any | None = None) -> None:
        self.actor = actor
        self.local = Counts()

    def send(self, counts: Counts) -> None:
        """Add a batch's counts; waits for the actor so a report read after iteration is complete."""
        if not counts:
            return
        if self.actor is None:
            for key, n in counts.counters.items():
                self.local.add(key, n)
            for key, ex in counts.examples.items():
                have = self.local.examples.setdefault(key, [])
                have.extend(ex[: MAX_EXAMPLES - len(have)])
            return
        ray.get(self.actor.add.remote(dict(counts.counters), counts.examples))


def new_stats_actor() -> Any:
    """Start the counters actor for one ``build_dataset`` call."""
    return DataStats.remote()


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
