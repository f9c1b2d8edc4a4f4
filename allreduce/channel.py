"""Authenticated, sequenced connections: the handshake, the :class:`Channel`, the acceptor.

Handshake (both HELLO frames have sequence number 0 and are keyed by the attempt key)::

    client -> server  HELLO {"proto", "role", "nonce", ...identity}
    server -> client  HELLO {"proto", "role", "nonce", "echo": client nonce, ...}

The server only answers a valid HELLO that arrived within ``handshake_timeout_s`` (a deadline
for the whole frame, so trickling bytes does not help) and that its ``accept`` callback
approves; anything else (silence, random bytes, an HTTP request, the wrong key) is closed
without an answer. Both sides then switch to session keys derived from both nonces
(:func:`~allreduce.protocol.derive_session_keys`) and count sequence numbers from 1.

A :class:`Channel` is full duplex: one thread may send while another receives. Data frames are
sent with scatter/gather I/O from the caller's buffer and received into a preallocated buffer
whose exact length is known in advance, so a data frame never causes an allocation.
"""

from __future__ import annotations

import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import protocol as proto
from .errors import (
    AllreduceError,
    AuthError,
    PeerAborted,
    PeerError,
    PeerLost,
    PeerTimeout,
    ProtocolError,
)
from .protocol import MsgType

log = logging.getLogger(__name__)

PROTO_NAME = "terascale-allreduce/1"
_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def _who(rank: int | None, peer: str | None) -> str:
    if peer:
        return peer
    return "an unidentified peer" if rank is None else f"rank {rank}"


def tune_socket(sock: socket.socket, buffer_bytes: int | None = None) -> None:
    """TCP_NODELAY (small control frames must not wait) and, if asked, fixed socket buffers.

    Leave ``buffer_bytes`` as None in production: fixing SO_SNDBUF/SO_RCVBUF disables Linux's
    buffer autotuning. Tests pass a tiny size (4 KiB) to exercise partial sends and receives.
    """
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def open_listener(host: str, backlog: int = 128, buffer_bytes: int | None = None) -> socket.socket:
    """A listening TCP socket on ``host`` and an ephemeral port (never a fixed one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if buffer_bytes is not None:  # inherited by accepted sockets; set before listen()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.bind((host, 0))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(
    address: tuple[str, int],
    *,
    rank: int | None,
    peer: str | None,
    timeout_s: float,
    buffer_bytes: int | None = None,
) -> socket.socket:
    """Open a TCP connection within ``timeout_s``; failures name the peer."""
    host, port = address
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PeerLost(rank, f"cannot resolve {host}:{port} ({exc})", peer=peer) from None
    last: Exception | None = None
    deadline = time.monotonic() + timeout_s
    for family, socktype, protonum, _, sockaddr in infos:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sock = socket.socket(family, socktype, protonum)
        try:
            if buffer_bytes is not None:  # before connect, so the window is sized from the start
                tune_socket(sock, buffer_bytes)
            sock.settimeout(remaining)
            sock.connect(sockaddr)
            tune_socket(sock, buffer_bytes)
            return sock
        except TimeoutError as exc:
            sock.close()
            last = exc
        except OSError as exc:
            sock.close()
            last = exc
    if isinstance(last, TimeoutError) or last is None:
        raise PeerTimeout(
            rank, f"connect to {host}:{port} did not finish within {timeout_s:g} s", peer=peer
        )
    raise PeerLost(rank, f"cannot connect to {host}:{port} ({last})", peer=peer)


class Channel:
    """One authenticated, sequenced, full-duplex link to a peer.

    ``rank``/``peer`` name the other side in every error. Every send and receive is bounded by
    ``io_timeout_s`` (the socket timeout). At most one thread may send and one receive at a
    time; :meth:`try_send_abort` may be called from any thread and never blocks.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        rank: int | None,
        peer: str | None,
        send_key: bytes,
        recv_key: bytes,
        io_timeout_s: float,
        max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
        first_seq: int = 1,
    ) -> None:
        self.sock = sock
        self.rank = rank
        self.peer = peer
        self.max_frame_bytes = max_frame_bytes
        self._send_mac = proto.Mac(send_key)
        self._recv_mac = proto.Mac(recv_key)
        self._send_seq = first_seq
        self._recv_seq = first_seq
        self._send_lock = threading.Lock()
        self._header_buf = bytearray(proto.HEADER_BYTES)
        self._tag_buf = bytearray(proto.TAG_BYTES)
        self._closed = False
        self.set_timeout(io_timeout_s)

    @property
    def who(self) -> str:
        return _who(self.rank, self.peer)

    def set_timeout(self, timeout_s: float) -> None:
        """Bound every later blocking send/receive on this link (call while the link is idle)."""
        self.sock.settimeout(timeout_s)

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg_type: MsgType, payload: Any = b"") -> None:
        """Send one frame; ``payload`` is any contiguous buffer (sent without copying)."""
        view = memoryview(payload).cast("B")
        if len(view) > (
            proto.CONTROL_MAX_BYTES if msg_type in proto.CONTROL_TYPES else self.max_frame_bytes
        ):
            raise ProtocolError(
                f"refusing to send a {msg_type.name} frame of {len(view)} bytes (over the limit)"
            )
        with self._send_lock:
            self._send_locked(msg_type, view)

    def _send_locked(self, msg_type: MsgType, view: memoryview) -> None:
        header = proto.pack_header(msg_type, self._send_seq, len(view))
        tag = self._send_mac.tag(header, view)
        proto.send_buffers(self.sock, (header, view, tag), rank=self.rank, peer=self.peer)
        self._send_seq += 1

    def send_json(self, msg_type: MsgType, obj: dict[str, Any]) -> None:
        self.send(msg_type, proto.encode_json(obj))

    def try_send_abort(self, origin: int | None, reason: str) -> bool:
        """Best effort: send ABORT now if the link is idle and has room; never blocks.

        Returns False if another thread is mid-frame on this link or the frame did not fit in
        the socket buffer (a partial ABORT is then cut short by closing the link).
        """
        if self._closed or not self._send_lock.acquire(blocking=False):
            return False
        try:
            payload = proto.encode_json({"origin": origin, "reason": reason[:1000]})
            header = proto.pack_header(MsgType.ABORT, self._send_seq, len(payload))
            data = header + payload + self._send_mac.tag(header, payload)
            try:
                sent = self.sock.send(data, _MSG_DONTWAIT)
            except OSError:
                return False
            self._send_seq += 1
            return sent == len(data)
        except ProtocolError:
            return False
        finally:
            self._send_lock.release()

    # -- receiving -------------------------------------------------------------------------

    def recv_control(
        self, allowed: frozenset[MsgType] | set[MsgType]
    ) -> tuple[MsgType, dict[str, Any]]:
        """Receive one control frame of a type in ``allowed`` and return its parsed JSON."""

        def check(header: proto.Header) -> None:
            if header.msg_type not in allowed:
                raise ProtocolError(
                    f"{self.who} sent {header.msg_type.name}; expected one of {sorted(t.name for t in allowed)}"
                )

        frame = proto.read_frame(
            self.sock,
            self._recv_mac,
            expected_seq=self._recv_seq,
            rank=self.rank,
            peer=self.peer,
            max_frame_bytes=self.max_frame_bytes,
            allowed=check,
        )
        self._recv_seq += 1
        return frame.msg_type, proto.decode_json(
            frame.payload, f"{frame.msg_type.name} from {self.who}"
        )

    def recv_data_into(self, msg_type: MsgType, out: memoryview) -> None:
        """Receive one data frame of type ``msg_type`` whose payload is exactly ``len(out)`` bytes.

        The payload lands in ``out`` directly; it must not be used unless this returns (the tag
        is verified last). An ABORT from the peer raises PeerAborted naming the origin rank.
        """
        hbuf = self._header_buf
        proto.recv_exact(self.sock, memoryview(hbuf), rank=self.rank, peer=self.peer)
        header = proto.parse_header(hbuf, max_frame_bytes=self.max_frame_bytes)
        if header.msg_type is MsgType.ABORT:
            self._raise_abort(header, bytes(hbuf))
        if header.msg_type is not msg_type:
            raise ProtocolError(
                f"{self.who} sent {header.msg_type.name}, expected {msg_type.name} (are all ranks in the same collective?)"
            )
        if header.length != len(out):
            raise ProtocolError(
                f"{self.who} sent a {msg_type.name} frame of {header.length} bytes, expected {len(out)} "
                "(do all ranks pass arrays of the same length and use the same chunk_bytes?)"
            )
        proto.recv_exact(self.sock, out, rank=self.rank, peer=self.peer)
        tag = self._tag_buf
        proto.recv_exact(self.sock, memoryview(tag), rank=self.rank, peer=self.peer)
        proto.verify_tag(
            self._recv_mac.tag(bytes(hbuf), out), tag, f"a {msg_type.name} frame from {self.who}"
        )
        proto.check_seq(header.seq, self._recv_seq, self.who)
        self._recv_seq += 1

    def _raise_abort(self, header: proto.Header, header_bytes: bytes) -> None:
        rest = bytearray(header.length + proto.TAG_BYTES)
        view = memoryview(rest)
        proto.recv_exact(self.sock, view, rank=self.rank, peer=self.peer)
        payload = view[: header.length]
        proto.verify_tag(
            self._recv_mac.tag(header_bytes, payload),
            view[header.length :],
            f"an ABORT from {self.who}",
        )
        proto.check_seq(header.seq, self._recv_seq, self.who)
        self._recv_seq += 1
        msg = proto.decode_json(bytes(payload), f"ABORT from {self.who}")
        origin = msg.get("origin")
        origin = origin if isinstance(origin, int) and not isinstance(origin, bool) else self.rank
        raise PeerAborted(origin, str(msg.get("reason", ""))[:1000])

    def readable(self, timeout_s: float = 0.0) -> bool:
        """Whether a frame (or EOF) is waiting to be read, without blocking past ``timeout_s``."""
        try:
            if self._closed:
                raise ValueError("closed")
            with selectors.DefaultSelector() as sel:
                sel.register(self.sock, selectors.EVENT_READ)
                return bool(sel.select(timeout_s))
        except (ValueError, OSError):
            raise PeerLost(self.rank, "the link is closed", peer=self.peer) from None

    # -- closing ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Wake up any thread blocked on this link (it then sees PeerLost); idempotent."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shutdown()
            self.sock.close()


# ---------------------------------------------------------------------------------------------
# Handshake


def _hello_check(hello: dict[str, Any], role: str, who: str) -> bytes:
    if hello.get("proto") != PROTO_NAME:
        raise ProtocolError(f"{who}: unexpected protocol {hello.get('proto')!r}")
    if hello.get("role") != role:
        raise ProtocolError(
            f"{who}: expected a HELLO from a {role}, got role {hello.get('role')!r}"
        )
    nonce = hello.get("nonce")
    try:
        raw = bytes.fromhex(nonce) if isinstance(nonce, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != proto.NONCE_BYTES:
        raise ProtocolError(f"{who}: HELLO has no valid nonce")
    return raw


def client_handshake(
    sock: socket.socket,
    key: bytes,
    *,
    role: str,
    expect_role: str,
    info: dict[str, Any],
    rank: int | None,
    peer: str | None,
    handshake_timeout_s: float,
    io_timeout_s: float,
    max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
) -> tuple[Channel, dict[str, Any]]:
    """Authenticate a freshly connected socket as the client side; returns the channel and
    the server's HELLO. Closes nothing on failure (the caller owns ``sock``)."""
    who = _who(rank, peer)
    mac = proto.Mac(key)
    deadline = time.monotonic() + handshake_timeout_s
    nonce = secrets.token_bytes(proto.NONCE_BYTES)
    hello = {**info, "proto": PROTO_NAME, "role": role, "nonce": nonce.hex()}
    payload = proto.encode_json(hello)
    header = proto.pack_header(MsgType.HELLO, 0, len(payload))
    sock.settimeout(handshake_timeout_s)
    proto.send_buffers(sock, (header, payload, mac.tag(header, payload)), rank=rank, peer=peer)

    def only_hello(h: proto.Header) -> None:
        if h.msg_type is MsgType.ABORT:
            raise PeerLost(rank, "refused the connection", peer=peer)
        if h.msg_type is not MsgType.HELLO:
            raise ProtocolError(f"{who} answered the handshake with {h.msg_type.name}")

    frame = proto.read_frame(
        sock,
        mac,
        expected_seq=0,
        rank=rank,
        peer=peer,
        deadline=deadline,
        max_frame_bytes=max_frame_bytes,
        allowed=only_hello,
    )
    reply = proto.decode_json(frame.payload, f"HELLO from {who}")
    server_nonce = _hello_check(reply, expect_role, who)
    if reply.get("echo") != nonce.hex():
        raise AuthError(f"{who}: HELLO reply is not bound to this connection")
    c2s, s2c = proto.derive_session_keys(key, nonce, server_nonce)
    chan = Channel(
        sock,
        rank=rank,
        peer=peer,
        send_key=c2s,
        recv_key=s2c,
        io_timeout_s=io_timeout_s,
        max_frame_bytes=max_frame_bytes,
    )
    return chan, reply


def server_handshake(
    sock: socket.socket,
    key: bytes,
    *,
    role: str,
    expect_role: str,
    accept: Callable[[dict[str, Any]], tuple[int | None, str | None, dict[str, Any]]],
    handshake_timeout_s: float,
    io_timeout_s: float,
    max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
) -> tuple[Channel, dict[str, Any]]:
    """Authenticate an accepted socket as the server side.

    ``accept(client_hello)`` returns ``(rank, peer_name, reply_info)`` for a welcome peer or
    raises to refuse it; it runs only after the HELLO is authenticated.
    """
    mac = proto.Mac(key)
    deadline = time.monotonic() + handshake_timeout_s

    def only_hello(h: proto.Header) -> None:
        if h.msg_type is not MsgType.HELLO or h.seq != 0:
            raise ProtocolError(f"first frame must be HELLO, got {h.msg_type.name}")

    frame = proto.read_frame(
        sock,
        mac,
        expected_seq=0,
        rank=None,
        peer="an unauthenticated peer",
        deadline=deadline,
        max_frame_bytes=max_frame_bytes,
        allowed=only_hello,
    )
    hello = proto.decode_json(frame.payload, "HELLO")
    client_nonce = _hello_check(hello, expect_role, "HELLO")
    rank, peer, info = accept(hello)
    nonce = secrets.token_bytes(proto.NONCE_BYTES)
    reply = {
        **info,
        "proto": PROTO_NAME,
        "role": role,
        "nonce": nonce.hex(),
        "echo": client_nonce.hex(),
    }
    payload = proto.encode_json(reply)
    header = proto.pack_header(MsgType.HELLO, 0, len(payload))
    remaining = deadline - time.monotonic()
    sock.settimeout(max(remaining, 0.001))
    proto.send_buffers(sock, (header, payload, mac.tag(header, payload)), rank=rank, peer=peer)
    c2s, s2c = proto.derive_session_keys(key, client_nonce, nonce)
    chan = Channel(
        sock,
        rank=rank,
        peer=peer,
        send_key=s2c,
        recv_key=c2s,
        io_timeout_s=io_timeout_s,
        max_frame_bytes=max_frame_bytes,
    )
    return chan, hello


class Acceptor:
    """Accepts connections on a listening socket and authenticates each in its own thread.

    Junk (silence, garbage, wrong key, a HELLO that ``accept`` refuses) is logged and closed;
    it never reaches ``on_channel``. At most ``max_pending`` handshakes run at once; a
    connection beyond that is closed at once (a flood cannot exhaust threads). :meth:`close`
    stops accepting and closes the listener and every handshake still in progress.
    ``accept``/``on_channel`` run on handshake threads.
    """

    def __init__(
        self,
        listener: socket.socket,
        key: bytes,
        *,
        name: str,
        role: str,
        expect_role: str,
        accept: Callable[[dict[str, Any]], tuple[int | None, str | None, dict[str, Any]]],
        on_channel: Callable[[Channel, dict[str, Any]], None],
        handshake_timeout_s: float,
        io_timeout_s: float,
        max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
        buffer_bytes: int | None = None,
        max_pending: int = 256,
    ) -> None:
        self._listener = listener
        self._max_pending = max_pending
        self._key = key
        self._name = name
        self._role = role
        self._expect_role = expect_role
        self._accept = accept
        self._on_channel = on_channel
        self._handshake_timeout_s = handshake_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._pending: set[socket.socket] = set()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-accept", daemon=True)
        self.rejected = 0  # connections closed without authenticating (for tests and logs)

    def start(self) -> Acceptor:
        self._thread.start()
        return self

    def _loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                # Blocks until a connection arrives or close() writes to the wake-up pair.
                events = sel.select()
                if self._closed or any(k.fileobj is self._wake_r for k, _ in events):
                    return
                try:
                    sock, addr = self._listener.accept()
                except OSError:
                    if self._closed:
                        return
                    continue
                with self._lock:
                    if self._closed:
                        sock.close()
                        return
                    if len(self._pending) >= self._max_pending:
                        self.rejected += 1
                        log.warning(
                            "%s: %d handshakes in progress; closed the connection from %s",
                            self._name,
                            len(self._pending),
                            _addr(addr),
                        )
                        sock.close()
                        continue
                    self._pending.add(sock)
                threading.Thread(
                    target=self._handshake,
                    args=(sock, addr),
                    name=f"{self._name}-handshake",
                    daemon=True,
                ).start()

    def _handshake(self, sock: socket.socket, addr: Any) -> None:
        try:
            tune_socket(sock, self._buffer_bytes)
            chan, hello = server_handshake(
                sock,
                self._key,
                role=self._role,
                expect_role=self._expect_role,
                accept=self._accept,
                handshake_timeout_s=self._handshake_timeout_s,
                io_timeout_s=self._io_timeout_s,
                max_frame_bytes=self._max_frame_bytes,
            )
        except (AllreduceError, OSError) as exc:
            with self._lock:
                self._pending.discard(sock)
                self.rejected += 1
            level = logging.DEBUG if isinstance(exc, PeerError) else logging.WARNING
            log.log(
                level,
                "%s: closed an unauthenticated connection from %s: %s",
                self._name,
                _addr(addr),
                exc,
            )
            sock.close()
            return
        except Exception:
            with self._lock:
                self._pending.discard(sock)
                self.rejected += 1
            log.exception("%s: handshake with %s failed unexpectedly", self._name, _addr(addr))
            sock.close()
            return
        with self._lock:
            self._pending.discard(sock)
            closed = self._closed
        if closed:
            chan.close()
            return
        try:
            self._on_channel(chan, hello)
        except Exception:
            log.exception(
                "%s: handling an authenticated connection from %s failed", self._name, _addr(addr)
            )
            chan.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        for sock in pending:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()


def _addr(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
