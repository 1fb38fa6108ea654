"""What a worker says when a collective fails because another rank is gone.

When a node is lost (or a worker is OOM-killed or preempted), the ranks that survive fail in their next
collective, and Ray Train may report their error before the dead rank's failed health check. Without a
wrapper that error is the backend's, for example gloo's::

    RuntimeError: [.../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:55435. ...

:func:`naming_lost_peers` turns such an error into :class:`PeerLost`, which names this rank, the world size
and the likely cause; the backend's error stays attached as its ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# Substrings of the errors torch's gloo and NCCL backends raise when the other end of a collective is gone.
LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                     "remote process exited", "ncclRemoteError")


class PeerLost(RuntimeError):
    """A collective failed because another rank (its worker process or its node) is gone."""


def is_lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a backend's error for a collective whose other end went away."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(m in text for m in LOST_PEER_MARKERS)


@contextmanager
def naming_lost_peers(rank: int, world_size: int) -> Iterator[None]:
    """Re-raise a lost-peer backend error (:func:`is_lost_peer`) as :class:`PeerLost`; others pass unchanged."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, PeerLost) or not is_lost_peer(err):
            raise
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise PeerLost(
            f"rank {rank} of {world_size}: a collective with the other ranks failed because one of them is "
            "gone: its worker process or its node died (a lost or preempted node, an OOM kill). With "
            "run.max_failures > 0 Ray Train restarts the group from the last checkpoint. The backend said: "
            f"{first}") from err
