"""How a rank links up with its tree neighbours: its children connect to its listener, it
connects to its parent, every link authenticated.

``_LinkSettings`` holds what bounds and authenticates the links (key, attempt id, timeouts,
frame size, socket buffers, cipher). The rank's listener is served by an
:class:`~allreduce.acceptor.Acceptor` (``_child_acceptor``) from the moment it opens, so junk
connections are accepted, bounded and closed while the rank registers and waits for its
placement. Children may connect before the rank knows its placement: ``_Children`` keeps them;
once the placement is known, links from ranks that are not its children are closed, a child
that linked again (it retried) replaces its older link, and links left untaken at the end are
closed. ``_link`` then connects to the parent (with retries and backoff; a reply from any rank
but the parent is a ProtocolError) and waits for every child within the connect and handshake
timeouts (PeerTimeout naming the first missing child), closing the parent's link if that fails.

The children's links are returned in the placement's order (``2r+1`` then ``2r+2``): the
fixed order in which the collectives add the children's partial sums (see
:mod:`allreduce.collective_run`).

Threading: the acceptor's threads call ``_Children.accept`` and ``_Children.on_channel``; the
joining thread calls ``expect``, ``wait``, ``take`` and ``finish``. ``_Children`` guards its
state with one condition variable; nothing here starts a thread of its own.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .acceptor import Acceptor
from .channel import Channel, connect_authenticated
from .errors import PeerTimeout, ProtocolError
from .topology import Placement


class _Children:
    """The children that authenticated on a rank's listener, before and after its placement is
    known (a child may receive the topology, and connect, before its parent does)."""

    def __init__(self, me: int) -> None:
        self._me = me
        self._cond = threading.Condition()
        self._expected: set[int] | None = None  # unknown until the placement arrives
        self._linked: dict[int, Channel] = {}
        self._done = False

    def accept(self, hello: dict[str, Any]) -> tuple[int | None, str | None, dict[str, Any]]:
        r = hello.get("rank")
        with self._cond:
            expected = self._expected
        ok = isinstance(r, int) and not isinstance(r, bool) and 0 < r < 1 << 30
        if not ok or (expected is not None and r not in expected):
            want = "its children" if expected is None else f"children {sorted(expected)}"
            raise ProtocolError(f"rank {self._me} expects {want}, got a HELLO from rank {r!r}")
        return r, None, {"rank": self._me}

    def on_channel(self, chan: Channel, hello: dict[str, Any]) -> None:
        with self._cond:
            unwanted = self._done or (
                self._expected is not None and chan.rank not in self._expected
            )
            # a child that retried after its reply was lost links again: the newest link wins
            old = None if unwanted else self._linked.get(chan.rank)  # type: ignore[arg-type]
            if not unwanted:
                self._linked[chan.rank] = chan  # type: ignore[index]
                self._cond.notify_all()
        if unwanted:
            chan.close()
        if old is not None:
            old.close()

    def expect(self, ranks: set[int]) -> None:
        with self._cond:
            self._expected = set(ranks)
            stray = [c for r, c in self._linked.items() if r not in ranks]
            self._linked = {r: c for r, c in self._linked.items() if r in ranks}
        for chan in stray:
            chan.close()

    def wait(self, timeout_s: float) -> list[int]:
        """The expected children still missing after waiting up to ``timeout_s`` for them."""
        with self._cond:
            assert self._expected is not None
            self._cond.wait_for(lambda: self._expected <= set(self._linked), timeout_s)
            return sorted(self._expected - set(self._linked))

    def take(self, ranks: Sequence[int]) -> list[Channel]:
        with self._cond:
            return [self._linked.pop(r) for r in ranks]

    def finish(self) -> None:
        """No more children: close any link not taken."""
        with self._cond:
            self._done = True
            left, self._linked = list(self._linked.values()), {}
        for chan in left:
            chan.close()


@dataclass(frozen=True)
class _LinkSettings:
    """How a rank authenticates and bounds its links to its tree neighbours."""

    key: bytes = field(repr=False)
    attempt_id: str
    connect_timeout_s: float
    handshake_timeout_s: float
    io_timeout_s: float
    max_frame_bytes: int
    buffer_bytes: int | None
    cipher: str


def _child_acceptor(
    listener: socket.socket,
    me: int,
    children: _Children,
    links: _LinkSettings,
    *,
    max_pending: int,
    max_pending_per_source: int,
) -> Acceptor:
    """The acceptor that serves a rank's listener: it authenticates the children as they
    connect and hands their links to ``children`` (and bounds and closes junk connections)."""
    return Acceptor(
        listener,
        links.key,
        name=f"rank {me}",
        role="parent",
        expect_role="child",
        accept=children.accept,
        on_channel=children.on_channel,
        handshake_timeout_s=links.handshake_timeout_s,
        io_timeout_s=links.io_timeout_s,
        max_frame_bytes=links.max_frame_bytes,
        buffer_bytes=links.buffer_bytes,
        max_pending=max_pending,
        max_pending_per_source=max_pending_per_source,
        cipher=links.cipher,
    )


def _link(
    placement: Placement, children: _Children, links: _LinkSettings
) -> tuple[Channel | None, list[Channel]]:
    """Connect to the parent and collect the children, each link authenticated."""
    children.expect({c.rank for c in placement.children})
    parent = _connect_parent(placement, links) if placement.parent is not None else None
    try:
        return parent, _await_children(placement, children, links)
    except BaseException:
        if parent is not None:
            parent.close()
        raise


def _connect_parent(placement: Placement, links: _LinkSettings) -> Channel:
    """The authenticated link to this rank's parent (with retries and backoff)."""
    me, p = placement.rank, placement.parent
    assert p is not None
    chan, reply = connect_authenticated(
        (p.host, p.port),
        links.key,
        role="child",
        expect_role="parent",
        info={"rank": me, "attempt_id": links.attempt_id},
        rank=p.rank,
        peer=None,
        connect_timeout_s=links.connect_timeout_s,
        handshake_timeout_s=links.handshake_timeout_s,
        io_timeout_s=links.io_timeout_s,
        max_frame_bytes=links.max_frame_bytes,
        buffer_bytes=links.buffer_bytes,
        cipher=links.cipher,
    )
    if reply.get("rank") != p.rank:
        chan.close()
        raise ProtocolError(
            f"rank {me} reached rank {reply.get('rank')!r} instead of its parent {p.rank}"
        )
    return chan


def _await_children(
    placement: Placement, children: _Children, links: _LinkSettings
) -> list[Channel]:
    """The links of this rank's children, in the placement's order, once all have connected
    (PeerTimeout naming the first missing child if they have not within the connect and
    handshake timeouts)."""
    wait_s = links.connect_timeout_s + links.handshake_timeout_s
    missing = children.wait(wait_s)
    if missing:
        raise PeerTimeout(
            missing[0],
            f"child rank(s) {missing} of rank {placement.rank} did not connect within {wait_s:g} s",
        )
    return children.take([c.rank for c in placement.children])
