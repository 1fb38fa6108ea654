"""Where the stream's CPU work runs: the tokenizer pool, its threads, the read tasks at once.

Decided once per :class:`~pipelines.stream.spec.StreamSpec` from ``data.tokenize``, ``data.read_concurrency``
and the cluster's CPUs (:class:`Placement`), then read by every dataset the spec builds. None of it changes
which rows the stream holds, only how fast they come (it is not in the stream's fingerprint); the reasons
behind each default, with the measurements, are in docs/design.md ("Placement").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pipelines.config import TokenizeConfig

__all__ = ["CPU_RESERVE_FOR_READS", "Placement", "cluster_cpus", "tokenizer_placement", "tokenizer_pool_size",
           "tokenizer_pools_short", "tokenizer_threads"]

# CPUs left for read and packing tasks when sizing the tokenizer pool automatically; a pool that
# takes every CPU starves the reads and the pipeline hangs.
CPU_RESERVE_FOR_READS = 0.5


def cluster_cpus() -> float:
    """The CPUs of the Ray cluster this process is connected to, else of this machine."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 1))
    return float(os.cpu_count() or 1)


def tokenizer_pool_size(tok: TokenizeConfig, cpus: float | None = None) -> tuple[int, int]:
    """``(min, max)`` tokenizer actors. ``auto``: as many as fit next to the read tasks, at least one.

    Example: 8 CPUs, ``num_cpus: 1`` -> (1, 7); the pool grows as CPUs free up, so a cluster busy
    with training still gets one actor instead of hanging.
    """
    if tok.num_actors != "auto":
        return int(tok.num_actors), int(tok.num_actors)
    cpus = cluster_cpus() if cpus is None else cpus
    return 1, max(1, math.floor((cpus - CPU_RESERVE_FOR_READS) / tok.num_cpus))


def tokenizer_pools_short(tok: TokenizeConfig, pools: int, cluster: Mapping[str, float]) -> list[str]:
    """What ``cluster`` (``ray.cluster_resources()``) lacks to run ``pools`` tokenizer pools at once, each at
    its smallest; empty when they fit.

    A mix of N sources streams them side by side, one pool each, so all N must start. Example:
    ``resources: {cpu_node: 1}``, 2 sources, one node with ``cpu_node: 1`` -> ``["cpu_node: 2 needed, 1 in
    the cluster"]``: one pool waits for the other's stream to end, which can be never (the mixer waits on
    the stream that cannot start; tests/test_node_loss.py stalled so).
    """
    smallest = tokenizer_pool_size(tok, cpus=1.0)[0]  # the minimum does not depend on the CPUs
    need = {"CPU": tok.num_cpus * smallest * pools}
    for key, amount in tok.resources.items():
        need[key] = need.get(key, 0.0) + amount * smallest * pools
    return [f"{key}: {n:g} needed, {cluster.get(key, 0.0):g} in the cluster"
            for key, n in need.items() if n > cluster.get(key, 0.0) + 1e-9]


def tokenizer_threads(tok: TokenizeConfig, max_actors: int, cpus: float | None = None) -> int:
    """Rust threads per tokenizer actor: as set, or (auto) the cluster's CPUs per actor, at least 1."""
    if tok.threads != "auto":
        return int(tok.threads)
    cpus = cluster_cpus() if cpus is None else cpus
    return max(1, math.floor(cpus / max(1, max_actors)))


def tokenizer_placement(tok: TokenizeConfig, cpus: float | None = None) -> str:
    """Where the tokenizer runs, ``actors`` or ``read_tasks``: ``data.tokenize.placement``, or (auto) in the
    read tasks where the pool would hold one actor at most and ``resources`` places nothing.

    Example: 2 CPUs, ``num_cpus: 1`` -> a pool of (1, 1) -> ``read_tasks``: a lone actor runs the units one
    after another as the read task would, but costs a process start and every unit's trip through the object
    store. 16 CPUs -> (1, 15) -> ``actors``: 15 tokenizers share the units of 8 read tasks, where in the read
    tasks each file group would have one.
    """
    if tok.placement != "auto":
        return tok.placement
    return "read_tasks" if tokenizer_pool_size(tok, cpus)[1] == 1 and not tok.resources else "actors"


@dataclass(frozen=True)
class Placement:
    """The stream's placement, resolved once for a cluster of ``cpus`` CPUs (see :meth:`resolve`).

    Worked example, 2 CPUs and the defaults: ``pool (1, 1)``, ``threads 2``, ``where read_tasks``,
    reads at once ``1`` (text) or ``2`` (pre-tokenized MDS: one per CPU).
    """

    tokenize: TokenizeConfig
    cpus: float
    pool: tuple[int, int]  # (min, max) tokenizer actors
    threads: int  # Rust threads per tokenizer
    where: Literal["actors", "read_tasks"]
    read_num_cpus: float  # per read task that does not tokenize
    read_tasks: int  # most read tasks a stream is cut into (data.read_tasks)
    read_concurrency: int | Literal["auto"] | None  # data.read_concurrency, as set

    @classmethod
    def resolve(cls, tok: TokenizeConfig, read_num_cpus: float, read_tasks: int,
                read_concurrency: int | Literal["auto"] | None, cpus: float | None = None) -> Placement:
        cpus = cluster_cpus() if cpus is None else cpus
        pool = tokenizer_pool_size(tok, cpus)
        where = tokenizer_placement(tok, cpus)
        return cls(tok, cpus, pool, tokenizer_threads(tok, pool[1], cpus), where,  # type: ignore[arg-type]
                   read_num_cpus, read_tasks, read_concurrency)

    def reads_at_once(self, token_ids: bool) -> int | None:
        """Read tasks running at once: ``data.read_concurrency``; ``None`` is Ray's own cap, as many as the
        CPUs allow. ``auto`` (the default): one per tokenizer actor of the pool at its largest, or one per
        CPU when the read tasks do the work themselves (``token_ids``: every source is pre-tokenized MDS).

        Example: 2 CPUs -> 1 actor -> 1 read task at a time; 16 CPUs -> 15 actors -> 15. Each read task that
        runs beside another takes a worker process of its own, which imports ``ray.data`` on the cores the
        tokenizer needs.
        """
        if self.read_concurrency is None:
            return None
        if self.read_concurrency != "auto":
            return int(self.read_concurrency)
        if token_ids:
            return max(1, math.floor(self.cpus))
        return self.pool[1]
