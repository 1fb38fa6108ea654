"""The data position: :class:`DataState`, typed and versioned, owned by the feeder.

The stream of one source is deterministic (``data.deterministic``): files in a seeded order, each
cut into packing units, each unit packed on its own. A run consumes that stream as a prefix, so its
position is one point: "file ``file_pos`` of the epoch's order, the unit starting at ``row`` (byte
``byte``), of which ``skip_rows`` packed rows are done" (:class:`pipelines.stream.units.ResumePoint`, made by
:func:`pipelines.stream.units.point_after`, with a worked example there).

On resume, files before ``file_pos`` are not opened, the file is seeked to ``byte`` (JSONL) or its
row groups skipped (Parquet), and only that one unit is tokenized again - so resuming costs the same
at 90% of an epoch as at 10%. Rows prefetched but not trained on are not in the position: it is
computed from the rows of committed optimizer steps only.

The feeder (:mod:`pipelines.stream.feeder`) hands out ``DataState.to_dict()`` as its ``state_dict()`` and
takes it back in ``load_state_dict()``; the checkpoint layer stores that dict and reads nothing in it.
A state carries a ``version`` (of its own layout), the ``fingerprint`` of the stream it was taken in
(:func:`pipelines.stream.spec.stream_fingerprint`), and per source its key and identity, so that a resume
can tell which source is which after datasets were added or removed (:mod:`pipelines.stream.resume`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipelines.stream.units import ResumePoint

__all__ = ["DATA_STATE_VERSION", "DataState", "DataStateError", "SourceState"]

# Bump when the layout or meaning of DataState changes; a state of another version is refused.
# 2: SourceState.rows_in_pass (mix_exhausted: cycle resumes the same mix).
# 3: SourceState.key and identity (run.on_data_change: continue); a version 2 state is read with them empty.
DATA_STATE_VERSION = 3
_READABLE = (2, 3)


class DataStateError(ValueError):
    """A saved data position that cannot be used: unreadable, another version, or another stream."""


@dataclass
class SourceState:
    """Position and mixing counters of one mixed source (or the single stream)."""

    point: ResumePoint = field(default_factory=ResumePoint)
    passes: int = 0  # times this source was restarted within the epoch (mix_exhausted: cycle)
    tokens: int = 0  # tokens taken from it since the epoch began, or since the mix last changed
    samples: int = 0  # samples taken from it, counted alike
    exhausted: bool = False  # ran out at least once this epoch
    rows_in_pass: int = 0  # rows taken in the current pass (cycle: an empty pass is not repeated)
    key: str = ""  # the source's key (MixSource.key): its dataset's name or path
    identity: str = ""  # MixSource.identity of the stream this position is in

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["point"] = asdict(self.point)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SourceState:
        return cls(ResumePoint(**d["point"]), d["passes"], d["tokens"], d["samples"], d["exhausted"],
                   d["rows_in_pass"], d.get("key", ""), d.get("identity", ""))


@dataclass
class DataState:
    """Everything needed to continue the data exactly where a checkpoint left it. Global, not per rank.

    ``to_dict``/``from_dict`` round-trip exactly; ``from_dict`` raises :class:`DataStateError` on anything
    it cannot read (never a silent fresh start).
    """

    epoch: int = 0
    step: int = 0  # optimizer steps committed so far (all epochs)
    sources: list[SourceState] = field(default_factory=list)
    epoch_done: bool = False
    fingerprint: dict[str, Any] = field(default_factory=dict)
    version: int = DATA_STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "epoch": self.epoch, "step": self.step, "epoch_done": self.epoch_done,
                "sources": [s.to_dict() for s in self.sources], "fingerprint": dict(self.fingerprint)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> DataState | None:
        """``None`` for no state at all (``None`` or ``{}``: a fresh start); else the state, or an error."""
        if not d:
            return None
        if not isinstance(d, dict):
            raise DataStateError(f"data_state is a {type(d).__name__}, not a mapping")
        version = d.get("version")
        if version not in _READABLE:
            raise DataStateError(f"data_state has version {version!r}; this code reads versions "
                                 f"{', '.join(map(str, _READABLE))} (it was written by another version of pipelines)")
        try:
            return cls(int(d["epoch"]), int(d["step"]), [SourceState.from_dict(s) for s in d["sources"]],
                       bool(d["epoch_done"]), dict(d.get("fingerprint") or {}), DATA_STATE_VERSION)
        except (KeyError, TypeError, ValueError) as err:
            raise DataStateError(f"data_state cannot be read: {type(err).__name__}: {err}") from None

    @classmethod
    def restart(cls, epoch: int, step: int, fingerprint: dict[str, Any] | None = None) -> DataState:
        """The start of ``epoch`` after ``step`` committed steps: the position a data restart resumes at.

        Encoded as "epoch - 1 is done", which the feeder continues with a fresh ``epoch``.
        """
        return cls(epoch - 1, step, [], epoch_done=True, fingerprint=dict(fingerprint or {}))

    @property
    def next_epoch(self) -> int:
        """The epoch training continues in: this one, or the next when this one is done."""
        return self.epoch + int(self.epoch_done)
