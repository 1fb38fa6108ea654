"""Training metrics: one concise log line per ``train.log_every_steps``, metrics.jsonl and TensorBoard.

A logging window aggregates the steps since the last line, e.g. with ``log_every_steps: 10``::

    step 20/250 | loss 2.3141 | lr 2.85e-03 | grad_norm 0.912 | tok/s 4,812 | sup_tok 2,210 | pack 91.2% | data_wait 1.3%

* loss: mean over the window's supervised tokens (each step's loss is already a global token mean),
* tok/s: all ranks' real (unpadded) tokens / wall time of the window,
* sup_tok: supervised tokens per step (all ranks), averaged over the window,
* pack: packing efficiency = real tokens / (rows * sequence_len),
* data_wait: time the ranks spent blocked on the data iterator / window time (mean over ranks).

The same numbers go to ``<run dir>/metrics.jsonl`` (one JSON object per line, ``"kind": "train"``,
``"eval"``, ``"resume"`` or ``"summary"``) and to TensorBoard event files under ``<run dir>/tensorboard``. Only rank 0
writes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from pipelines.stats import packing_efficiency
from pipelines.train.step import StepStats
from pipelines.train.storage import OutputDir


@dataclass
class Window:
    """Running sums for the steps since the last log line."""

    steps: int = 0
    loss_x_tokens: float = 0.0
    supervised: int = 0
    tokens: int = 0
    rows: int = 0
    wait_s: float = 0.0
    time_s: float = 0.0
    last: StepStats | None = None

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.loss_x_tokens += s.loss * s.supervised_tokens
        self.supervised += s.supervised_tokens
        self.tokens += s.tokens
        self.rows += s.rows
        self.wait_s += s.data_wait_s
        self.time_s += s.step_time_s
        self.last = s

    def record(self, step: int, epoch: int, sequence_len: int, wait_s: float, time_s: float) -> dict[str, Any]:
        """The window as one flat metrics dict (plain floats/ints, safe for ray.train.report).

        ``wait_s``/``time_s``: data-wait and step time summed over ranks (so the % is a mean over ranks).
        """
        assert self.last is not None, "empty window"
        return {
            "kind": "train",
            "step": step,
            "epoch": epoch,
            "loss": self.loss_x_tokens / max(self.supervised, 1),
            "lr": self.last.lr,
            "grad_norm": self.last.grad_norm,
            "tokens_per_s": self.tokens / max(self.time_s, 1e-9),
            "supervised_tokens": self.supervised / self.steps,
            "tokens": self.tokens,
            "packing_efficiency": packing_efficiency(self.tokens, self.rows * sequence_len) or 0.0,
            "data_wait_pct": 100.0 * wait_s / max(time_s, 1e-9),
            "step_time_s": self.time_s / self.steps,
        }


def format_line(rec: dict[str, Any], max_steps: int | None) -> str:
    """The concise human line for a train record (see the module docstring)."""
    total = f"/{max_steps}" if max_steps else ""
    return (
        f"step {rec['step']}{total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
        f"grad_norm {rec['grad_norm']:.3f} | tok/s {rec['tokens_per_s']:,.0f} | "
        f"sup_tok {rec['supervised_tokens']:,.0f} | pack {100 * rec['packing_efficiency']:.1f}% | "
        f"data_wait {rec['data_wait_pct']:.1f}%"
    )


class MetricsWriter:
    """Writes metrics.jsonl and TensorBoard events into the run directory (rank 0; a no-op elsewhere)."""

    def __init__(self, out: OutputDir | None):
        self.out = out
        self._tb = None
        if out is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._jsonl = open(os.path.join(out.local, "metrics.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
            self._tb = SummaryWriter(os.path.join(out.local, "tensorboard"))

    def write(self, rec: dict[str, Any]) -> None:
        if self.out is None:
            return
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()
        prefix = rec.get("kind", "train")
        step = int(rec.get("step", 0))
        for k, v in rec.items():
            if k not in ("kind", "step") and isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(f"{prefix}/{k}", v, step)
        self._tb.flush()

    def sync(self) -> None:
        if self.out is not None:
            self.out.sync()

    def close(self) -> None:
        if self.out is None:
            return
        self._jsonl.close()
        self._tb.close()
        self.out.sync()
