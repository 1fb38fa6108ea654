"""Resume positions and the data ledger: what was trained on, counted in source samples.

The stream of one source is deterministic (``data.deterministic``): files in a seeded order, each
cut into packing units, each unit packed on its own. A run consumes that stream as a prefix, so its
position is one point: "file ``file_pos`` of the epoch's order, the unit starting at ``row`` (byte
``byte``), of which ``skip_rows`` packed rows are done" (:class:`pipelines.stream.units.ResumePoint`, made by
:func:`pipelines.stream.units.point_after`, with a worked example there).

On resume, files before ``file_pos`` are not opened, the file is seeked to ``byte`` (JSONL) or its
row groups skipped (Parquet), and only that one unit is tokenized again - so resuming costs the same
at 90% of an epoch as at 10%. Rows prefetched but not trained on are not in the position: it is
computed from the rows of committed optimizer steps only.

The ledger (``<run dir>/ledger/epoch_<e>/steps_<a>-<b>.jsonl``) lists, per committed step, the
``sample_ids`` of every row in it, rank by rank; steps undone by a restore are removed from it.
A data restart (``run.on_data_change: restart``) leaves ``<run dir>/ledger/restart_<step>.json``.

A position is only meaningful for the stream it was taken in. :class:`DataState` therefore carries a
``version`` (of its own layout) and a ``fingerprint``: everything that decides the row stream, as
readable ``key -> value`` pairs (:func:`stream_fingerprint`), e.g.::

    {"data.sequence_len": 512, "data.shuffle_seed": 42, "data.datasets[0].type": "alpaca",
     "files": "3 files, sha256 9f1c...", "tokenizer": "demo://tokenizer sha256 41ab...", ...}

:func:`fingerprint_changes` compares two of them and names what changed
(``data.sequence_len: 512 -> 256``); the checkpoint layer refuses to resume on any change.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from pipelines.stream.units import STREAM_LAYOUT, ResumePoint, point_after

if TYPE_CHECKING:
    from pipelines.config import Config

__all__ = ["DATA_STATE_VERSION", "DataState", "DataStateError", "Ledger", "LedgerEntry", "SourceState",
           "fingerprint_changes", "point_after", "sample_counts", "stream_fingerprint"]

# Bump when the layout or meaning of DataState changes; a state of another version is refused.
DATA_STATE_VERSION = 2  # 2: SourceState.rows_in_pass (mix_exhausted: cycle resumes the same mix)


class DataStateError(ValueError):
    """A saved data position that cannot be used: unreadable, another version, or another stream."""


@dataclass
class SourceState:
    """Position and mixing counters of one mixed source (or the single stream)."""

    point: ResumePoint = field(default_factory=ResumePoint)
    passes: int = 0  # times this source was restarted within the epoch (mix_exhausted: cycle)
    tokens: int = 0  # tokens taken from it this epoch (token-weighted mixing)
    samples: int = 0  # samples taken from it this epoch
    exhausted: bool = False  # ran out at least once this epoch
    rows_in_pass: int = 0  # rows taken in the current pass (cycle: an empty pass is not repeated)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["point"] = asdict(self.point)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SourceState:
        return cls(ResumePoint(**d["point"]), d["passes"], d["tokens"], d["samples"], d["exhausted"],
                   d["rows_in_pass"])


@dataclass
class DataState:
    """Everything needed to continue the data exactly where a checkpoint left it. Global, not per rank.

    ``fingerprint`` is filled in by the checkpoint layer (:func:`stream_fingerprint`); ``{}`` in
    states the feeder produces. ``to_dict``/``from_dict`` round-trip exactly; ``from_dict`` raises
    :class:`DataStateError` on anything it cannot read (never a silent fresh start).
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
        if version != DATA_STATE_VERSION:
            raise DataStateError(f"data_state has version {version!r}; this code reads version {DATA_STATE_VERSION} "
                                 "(it was written by another version of pipelines)")
        try:
            return cls(int(d["epoch"]), int(d["step"]), [SourceState.from_dict(s) for s in d["sources"]],
                       bool(d["epoch_done"]), dict(d.get("fingerprint") or {}), version)
        except (KeyError, TypeError, ValueError) as err:
            raise DataStateError(f"data_state cannot be read: {type(err).__name__}: {err}") from None

    @classmethod
    def restart(cls, epoch: int, step: int) -> DataState:
        """The start of ``epoch`` after ``step`` committed steps: the position a data restart resumes at.

        Encoded as "epoch - 1 is done", which the feeder continues with a fresh ``epoch``.
        """
        return cls(epoch - 1, step, [], epoch_done=True)


# --------------------------------------------------------------------------- fingerprint

# data.* keys that change how fast the stream is made, never which rows it holds.
_NOT_IN_STREAM = ("tokenize", "read_num_cpus", "read_tasks", "read_concurrency", "eval_datasets", "datasets")
# Tokenizer files hashed for its identity; the chat template is its own entry.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """``("data", {"a": {"b": 1}})`` -> ``{"data.a.b": 1}``; lists of scalars stay one JSON value."""
    if isinstance(value, dict):
        for k in sorted(value):
            _flat(f"{prefix}.{k}", value[k], out)
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        for i, v in enumerate(value):
            _flat(f"{prefix}[{i}]", v, out)
    else:
        out[prefix] = value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)


def _sha(chunks: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:16]


def _tokenizer_identity(cfg: Config) -> tuple[str, str]:
    """``(tokenizer, chat_template)`` entries: the tokenizer's name plus a hash of its files (when local)."""
    from pipelines.tokenize.tokenizer import resolve_tokenizer_path

    name = cfg.model.tokenizer_path or ""
    path = resolve_tokenizer_path(cfg.model) if name else ""
    if not path or not os.path.isdir(path):
        return name, f"(in the tokenizer {name})"

    def read(names: tuple[str, ...]) -> list[bytes]:
        return [n.encode() + open(os.path.join(path, n), "rb").read()
                for n in names if os.path.isfile(os.path.join(path, n))]

    files = read(_TOKENIZER_FILES)
    templates = read(_TEMPLATE_FILES)
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):  # the template inside tokenizer_config.json counts as the template
        with open(config_file, encoding="utf-8") as f:
            templates.append(json.dumps(json.load(f).get("chat_template"), sort_keys=True).encode())
    return f"{name} sha256 {_sha(files)}", f"sha256 {_sha(templates)}"


def stream_fingerprint(cfg: Config) -> dict[str, Any]:
    """What decides the training row stream, as ``key -> value`` (see the module docstring).

    Resolves the training files (metadata only) and hashes the tokenizer's files; the world size,
    batch sizes and actor counts are not in it (the stream does not depend on them).
    """
    from pipelines.sources.listing import resolve_sources

    out: dict[str, Any] = {}
    data = cfg.data.model_dump(mode="json")
    for key in _NOT_IN_STREAM:
        data.pop(key, None)
    _flat("data", data, out)
    for i, ds in enumerate(cfg.data.datasets):
        _flat(f"data.datasets[{i}]", ds.model_dump(mode="json"), out)
    table = resolve_sources(cfg, "train")
    listing = [f"{f.url}\t{f.format}\t{f.size}\t{f.meta}".encode() for f in table.files]
    out["files"] = f"{len(listing)} files, sha256 {_sha(listing)}"
    out["tokenizer"], out["chat_template"] = _tokenizer_identity(cfg)
    out["stream_layout"] = STREAM_LAYOUT  # how units are cut and shuffled (pipelines.stream.units)
    return out


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs, one ``key: old -> new`` line each (``(unset)`` for a key only one side has)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key, "(unset)"), current.get(key, "(unset)")
        if old != new:
            out.append(f"{key}: {old!r} -> {new!r}")
    return out


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

    def restarts(self) -> list[dict[str, Any]]:
        """The data restarts recorded by :meth:`mark_restart`, oldest first."""
        if self.fs.get_file_info(self.root).type == pafs.FileType.NotFound:
            return []
        infos = sorted((i for i in self.fs.get_file_info(pafs.FileSelector(self.root))
                        if i.base_name.startswith("restart_")), key=lambda i: i.path)
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
