"""Typed errors of the AllReduce communication layer.

Every error that concerns one peer carries that peer's ``rank`` (``None`` for a peer that has
no rank, such as the tree server or a connection that has not authenticated yet) and says it in
its message, so a failed job names the node to look at.

All errors are picklable with their fields (``__reduce__``), so they survive being passed
between processes.
"""

from __future__ import annotations

from collections.abc import Iterable


class AllreduceError(Exception):
    """Base class of every error raised by :mod:`allreduce`."""


class ProtocolError(AllreduceError):
    """A frame or message violates the wire protocol (magic, version, type, length, order)."""


class AuthError(ProtocolError):
    """A frame failed HMAC verification, or a handshake was not bound to this connection."""


def _describe_peer(rank: int | None, peer: str | None) -> str:
    if peer:
        return peer
    return "an unidentified peer" if rank is None else f"rank {rank}"


class PeerError(AllreduceError):
    """Base class of errors about one peer; ``rank`` names it (``None`` if it has no rank)."""

    def __init__(self, rank: int | None, detail: str = "", *, peer: str | None = None) -> None:
        self.rank = rank
        self.detail = detail
        self.peer = peer
        super().__init__(self._message())

    def _message(self) -> str:
        who = _describe_peer(self.rank, self.peer)
        return f"{who}: {self.detail}" if self.detail else who

    def __reduce__(self):
        return (_rebuild_peer_error, (type(self), self.rank, self.detail, self.peer))


def _rebuild_peer_error(cls, rank, detail, peer):
    return cls(rank, detail, peer=peer)


class PeerLost(PeerError):
    """The connection to a peer closed or broke (possibly in the middle of a frame)."""

    def _message(self) -> str:
        who = _describe_peer(self.rank, self.peer)
        return f"lost connection to {who}" + (f": {self.detail}" if self.detail else "")


class PeerTimeout(PeerError):
    """A peer sent (or accepted) nothing within the timeout: it is stalled or gone."""

    def _message(self) -> str:
        who = _describe_peer(self.rank, self.peer)
        return f"timed out waiting for {who}" + (f": {self.detail}" if self.detail else "")


class PeerAborted(PeerLost):
    """A neighbour told us the collective was aborted; ``rank`` is the rank where it started."""

    def _message(self) -> str:
        who = _describe_peer(self.rank, self.peer)
        return f"{who} aborted the collective" + (f": {self.detail}" if self.detail else "")


class StandDown(AllreduceError):
    """Another attempt of this shard registered first; this attempt must exit cleanly."""

    def __init__(self, shard: int, attempt_id: str, detail: str = "") -> None:
        self.shard = shard
        self.attempt_id = attempt_id
        self.detail = detail
        msg = f"shard {shard} attempt {attempt_id!r} must stand down"
        super().__init__(msg + (f": {detail}" if detail else ""))

    def __reduce__(self):
        return (type(self), (self.shard, self.attempt_id, self.detail))


class StartupTimeout(AllreduceError):
    """Some shards had no survivor within the startup timeout, so the round failed."""

    def __init__(self, missing_shards: Iterable[int], timeout_s: float | None = None) -> None:
        self.missing_shards = tuple(sorted(int(s) for s in missing_shards))
        self.timeout_s = timeout_s
        within = f" within {timeout_s:g} s" if timeout_s is not None else ""
        shown = ", ".join(str(s) for s in self.missing_shards[:50])
        if len(self.missing_shards) > 50:
            shown += f", ... ({len(self.missing_shards)} in all)"
        super().__init__(f"no survivor registered{within} for shard(s) {shown}")

    def __reduce__(self):
        return (type(self), (self.missing_shards, self.timeout_s))


class RoundAborted(AllreduceError):
    """The tree server aborted the round (it was closed, or told to fail) before the tree formed."""
