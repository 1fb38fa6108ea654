"""``StreamSpec``: what a run streams, worked out once from the config and passed down.

Everything below the spec takes it (or plain values from it), never the config: the files are listed
once, here, and every stage, the feeder and the fingerprint see that one listing. A file that appears
under a prefix during a run is not in its spec (the run streams what it started with); the next run's
spec lists it, its fingerprint differs, and ``run.on_data_change`` decides (:mod:`pipelines.stream.resume`).

Worked example, two datasets mixed by tokens on a 2-CPU machine::

    spec = build_spec(cfg, "train")
    spec.table.files       -> (SourceFile(0, 0, ".../a.jsonl", ...), SourceFile(1, 1, ".../b.jsonl", ...))
    spec.sources           -> (MixSource("a.jsonl", (0,), 0.7, "9f1c..."), MixSource("b.jsonl", (1,), 0.3, "41ab..."))
    spec.placement.where   -> "read_tasks"        (a pool of one actor would add only a process start)
    spec.fingerprint       -> {"data.sequence_len": 2048, ..., "files": "2 files, sha256 ...", "tokenizer": ...}

The spec is frozen and small (paths and sizes, no data), so it travels to the feeder actor and to the
workers of a restarted worker group as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pipelines.config import Config, DataConfig, DatasetConfig, ModelConfig
from pipelines.sources.listing import SourceTable, datasets_for_split, resolve_sources
from pipelines.stream.placement import Placement
from pipelines.stream.units import STREAM_LAYOUT, dataset_files, file_positions, ordered_files

__all__ = ["GIVEN", "MixSource", "StreamSpec", "build_spec", "given_spec", "dataset_key", "fingerprint_changes", "stream_fingerprint"]


@dataclass(frozen=True)
class MixSource:
    """One stream of the mix: the ``data.datasets`` entries it reads (``None``: all), its weight, its key
    (which names it in the data position and the ledger across runs) and its identity (a hash of what
    decides its rows: those entries' options, except weight and name, and their files)."""

    key: str
    datasets: tuple[int, ...] | None
    weight: float
    identity: str


@dataclass(frozen=True)
class StreamSpec:
    """A split's stream: its files, options, mixed sources, placement and fingerprint. Build with :func:`build_spec`."""

    split: str
    data: DataConfig
    model: ModelConfig
    table: SourceTable
    sources: tuple[MixSource, ...]
    placement: Placement
    fingerprint: dict[str, Any]  # stream_fingerprint: what decides the rows (read-only)

    @property
    def unit_size(self) -> int:
        """Records per packing unit: the pack buffer (bfd, concat) or a tokenizer batch (none)."""
        return self.data.pack_buffer_size if self.data.packing != "none" else self.data.tokenize.batch_size

    @property
    def mix_by(self) -> str:
        """What the mixer counts: tokens or samples (a single stream counts tokens; it has no one to share with)."""
        return self.data.mix_by if self.data.mix_by != "none" else "tokens"

    def files(self, epoch: int, source: int | None = None) -> list[int]:
        """Indices into ``table.files`` in the epoch's read order: all, or source ``source``'s."""
        return ordered_files(self.table, self.data.shuffle_seed, epoch, self._datasets(source))

    def file_positions(self, epoch: int, source: int | None = None) -> dict[int, int]:
        """File index -> position in the epoch's read order (what a resume point counts in)."""
        return file_positions(self.table, self.data.shuffle_seed, epoch, self._datasets(source))

    def source_files(self, source: int) -> list[int]:
        """Indices into ``table.files`` of source ``source``, in table order."""
        return dataset_files(self.table, self._datasets(source))

    def _datasets(self, source: int | None) -> list[int] | None:
        if source is None:
            return None
        chosen = self.sources[source].datasets
        return None if chosen is None else list(chosen)


def dataset_key(ds: DatasetConfig) -> str:
    """The key that names a ``data.datasets`` entry across runs: its ``name``, else its ``path`` as written."""
    return ds.name or ds.path


def _sha(chunks: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:16]


def _listing(table: SourceTable, files: Iterable[int]) -> list[bytes]:
    """What identifies files: url, format, size, MDS shard entry, and place in the sample-id space."""
    return [f"{f.source_index}\t{f.url}\t{f.format}\t{f.size}\t{f.meta}".encode()
            for f in (table.files[i] for i in files)]


def _mix_sources(data: DataConfig, table: SourceTable, split: str) -> tuple[MixSource, ...]:
    """One source per dataset entry when mixing (``data.mix_by`` tokens or samples), else one over all."""
    datasets = table.datasets
    if data.mix_by == "none" or len(datasets) == 1 or split != "train":
        groups: list[tuple[int, ...] | None] = [None]
        weights = [1.0]
    else:
        groups = [(i,) for i in range(len(datasets))]
        weights = [d.weight for d in datasets]
    out = []
    for group, weight in zip(groups, weights, strict=True):
        members = range(len(datasets)) if group is None else group
        options = [json.dumps(datasets[i].model_dump(mode="json", exclude={"weight", "name"}), sort_keys=True).encode()
                   for i in members]
        files = dataset_files(table, None if group is None else list(group))
        key = " + ".join(dataset_key(datasets[i]) for i in members)
        out.append(MixSource(key, group, weight, _sha([*options, *_listing(table, files)])))
    return tuple(out)


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


def _tokenizer_identity(model: ModelConfig) -> tuple[str, str]:
    """``(tokenizer, chat_template)`` entries: the tokenizer's name plus a hash of its files (when local)."""
    from pipelines.tokenize.tokenizer import resolve_tokenizer_path

    name = model.tokenizer_path or ""
    path = resolve_tokenizer_path(model) if name else ""
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


def _fingerprint(data: DataConfig, model: ModelConfig, table: SourceTable) -> dict[str, Any]:
    """What decides the row stream, as readable ``key -> value`` pairs, e.g.::

        {"data.sequence_len": 512, "data.shuffle_seed": 42, "data.datasets[0].type": "alpaca",
         "files": "3 files, sha256 9f1c...", "tokenizer": "demo://tokenizer sha256 41ab...", ...}

    The world size, batch sizes, actor counts and dataset names are not in it (the rows do not depend on them).
    """
    out: dict[str, Any] = {}
    dumped = data.model_dump(mode="json")
    for key in _NOT_IN_STREAM:
        dumped.pop(key, None)
    _flat("data", dumped, out)
    for i, ds in enumerate(table.datasets):
        _flat(f"data.datasets[{i}]", ds.model_dump(mode="json", exclude={"name"}), out)
    listing = _listing(table, range(len(table.files)))
    out["files"] = f"{len(listing)} files, sha256 {_sha(listing)}"
    out["tokenizer"], out["chat_template"] = _tokenizer_identity(model)
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


# --------------------------------------------------------------------------- the builder


def build_spec(cfg: Config, split: str = "train", cpus: float | None = None) -> StreamSpec:
    """The spec of ``split`` (``train`` or ``eval``): lists its files (metadata only), once.

    ``cpus``: the cluster's CPUs for the placement; default: the connected Ray cluster's, else this machine's.
    Refuses a pre-tokenized MDS set made with another tokenizer (:func:`pipelines.mds.reader.check_tokenized_sources`).
    """
    datasets_for_split(cfg, split)  # a clear error for a split with no sources, before listing
    table = resolve_sources(cfg, split)
    if any(f.format == "mds" for f in table.files):
        from pipelines.mds.reader import check_tokenized_sources

        check_tokenized_sources(cfg.model, table)
    d = cfg.data
    placement = Placement.resolve(d.tokenize, d.read_num_cpus, d.read_tasks, d.read_concurrency, cpus)
    return StreamSpec(split, d, cfg.model, table, _mix_sources(d, table, split), placement,
                      _fingerprint(d, cfg.model, table))


GIVEN = "train_dataset"  # the key of a dataset given to the trainer, the one source of its spec


def given_spec(cfg: Config) -> StreamSpec:
    """The spec of a dataset given to the trainer (``build_trainer(cfg, train_dataset=ds)``): no files of its
    own, one source keyed :data:`GIVEN`. Its fingerprint holds the options and says the rows are given: the
    rows themselves cannot be fingerprinted without reading them, so a resume trusts they are the same."""
    from pipelines.storage import StorageOptions

    d = cfg.data
    table = SourceTable((), (), StorageOptions.from_config(cfg.storage))
    placement = Placement.resolve(d.tokenize, d.read_num_cpus, d.read_tasks, d.read_concurrency, 1.0)
    fingerprint = {"files": "a dataset given to build_trainer", "stream_layout": STREAM_LAYOUT}
    return StreamSpec("train", d, cfg.model, table, (MixSource(GIVEN, None, 1.0, GIVEN),), placement, fingerprint)


def stream_fingerprint(cfg: Config) -> dict[str, Any]:
    """The training stream's fingerprint (lists the files; see :func:`_fingerprint`)."""
    table = resolve_sources(cfg, "train")
    return _fingerprint(cfg.data, cfg.model, table)
