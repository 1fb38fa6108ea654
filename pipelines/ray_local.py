"""A local Ray instance that stays on 127.0.0.1.

By default a local ``ray.init()`` advertises the machine's network address (and every process on the
machine that looks for "the" Ray instance finds it). Ray 2.60 also turns ``_node_ip_address="127.0.0.1"``
back into that address (``ray._private.services.resolve_ip_for_localhost``) unless multi-node clusters
are switched off, which is Ray's own mode for a single-machine instance (the default on macOS and
Windows, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``). :func:`init_local` switches it off for this process
and the processes it starts, then starts Ray on loopback::

    from pipelines.ray_local import init_local, node_addresses
    init_local(num_cpus=2, include_dashboard=False)
    node_addresses()   # ['127.0.0.1']

Joining an existing cluster (``ray job submit``, ``RAY_ADDRESS``) does not go through here.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["LOOPBACK", "init_local", "keep_on_loopback", "node_addresses"]

LOOPBACK = "127.0.0.1"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_on_loopback() -> None:
    """Make Ray instances started from this process (and its children) use 127.0.0.1."""
    os.environ[SINGLE_MACHINE_ENV] = "0"  # read when `ray` is imported: children (raylet, workers, `ray start`)
    from ray._private import ray_constants  # this process may have imported ray already

    ray_constants.ENABLE_RAY_CLUSTER = False


def init_local(**kwargs: Any) -> Any:
    """``ray.init(**kwargs)`` starting a new local instance on 127.0.0.1 (never joins another one); returns
    ``ray.init``'s context (``.dashboard_url``)."""
    import ray

    keep_on_loopback()
    return ray.init(address="local", _node_ip_address=LOOPBACK, **kwargs)


def node_addresses() -> list[str]:
    """The addresses of the live Ray nodes of this session, as the GCS reports them."""
    import ray

    return sorted({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]})
