"""The data ledger: what was trained on, step by step, counted in source samples.

``<run dir>/ledger/epoch_<e>/steps_<a>-<b>.jsonl`` lists, per committed step, the ``sample_ids`` of every
row in it, rank by rank; steps undone by a restore are removed from it. A sample id is
``(file index << 40) | row`` in the run's file listing (:mod:`pipelines.sources.listing`).

A data restart (``run.on_data_change: restart``) leaves ``restart_<step>.json``; a change of the mix that
the run continued across (``continue``) leaves ``change_<step>.json``, with what changed and the file
listing the sample ids after that step refer to.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

__all__ = ["Ledger", "LedgerEntry", "sample_counts"]

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
    """Append-only per-epoch files of committed steps, object-store friendly (one file per flush).

    Written ahead of the checkpoint: a checkpoint's steps go in when its data state is taken
    (``Feeder.commit``), before the checkpoint itself is saved. A run that dies in between leaves them
    here with no saved checkpoint covering them; the next run restores an earlier checkpoint and drops
    them (:meth:`truncate_after`) before it trains them again, so each sample is still recorded once.
    """

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

    def mark_restart(self, step: int, reason: str) -> None:
        """Record that the data position was restarted after ``step`` (``run.on_data_change: restart``)."""
        self.fs.create_dir(self.root, recursive=True)
        with self.fs.open_output_stream(f"{self.root}/restart_{step:08d}.json") as f:
            f.write(json.dumps({"after_step": step, "reason": reason}).encode())

    def mark_change(self, step: int, changes: list[str], files: list[str]) -> None:
        """Record that the run continued after ``step`` with another mix (``run.on_data_change: continue``):
        ``changes`` names what changed, ``files`` is the listing (urls by file index) of the ids after it."""
        self.fs.create_dir(self.root, recursive=True)
        with self.fs.open_output_stream(f"{self.root}/change_{step:08d}.json") as f:
            f.write(json.dumps({"after_step": step, "changes": changes, "files": files}).encode())

    def restarts(self) -> list[dict[str, Any]]:
        """The data restarts recorded by :meth:`mark_restart`, oldest first."""
        return self._marks("restart_")

    def changes(self) -> list[dict[str, Any]]:
        """The mix changes recorded by :meth:`mark_change`, oldest first."""
        return self._marks("change_")

    def _marks(self, prefix: str) -> list[dict[str, Any]]:
        if self.fs.get_file_info(self.root).type == pafs.FileType.NotFound:
            return []
        infos = sorted((i for i in self.fs.get_file_info(pafs.FileSelector(self.root))
                        if i.base_name.startswith(prefix)), key=lambda i: i.path)
        out = []
        for info in infos:
            with self.fs.open_input_stream(info.path) as f:
                out.append(json.loads(f.read().decode()))
        return out

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
