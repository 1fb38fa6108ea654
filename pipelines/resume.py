"""Resume positions and the data ledger: what was trained on, counted in source samples.

The stream of one source is deterministic (``data.deterministic``): files in a seeded order, each
cut into packing units, each unit packed on its own. A run consumes that stream as a prefix, so its
position is one point: "file ``file_pos`` of the epoch's order, the unit starting at ``row`` (byte
``byte``), of which ``skip_rows`` packed rows are done" (:class:`pipelines.units.ResumePoint`, made by
:func:`pipelines.units.point_after`, with a worked example there).

On resume, files before ``file_pos`` are not opened, the file is seeked to ``byte`` (JSONL) or its
row groups skipped (Parquet), and only that one unit is tokenized again - so resuming costs the same
at 90% of an epoch as at 10%. Rows prefetched but not trained on are not in the position: it is
computed from the rows of committed optimizer steps only.

The ledger (``<run dir>/ledger/epoch_<e>/steps_<a>-<b>.jsonl``) lists, per committed step, the
``sample_ids`` of every row in it, rank by rank; steps undone by a restore are removed from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.fs as pafs

from pipelines.units import ResumePoint, point_after  # noqa: F401  (point_after: re-exported)


@dataclass
class SourceState:
    """Position and mixing counters of one mixed source (or the single stream)."""

    point: ResumePoint = field(default_factory=ResumePoint)
    passes: int = 0  # times this source was restarted within the epoch (mix_exhausted: cycle)
    tokens: int = 0  # tokens taken from it this epoch (token-weighted mixing)
    samples: int = 0  # samples taken from it this epoch
    exhausted: bool = False  # ran out at least once this epoch

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["point"] = asdict(self.point)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SourceState:
        return cls(ResumePoint(**d["point"]), d["passes"], d["tokens"], d["samples"], d["exhausted"])


@dataclass
class DataState:
    """Everything needed to continue the data exactly where a checkpoint left it. Global, not per rank."""

    epoch: int = 0
    step: int = 0  # optimizer steps committed so far (all epochs)
    sources: list[SourceState] = field(default_factory=list)
    epoch_done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "epoch_done": self.epoch_done,
                "sources": [s.to_dict() for s in self.sources]}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> DataState | None:
        if not d or "sources" not in d:
            return None
        return cls(d["epoch"], d["step"], [SourceState.from_dict(s) for s in d["sources"]], d.get("epoch_done", False))


# --------------------------------------------------------------------------- ledger


@dataclass(frozen=True)
class LedgerEntry:
    """One committed optimizer step: the sample ids of each row, per rank."""

    epoch: int
    step: int
    ranks: list[list[list[int]]]  # ranks[r][i] = sample_ids of rank r's i-th row

    def sample_ids(self) -> Iterator[int]:
        for rank in self.ranks:
            for row in rank:
                yield from row


class Ledger:
    """Append-only per-epoch files of committed steps, object-store friendly (one file per flush)."""

    def __init__(self, fs: pafs.FileSystem, root: str) -> None:
        self.fs, self.root = fs, root.rstrip("/")

    def _epoch_dir(self, epoch: int) -> str:
        return f"{self.root}/epoch_{epoch:04d}"

    def write(self, entries: list[LedgerEntry]) -> None:
        """Write entries (one epoch or several) as one file per epoch named by their step range."""
        by_epoch: dict[int, list[LedgerEntry]] = {}
        for e in sorted(entries, key=lambda e: e.step):
            by_epoch.setdefault(e.epoch, []).append(e)
        for epoch, group in by_epoch.items():
            d = self._epoch_dir(epoch)
            self.fs.create_dir(d, recursive=True)
            name = f"{d}/steps_{group[0].step:08d}-{group[-1].step:08d}.jsonl"
            with self.fs.open_output_stream(name) as f:
                for e in group:
                    f.write((json.dumps({"epoch": e.epoch, "step": e.step, "ranks": e.ranks}) + "\n").encode())

    def _files(self) -> list[pafs.FileInfo]:
        info = self.fs.get_file_info(self.root)
        if info.type == pafs.FileType.NotFound:
            return []
        return sorted((i for i in self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True))
                       if i.type == pafs.FileType.File and i.base_name.startswith("steps_")), key=lambda i: i.path)

    def truncate_after(self, step: int) -> None:
        """Forget steps after ``step`` (they were undone by a restore)."""
        for info in self._files():
            first, last = (int(x) for x in info.base_name[len("steps_"):-len(".jsonl")].split("-"))
            if first > step:
                self.fs.delete_file(info.path)
            elif last > step:
                kept = [e for e in self._read(info.path) if e.step <= step]
                self.fs.delete_file(info.path)
                self.write(kept)

    def _read(self, path: str) -> list[LedgerEntry]:
        with self.fs.open_input_stream(path) as f:
            lines = f.read().decode().splitlines()
        return [LedgerEntry(**json.loads(line)) for line in lines if line.strip()]

    def entries(self, epoch: int | None = None) -> list[LedgerEntry]:
        """Committed steps in step order (optionally one epoch)."""
        out = [e for info in self._files() for e in self._read(info.path)]
        return sorted((e for e in out if epoch is None or e.epoch == epoch), key=lambda e: e.step)


def sample_counts(entries: Iterable[LedgerEntry]) -> dict[int, int]:
    """How many times each sample id was trained on (a packed concat document counts per row)."""
    counts: dict[int, int] = {}
    for e in entries:
        for sid in e.sample_ids():
            counts[sid] = counts.get(sid, 0) + 1
    return counts
