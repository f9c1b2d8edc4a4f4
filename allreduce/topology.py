"""The balanced binary spanning tree over the survivors, as pure functions and data.

Rank ``r`` is shard ``r``; rank 0 is the root; the children of ``r`` are ``2r+1`` and ``2r+2``
(those below ``size``), in that fixed order, which fixes the order of every reduction::

    S(r) = (x_r + S(2r+1)) + S(2r+2)        (terms that do not exist are left out)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ProtocolError


def parent_of(rank: int) -> int | None:
    """The parent rank of ``rank`` (None for the root)."""
    return None if rank == 0 else (rank - 1) // 2


def children_of(rank: int, size: int) -> tuple[int, ...]:
    """The children of ``rank`` in a tree of ``size`` ranks, in reduction order."""
    return tuple(c for c in (2 * rank + 1, 2 * rank + 2) if c < size)


def path_to_root(rank: int) -> tuple[int, ...]:
    """``rank`` and its ancestors, ending with 0."""
    path = [rank]
    while path[-1] != 0:
        path.append((path[-1] - 1) // 2)
    return tuple(path)


def depth(size: int) -> int:
    """Number of edges on the longest root-to-leaf path."""
    return (size).bit_length() - 1 if size > 0 else 0


@dataclass(frozen=True)
class Endpoint:
    """Where a rank listens for its children."""

    rank: int
    host: str
    port: int

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "port": self.port}

    @classmethod
    def from_json(cls, obj: Any) -> Endpoint:
        if not isinstance(obj, dict):
            raise ProtocolError("endpoint must be an object")
        rank, host, port = obj.get("rank"), obj.get("host"), obj.get("port")
        if not _is_int(rank) or rank < 0:
            raise ProtocolError(f"endpoint has an invalid rank {rank!r}")
        if not isinstance(host, str) or not host or len(host) > 255:
            raise ProtocolError(f"endpoint of rank {rank} has an invalid host")
        if not _is_int(port) or not 0 < port < 65536:
            raise ProtocolError(f"endpoint of rank {rank} has an invalid port {port!r}")
        return cls(rank, host, port)


@dataclass(frozen=True)
class Placement:
    """One rank's view of the tree: who it is, whom to connect to, whom to accept."""

    rank: int
    size: int
    parent: Endpoint | None
    children: tuple[Endpoint, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "size": self.size,
            "parent": None if self.parent is None else self.parent.to_json(),
            "children": [c.to_json() for c in self.children],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Placement:
        """Parse and check a TOPOLOGY message against the tree arithmetic."""
        rank, size = obj.get("rank"), obj.get("size")
        if not _is_int(size) or size < 1 or not _is_int(rank) or not 0 <= rank < size:
            raise ProtocolError(f"TOPOLOGY has an invalid rank/size {rank!r}/{size!r}")
        parent_obj = obj.get("parent")
        parent = None if parent_obj is None else Endpoint.from_json(parent_obj)
        children_obj = obj.get("children")
        if not isinstance(children_obj, list):
            raise ProtocolError("TOPOLOGY children must be a list")
        children = tuple(Endpoint.from_json(c) for c in children_obj)
        if (parent.rank if parent else None) != parent_of(rank):
            raise ProtocolError(f"TOPOLOGY gives rank {rank} the wrong parent")
        if tuple(c.rank for c in children) != children_of(rank, size):
            raise ProtocolError(f"TOPOLOGY gives rank {rank} the wrong children")
        return cls(rank, size, parent, children)


def build_tree(endpoints: list[tuple[str, int]]) -> list[Placement]:
    """Placements for ranks ``0..K-1`` given each rank's listening ``(host, port)``."""
    size = len(endpoints)
    if size < 1:
        raise ValueError("a tree needs at least one rank")
    eps = [Endpoint(r, h, p) for r, (h, p) in enumerate(endpoints)]
    out = []
    for r in range(size):
        p = parent_of(r)
        out.append(
            Placement(
                r, size, None if p is None else eps[p], tuple(eps[c] for c in children_of(r, size))
            )
        )
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
