"""A worker's session with the tree server: progress heartbeats, registration, stand-down.

Typical life of a training task (one attempt of one shard)::

    session = ServerSession.connect(server_address, key, shard=s, attempt_id=a)
    ...  # pass 1, calling session.report_progress(rows) now and then;
    ...  # session.stand_down_requested() tells a loser it may stop early
    placement = session.register(host, listen_port, timeout_s=startup_timeout_s)
    # -> Placement, or StandDown / StartupTimeout / RoundAborted

:meth:`TreeNode.join <allreduce.node.TreeNode.join>` does the registration and the linking.
"""

from __future__ import annotations

import time
from typing import Any

from . import ciphers
from . import protocol as proto
from .channel import Channel, connect_authenticated
from .errors import PeerTimeout, ProtocolError, RoundAborted, StandDown, StartupTimeout
from .protocol import MsgType
from .topology import Placement

SERVER = "the tree server"
_REPLIES = frozenset({MsgType.TOPOLOGY, MsgType.STAND_DOWN, MsgType.ABORT})
_NOTICES = frozenset({MsgType.STAND_DOWN, MsgType.ABORT})


def _open(address: tuple[str, int], key: bytes, info: dict[str, Any], connect_timeout_s: float,
          handshake_timeout_s: float, io_timeout_s: float, max_frame_bytes: int,
          cipher: str) -> Channel:
    """Connect to the tree server and authenticate as a worker, retrying with backoff and
    jitter within ``connect_timeout_s`` (:func:`~allreduce.channel.connect_authenticated`)."""
    key = proto.check_key(key)
    chan, _ = connect_authenticated(
        address, key, role="worker", expect_role="server", info=info, rank=None, peer=SERVER,
        connect_timeout_s=connect_timeout_s, handshake_timeout_s=handshake_timeout_s,
        io_timeout_s=io_timeout_s, max_frame_bytes=max_frame_bytes, cipher=cipher,
    )
    return chan


class ServerSession:
    """One attempt's authenticated connection to the :class:`~allreduce.server.TreeServer`."""

    def __init__(self, channel: Channel, shard: int, attempt_id: str) -> None:
        self._chan = channel
        self.shard = shard
        self.attempt_id = attempt_id
        self._notice: tuple[MsgType, dict[str, Any]] | None = None
        self._closed = False

    @classmethod
    def connect(
        cls,
        address: tuple[str, int],
        key: bytes,
        *,
        shard: int,
        attempt_id: str | int,
        connect_timeout_s: float = 30.0,
        handshake_timeout_s: float = 10.0,
        io_timeout_s: float = 120.0,
        max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
        cipher: str = ciphers.DEFAULT_CIPHER,
    ) -> ServerSession:
        """Connect to the server and authenticate within the timeouts."""
        attempt_id = str(attempt_id)
        chan = _open(address, key, {"shard": shard, "attempt_id": attempt_id}, connect_timeout_s,
                     handshake_timeout_s, io_timeout_s, max_frame_bytes, cipher)
        return cls(chan, shard, attempt_id)

    def report_progress(self, rows_done: int) -> None:
        """Tell the server how many rows of pass 1 this attempt has processed."""
        self._chan.send_json(
            MsgType.PROGRESS,
            {"shard": self.shard, "attempt_id": self.attempt_id, "rows_done": int(rows_done)},
        )

    def stand_down_requested(self) -> bool:
        """Non-blocking: has the server told this attempt to stop (another attempt won)?

        Raises StartupTimeout / RoundAborted if the server aborted the round.
        """
        self._poll()
        if self._notice is not None and self._notice[0] is MsgType.ABORT:
            _raise_abort(self._notice[1])
        return self._notice is not None and self._notice[0] is MsgType.STAND_DOWN

    def _poll(self) -> None:
        while self._notice is None and self._chan.readable(0.0):
            self._notice = self._chan.recv_control(_NOTICES)

    def register(self, host: str, port: int, *, timeout_s: float) -> Placement:
        """Register as the survivor of this shard, listening at ``(host, port)``.

        Blocks until the tree is formed (returns this rank's placement), another attempt won
        (StandDown), or the round failed (StartupTimeout / RoundAborted); at most ``timeout_s``.
        """
        self._poll()
        if self._notice is None:
            self._chan.send_json(
                MsgType.REGISTER,
                {
                    "shard": self.shard,
                    "attempt_id": self.attempt_id,
                    "host": host,
                    "port": int(port),
                },
            )
            self._chan.set_timeout(timeout_s)
            try:
                self._notice = self._chan.recv_control(_REPLIES)
            except PeerTimeout:
                raise PeerTimeout(
                    None,
                    f"no tree formed within {timeout_s:g} s of registering shard {self.shard}",
                    peer=SERVER,
                ) from None
        mtype, msg = self._notice
        if mtype is MsgType.STAND_DOWN:
            raise StandDown(self.shard, self.attempt_id, str(msg.get("reason", ""))[:500])
        if mtype is MsgType.ABORT:
            _raise_abort(msg)
        placement = Placement.from_json(msg.get("placement") or {})
        if placement.rank != self.shard:
            raise ProtocolError(f"{SERVER} placed shard {self.shard} at rank {placement.rank}")
        return placement

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._chan.close()

    def __enter__(self) -> ServerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise_abort(msg: dict[str, Any]) -> None:
    missing = msg.get("missing_shards")
    if isinstance(missing, list) and all(isinstance(s, int) for s in missing):
        timeout = msg.get("timeout_s")
        raise StartupTimeout(missing, float(timeout) if isinstance(timeout, (int, float)) else None)
    raise RoundAborted(f"{SERVER} aborted the round: {str(msg.get('reason', ''))[:500]}")


__all__ = ["ServerSession"]


class SpareSession:
    """A spare task's connection to the server: poll until told which shard to race, if any."""

    def __init__(self, channel: Channel, spare: int) -> None:
        self._chan = channel
        self.spare = spare

    @classmethod
    def connect(
        cls,
        address: tuple[str, int],
        key: bytes,
        *,
        spare: int,
        connect_timeout_s: float = 30.0,
        handshake_timeout_s: float = 10.0,
        io_timeout_s: float = 120.0,
        max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
        cipher: str = ciphers.DEFAULT_CIPHER,
    ) -> SpareSession:
        chan = _open(address, key, {"spare": int(spare)}, connect_timeout_s, handshake_timeout_s,
                     io_timeout_s, max_frame_bytes, cipher)
        return cls(chan, int(spare))

    def wait_assignment(self, *, poll_s: float, timeout_s: float) -> int | None:
        """The shard this spare should race, or None when no race is needed (tree formed).

        Polls every ``poll_s``; raises PeerTimeout after ``timeout_s`` without a decision.
        """
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                self._chan.send_json(MsgType.SPARE_POLL, {"spare": self.spare})
                _, msg = self._chan.recv_control(frozenset({MsgType.ASSIGN, MsgType.ABORT}))
                if "reason" in msg and "shard" not in msg:
                    _raise_abort(msg)
                shard = msg.get("shard")
                if shard is not None:
                    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
                        raise ProtocolError(f"the tree server assigned an invalid shard {shard!r}")
                    return shard
                if msg.get("done"):
                    return None
                if time.monotonic() + poll_s > deadline:
                    raise PeerTimeout(None, f"no shard assignment within {timeout_s:g} s", peer=SERVER)
                time.sleep(poll_s)
        finally:
            self._chan.close()
