"""Authenticated, sequenced connections: the handshake, the :class:`Channel`, the acceptor.

Handshake (both HELLO frames have sequence number 0 and are HMAC-SHA256 keyed by the attempt
key)::

    client -> server  HELLO {"proto", "role", "nonce", "cipher", ...identity}
    server -> client  HELLO {"proto", "role", "nonce", "cipher", "echo": client nonce, ...}

The server only answers a valid HELLO (at most ``HELLO_MAX_BYTES``) that arrived within
``handshake_timeout_s`` (a deadline for the whole frame, so trickling bytes does not help) and
that its ``accept`` callback approves; anything else (silence, random bytes, an HTTP request,
the wrong key) is closed without an answer. An authenticated HELLO naming another cipher is
answered with the server's cipher (so the client can say why) and refused on both sides with
a ProtocolError naming both ciphers (not retried). Both sides then switch to session keys
derived from both nonces and both HELLOs (:func:`~allreduce.protocol.derive_session_keys`),
seal every frame with the cipher (:mod:`allreduce.ciphers`) and count sequence numbers from 1.
Clients retry refused or unanswered tries with backoff (:func:`connect_authenticated`);
listeners accept with :mod:`allreduce.acceptor`.

A :class:`Channel` is full duplex: one thread may send while another receives. Data frames are
sent with scatter/gather I/O (from the caller's buffer, or from a reused ciphertext buffer with
``aes-gcm``) and received into a preallocated buffer whose exact length is known in advance
(with ``aes-gcm``: a reused ciphertext buffer, decrypted into the caller's), so a data frame
never causes an allocation of its size.

Liveness (tree links, :meth:`Channel.enable_liveness`): HEARTBEAT frames (empty, authenticated
and sequenced like every frame) are sent on an idle link by :meth:`Channel.send_heartbeat` and
taken by whoever reads: a collective's receive, which skips them, or
:meth:`Channel.poll_heartbeats` while nobody reads. A blocked send or receive then waits as
long as the peer is heard from, and gives up after ``heartbeat_timeout_s`` of silence.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import ciphers, endpoints
from . import protocol as proto
from .errors import (
    AuthError,
    PeerAborted,
    PeerLost,
    PeerTimeout,
    ProtocolError,
)
from .protocol import MsgType

log = logging.getLogger(__name__)

PROTO_NAME = "terascale-allreduce/2"
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


def open_listener(host: str, backlog: int = 128, buffer_bytes: int | None = None,
                  port_range: tuple[int, int] | None = None) -> socket.socket:
    """A listening TCP socket on ``host``: an ephemeral port (never a fixed one), or the first
    free port of ``port_range`` (``allreduce.endpoints.listen``)."""
    return endpoints.listen(host, port_range, backlog=backlog, buffer_bytes=buffer_bytes)


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
        cipher: str = ciphers.DEFAULT_CIPHER,
        send_direction: str = "c2s",
    ) -> None:
        self.sock = sock
        self.rank = rank
        self.peer = peer
        self.max_frame_bytes = max_frame_bytes
        self.cipher = ciphers.check_cipher(cipher)
        recv_direction = "s2c" if send_direction == "c2s" else "c2s"
        self._send_fc = ciphers.frame_cipher(cipher, send_key, send_direction)
        self._recv_fc = ciphers.frame_cipher(cipher, recv_key, recv_direction)
        self._tag_bytes = self._send_fc.tag_bytes
        self._heartbeat_bytes = proto.HEADER_BYTES + self._tag_bytes  # a heartbeat: no payload
        # ciphertext buffers (aes-gcm), grown to the largest frame once and reused
        self._seal_buf = bytearray(0)
        self._open_buf = bytearray(0)
        # where a data frame's time goes (see :meth:`perf`): (wall s, thread CPU s) per stage
        self._perf = {k: [0.0, 0.0] for k in ("seal", "send", "recv", "open")}
        self._pending = 0  # frames sealed by seal_data and not yet sent by send_sealed
        self._send_seq = first_seq
        self._recv_seq = first_seq
        self._send_lock = threading.Lock()  # the socket's writing side: one frame at a time
        # _send_seq and _pending: sealing a data frame (seal_data) takes only this lock, so it
        # overlaps the socket write of the frame before it (send_sealed holds the send lock);
        # taken after the send lock where both are held
        self._seq_lock = threading.Lock()
        self._recv_lock = threading.Lock()  # one reader at a time: a collective or poll_heartbeats
        self._header_buf = bytearray(proto.HEADER_BYTES)
        self._tag_buf = bytearray(self._tag_bytes)
        self._closed = False
        # liveness (tree links only, see enable_liveness): None = every call bounded by io_timeout_s
        self._heartbeat_timeout_s: float | None = None
        self._max_wait_s = float("inf")
        self._tail = b""  # the unsent end of a heartbeat that did not fit in the socket buffer
        self._failed: BaseException | None = None  # a bad frame found by poll_heartbeats
        self.last_heard = time.monotonic()  # when the peer last proved it is alive
        self._last_sent = time.monotonic()
        self.set_timeout(io_timeout_s)

    @property
    def who(self) -> str:
        return _who(self.rank, self.peer)

    def perf(self) -> dict[str, float]:
        """Running totals over the data frames of this link, in seconds: ``seal`` (encrypt or
        MAC), ``send`` (socket writes), ``recv`` (socket reads), ``open`` (verify, decrypt),
        each as ``<stage>_s`` (wall) and ``<stage>_cpu_s`` (this thread's CPU, user + system:
        the kernel's copies count; ``recv_s - recv_cpu_s`` is time spent waiting for bytes)."""
        out = {}
        for k, (wall, cpu) in self._perf.items():
            out[f"{k}_s"], out[f"{k}_cpu_s"] = wall, cpu
        return out

    def _clock(self, stage: str, w0: float, c0: float) -> tuple[float, float]:
        w1, c1 = time.perf_counter(), time.thread_time()
        acc = self._perf[stage]
        acc[0] += w1 - w0
        acc[1] += c1 - c0
        return w1, c1

    def set_timeout(self, timeout_s: float) -> None:
        """Bound every later blocking send/receive on this link (call while the link is idle)."""
        self.sock.settimeout(timeout_s)

    # -- liveness --------------------------------------------------------------------------

    def enable_liveness(self, heartbeat_timeout_s: float, max_wait_s: float | None = None) -> None:
        """Wait on this link for as long as the peer is alive (call once, while idle).

        From now on a blocking send or receive gives up only when nothing at all (no byte of
        data, no heartbeat) has come from the peer for ``heartbeat_timeout_s`` (PeerTimeout:
        frozen, or cut off), when the connection closes (PeerLost), or after ``max_wait_s`` in
        one call although the peer is alive (PeerTimeout: alive but stuck). The peer must send
        :meth:`send_heartbeat` at intervals well below ``heartbeat_timeout_s``; frames that
        arrive while nobody reads are taken by :meth:`poll_heartbeats`.
        """
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s!r}")
        self._heartbeat_timeout_s = float(heartbeat_timeout_s)
        self._max_wait_s = float("inf") if max_wait_s is None else float(max_wait_s)
        self.last_heard = time.monotonic()
        # blocking calls wake up this often to check liveness; a timeout also keeps the fd in
        # non-blocking mode, which send_heartbeat relies on
        self.sock.settimeout(min(self._heartbeat_timeout_s / 8, 1.0))

    def _stall(self, what: str, *, receiving: bool) -> Callable[[int], None]:
        """The check a blocked call on a live link runs each time its socket times out."""
        start = time.monotonic()
        seen = [0]
        hb = self._heartbeat_timeout_s
        assert hb is not None

        def check(done: int) -> None:
            now = time.monotonic()
            if receiving and done != seen[0]:  # bytes arrived since the last check
                seen[0] = done
                self.last_heard = now
            elif not receiving:  # a stalled send: the peer's heartbeats wait unread, take them
                self.poll_heartbeats()
            if self._closed:
                raise PeerLost(self.rank, "the link was closed", peer=self.peer)
            silent = now - self.last_heard
            if silent >= hb:
                raise PeerTimeout(
                    self.rank,
                    f"nothing heard from it, not even a heartbeat, for {silent:.1f} s while "
                    f"{what} (allreduce.heartbeat_timeout_s = {hb:g}): the process is frozen "
                    "or gone, or the network to it is cut",
                    peer=self.peer,
                )
            if now - start >= self._max_wait_s:
                raise PeerTimeout(
                    self.rank,
                    f"alive (its heartbeats arrive) but {what} did not finish within "
                    f"allreduce.max_wait_s = {self._max_wait_s:g} s",
                    peer=self.peer,
                )

        return check

    def send_heartbeat(self, min_interval_s: float = 0.0) -> None:
        """Send a HEARTBEAT now if the link is idle; never blocks (call from any thread).

        Skipped while another thread is sending (its bytes prove life), when something was
        sent within ``min_interval_s``, and when the socket buffer is full (the peer is not
        reading, so it is not waiting for proof of life either). A heartbeat that fits only in
        part keeps its tail, sent before anything else on the link.
        """
        if self._closed or self._heartbeat_timeout_s is None:
            return
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            with self._seq_lock:
                if self._pending:  # sealed frames own the next sequence numbers: they go first
                    return
                if self._tail and not self._write_nowait(self._tail):
                    return
                if time.monotonic() - self._last_sent < min_interval_s:
                    return
                if self._send_seq > proto.MAX_SEQ:
                    return
                self._write_nowait(self._small_frame(MsgType.HEARTBEAT, b""), new_frame=True)
        finally:
            self._send_lock.release()

    def _write_nowait(self, data: bytes, new_frame: bool = False) -> bool:
        """Write what fits of ``data`` without blocking (send and sequence locks held); True if
        all of it.

        The fd is non-blocking (the socket has a timeout), so ``os.write`` never waits, where
        ``socket.send`` would wait up to the timeout for room.
        """
        if self._closed:
            return False
        try:
            n = os.write(self.sock.fileno(), data)
        except (BlockingIOError, InterruptedError):
            return False  # nothing written: a new frame is simply not sent
        except OSError:
            return False  # a broken link: the next send or receive reports it
        if new_frame:
            self._send_seq += 1
        self._tail = data[n:]
        self._last_sent = time.monotonic()
        return not self._tail

    def poll_heartbeats(self) -> None:
        """Take the HEARTBEAT frames waiting at the head of the stream; never blocks.

        Runs only while no other thread is receiving on the link (a collective's reader takes
        heartbeats itself); stops at the first frame that is not a complete heartbeat, leaving
        it for the reader. A heartbeat is authenticated and sequence-checked like any frame;
        a bad one is kept and raised by the next receive.
        """
        if self._closed or self._failed is not None or not self._recv_lock.acquire(blocking=False):
            return
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            while poller.poll(0):
                try:
                    head = self.sock.recv(self._heartbeat_bytes, socket.MSG_PEEK)
                except OSError:
                    return
                if len(head) < self._heartbeat_bytes:
                    return  # EOF, or not a whole frame yet: the reader will see it
                try:
                    header = proto.parse_header(head[: proto.HEADER_BYTES])
                except ProtocolError:
                    return
                if header.msg_type is not MsgType.HEARTBEAT or header.length:
                    return
                data = self.sock.recv(self._heartbeat_bytes)  # what was peeked: no wait
                try:
                    if len(data) != self._heartbeat_bytes:
                        raise ProtocolError(f"{self.who}: a heartbeat was cut short")
                    self._check_heartbeat(data[: proto.HEADER_BYTES], header, data[proto.HEADER_BYTES :])
                except ProtocolError as exc:
                    self._failed = exc
                    return
        except (OSError, ValueError):
            return
        finally:
            self._recv_lock.release()

    def _check_heartbeat(self, header_bytes: Any, header: proto.Header, tag: Any) -> None:
        if header.length:
            raise ProtocolError(f"{self.who} sent a HEARTBEAT with a {header.length}-byte payload")
        self._recv_fc.open_into(bytes(header_bytes), tag, bytearray(0), f"a HEARTBEAT from {self.who}")
        proto.check_seq(header.seq, self._recv_seq, self.who)
        self._recv_seq += 1
        self.last_heard = time.monotonic()

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

    def _check_nonce_space(self) -> None:
        if self._send_seq > proto.MAX_SEQ:
            raise ciphers.NonceExhausted(
                f"the link to {self.who} has sent 2^64 frames in this direction: its sequence "
                "numbers (the AEAD nonces) would wrap, so it refuses to send more (reconnect)"
            )

    def _seal(self, header: bytes, view: memoryview) -> tuple[Any, ...]:
        """What follows ``header`` on the wire: ``(ciphertext || tag,)`` or ``(payload, tag)``."""
        fc = self._send_fc
        if not fc.encrypts:
            return view, fc.seal(header, view)
        need = len(view) + self._tag_bytes
        if len(self._seal_buf) < need:
            self._seal_buf = bytearray(need)
        return (fc.seal(header, view, self._seal_buf),)

    def _small_frame(self, msg_type: MsgType, payload: Any) -> bytes:
        """A complete control frame as bytes, with the next sequence number (not consumed)."""
        header = proto.pack_header(msg_type, self._send_seq, len(payload))
        return b"".join([header, *(bytes(b) for b in self._seal(header, memoryview(payload)))])

    def _send_locked(self, msg_type: MsgType, view: memoryview) -> None:
        t = time.perf_counter(), time.thread_time()
        with self._seq_lock:
            self._check_nonce_space()
            header = proto.pack_header(msg_type, self._send_seq, len(view))
            wire = self._seal(header, view)
            self._send_seq += 1  # the frame is cut short only with an error that ends the link
        t = self._clock("seal", *t)
        stall = None
        if self._heartbeat_timeout_s is not None:
            stall = self._stall(f"sending it a {msg_type.name} frame", receiving=False)
        tail, self._tail = self._tail, b""
        proto.send_buffers(
            self.sock, (tail, header, *wire), rank=self.rank, peer=self.peer, stall=stall
        )
        self._clock("send", *t)
        self._last_sent = time.monotonic()

    @property
    def tag_bytes(self) -> int:
        return self._tag_bytes

    @property
    def encrypts(self) -> bool:
        return self._send_fc.encrypts

    def seal_data(self, msg_type: MsgType, view: memoryview, out: Any) -> tuple[Any, ...]:
        """Seal one data frame now, for :meth:`send_sealed` later (sealing overlaps the wire).

        The frame takes the next sequence number. ``out`` (``len(view) + tag_bytes`` bytes)
        receives the ciphertext if the cipher encrypts; otherwise the frame refers to ``view``,
        which must stay unchanged until the frame is sent. Sealed frames must be sent in order,
        by one thread, and sealed by one thread; until they are sent, no heartbeat or ABORT is
        sent on this link. Only the sequence number is taken under a lock (not the send lock):
        the sealing runs while the previous frame is still being written to the socket.
        """
        if len(view) > self.max_frame_bytes:
            raise ProtocolError(
                f"refusing to send a {msg_type.name} frame of {len(view)} bytes (over the limit)"
            )
        t = time.perf_counter(), time.thread_time()
        with self._seq_lock:
            self._check_nonce_space()
            header = proto.pack_header(msg_type, self._send_seq, len(view))
            self._send_seq += 1
            self._pending += 1
        fc = self._send_fc
        if fc.encrypts:
            wire: tuple[Any, ...] = (fc.seal(header, view, out),)
        else:
            wire = (view, fc.seal(header, view))
        self._clock("seal", *t)
        return (header, *wire)

    def send_sealed(self, frame: tuple[Any, ...]) -> None:
        """Send a frame from :meth:`seal_data` (the oldest one not sent yet)."""
        with self._send_lock:
            stall = None
            if self._heartbeat_timeout_s is not None:
                name = MsgType(frame[0][5]).name
                stall = self._stall(f"sending it a {name} frame", receiving=False)
            tail, self._tail = self._tail, b""
            t = time.perf_counter(), time.thread_time()
            try:
                proto.send_buffers(
                    self.sock, (tail, *frame), rank=self.rank, peer=self.peer, stall=stall
                )
            finally:
                with self._seq_lock:
                    self._pending -= 1
            self._clock("send", *t)
            self._last_sent = time.monotonic()

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
            with self._seq_lock:
                if self._send_seq > proto.MAX_SEQ or self._pending:
                    return False
                payload = proto.encode_json({"origin": origin, "reason": reason[:1000]})
                data = self._tail + self._small_frame(MsgType.ABORT, payload)
                try:
                    sent = self.sock.send(data, _MSG_DONTWAIT)
                except OSError:
                    return False
                self._send_seq += 1
                self._tail = b""
                return sent == len(data)
        except ProtocolError:
            return False
        finally:
            self._send_lock.release()

    # -- receiving -------------------------------------------------------------------------

    def recv_control(
        self, allowed: frozenset[MsgType] | set[MsgType]
    ) -> tuple[MsgType, dict[str, Any]]:
        """Receive one control frame of a type in ``allowed`` and return its parsed JSON.

        HEARTBEAT frames before it are taken (authenticated) and skipped.
        """

        def check(header: proto.Header) -> None:
            if header.msg_type not in allowed and header.msg_type is not MsgType.HEARTBEAT:
                raise ProtocolError(
                    f"{self.who} sent {header.msg_type.name}; expected one of {sorted(t.name for t in allowed)}"
                )

        with self._recv_lock:
            self._check_failed()
            while True:
                frame = proto.read_frame(
                    self.sock,
                    self._recv_fc,
                    expected_seq=self._recv_seq,
                    rank=self.rank,
                    peer=self.peer,
                    max_frame_bytes=self.max_frame_bytes,
                    allowed=check,
                )
                self._recv_seq += 1
                self.last_heard = time.monotonic()
                if frame.msg_type is not MsgType.HEARTBEAT:
                    break
                if frame.payload:
                    raise ProtocolError(f"{self.who} sent a HEARTBEAT with a payload")
        return frame.msg_type, proto.decode_json(
            frame.payload, f"{frame.msg_type.name} from {self.who}"
        )

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def recv_data_into(self, msg_type: MsgType, out: memoryview) -> None:
        """Receive one data frame of type ``msg_type`` whose payload is exactly ``len(out)`` bytes.

        The payload lands in ``out`` directly; it must not be used unless this returns (the tag
        is verified last). An ABORT from the peer raises PeerAborted naming the origin rank.
        On a live link (:meth:`enable_liveness`) HEARTBEAT frames before it are taken and
        skipped, and the wait lasts as long as they keep coming.
        """
        hbuf = self._header_buf
        tag = self._tag_buf
        rank, peer = self.rank, self.peer
        with self._recv_lock:
            self._check_failed()
            stall = None
            if self._heartbeat_timeout_s is not None:
                stall = self._stall(f"waiting for its {msg_type.name} frame", receiving=True)
            while True:
                proto.recv_exact(self.sock, memoryview(hbuf), rank=rank, peer=peer, stall=stall)
                header = proto.parse_header(hbuf, max_frame_bytes=self.max_frame_bytes)
                if header.msg_type is not MsgType.HEARTBEAT:
                    break
                if header.length:
                    raise ProtocolError(f"{self.who} sent a HEARTBEAT with a {header.length}-byte payload")
                proto.recv_exact(self.sock, memoryview(tag), rank=rank, peer=peer, stall=stall)
                self._check_heartbeat(hbuf, header, tag)
            if header.msg_type is MsgType.ABORT:
                self._raise_abort(header, bytes(hbuf), stall)
            if header.msg_type is not msg_type:
                raise ProtocolError(
                    f"{self.who} sent {header.msg_type.name}, expected {msg_type.name} (are all ranks in the same collective?)"
                )
            if header.length != len(out):
                raise ProtocolError(
                    f"{self.who} sent a {msg_type.name} frame of {header.length} bytes, expected {len(out)} "
                    "(do all ranks pass arrays of the same length and use the same chunk_bytes?)"
                )
            what = f"a {msg_type.name} frame from {self.who}"
            fc = self._recv_fc
            t = time.perf_counter(), time.thread_time()
            if fc.encrypts:  # ciphertext || tag into the reused buffer, decrypted into ``out``
                need = len(out) + self._tag_bytes
                if len(self._open_buf) < need:
                    self._open_buf = bytearray(need)
                wire = memoryview(self._open_buf)[:need]
                proto.recv_exact(self.sock, wire, rank=rank, peer=peer, stall=stall)
                t = self._clock("recv", *t)
                fc.open_into(bytes(hbuf), wire, out, what)
            else:  # the payload lands in ``out``; the tag is checked after
                proto.recv_exact(self.sock, out, rank=rank, peer=peer, stall=stall)
                proto.recv_exact(self.sock, memoryview(tag), rank=rank, peer=peer, stall=stall)
                t = self._clock("recv", *t)
                fc.open_into(bytes(hbuf), tag, out, what)
            self._clock("open", *t)
            try:
                proto.check_seq(header.seq, self._recv_seq, self.who)
            except ProtocolError:
                ciphers.wipe(out)
                raise
            self._recv_seq += 1
            self.last_heard = time.monotonic()

    def _raise_abort(
        self, header: proto.Header, header_bytes: bytes, stall: Callable[[int], None] | None
    ) -> None:
        rest = bytearray(header.length + self._tag_bytes)  # header.length <= CONTROL_MAX_BYTES
        view = memoryview(rest)
        proto.recv_exact(self.sock, view, rank=self.rank, peer=self.peer, stall=stall)
        payload = bytearray(header.length)
        proto.open_payload(self._recv_fc, header_bytes, view, payload, f"an ABORT from {self.who}")
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
            self.shutdown()  # wakes a blocked sender, which then lets go of the send lock
            # send_heartbeat writes to the raw fd under the send lock: close the fd only when
            # no heartbeat is being written, so a reused fd number is never written to
            locked = self._send_lock.acquire(timeout=1.0)
            try:
                self.sock.close()
            finally:
                if locked:
                    self._send_lock.release()


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
    cipher: str = ciphers.DEFAULT_CIPHER,
) -> tuple[Channel, dict[str, Any]]:
    """Authenticate a freshly connected socket as the client side; returns the channel and
    the server's HELLO. Closes nothing on failure (the caller owns ``sock``)."""
    who = _who(rank, peer)
    ciphers.check_cipher(cipher)
    mac = ciphers.HmacCipher(key)  # HELLO frames: HMAC-SHA256 under the attempt key
    deadline = time.monotonic() + handshake_timeout_s
    nonce = secrets.token_bytes(proto.NONCE_BYTES)
    hello = {**info, "proto": PROTO_NAME, "role": role, "nonce": nonce.hex(), "cipher": cipher}
    payload = proto.encode_json(hello)
    header = proto.pack_header(MsgType.HELLO, 0, len(payload))
    sock.settimeout(handshake_timeout_s)
    proto.send_buffers(sock, (header, payload, mac.seal(header, payload)), rank=rank, peer=peer)

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
    _cipher_check(reply.get("cipher"), cipher, who)
    c2s, s2c = proto.derive_session_keys(
        key, nonce, server_nonce, cipher, payload + frame.payload
    )
    chan = Channel(
        sock,
        rank=rank,
        peer=peer,
        send_key=c2s,
        recv_key=s2c,
        io_timeout_s=io_timeout_s,
        max_frame_bytes=max_frame_bytes,
        cipher=cipher,
        send_direction="c2s",
    )
    return chan, reply


def _cipher_check(theirs: object, mine: str, who: str) -> None:
    """A mixed-cipher pair is refused: ProtocolError naming both ciphers."""
    if theirs != mine:
        raise ProtocolError(
            f"{who} uses allreduce.cipher = {theirs!r} but this side uses {mine!r}: the driver "
            "and every rank of a job must use the same cipher"
        )


def check_hello_header(h: proto.Header) -> None:
    """The first frame of a client must be a small HELLO with sequence number 0."""
    if h.msg_type is not MsgType.HELLO or h.seq != 0:
        raise ProtocolError(f"first frame must be HELLO, got {h.msg_type.name}")
    if h.length > proto.HELLO_MAX_BYTES:
        raise ProtocolError(f"a HELLO of {h.length} bytes is over the limit {proto.HELLO_MAX_BYTES}")


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
    cipher: str = ciphers.DEFAULT_CIPHER,
) -> tuple[Channel, dict[str, Any]]:
    """Authenticate an accepted socket as the server side (blocking; the
    :class:`~allreduce.acceptor.Acceptor` reads HELLOs without blocking, then calls
    :func:`answer_hello`).

    ``accept(client_hello)`` returns ``(rank, peer_name, reply_info)`` for a welcome peer or
    raises to refuse it; it runs only after the HELLO is authenticated.
    """
    deadline = time.monotonic() + handshake_timeout_s
    header = bytearray(proto.HEADER_BYTES)
    who = "an unauthenticated peer"
    proto.recv_exact(sock, memoryview(header), rank=None, peer=who, deadline=deadline)
    h = proto.parse_header(header, max_frame_bytes=max_frame_bytes)
    check_hello_header(h)
    frame = bytearray(proto.HEADER_BYTES + h.length + proto.TAG_BYTES)
    frame[: proto.HEADER_BYTES] = header
    view = memoryview(frame)[proto.HEADER_BYTES :]
    proto.recv_exact(sock, view, rank=None, peer=who, deadline=deadline)
    return answer_hello(
        sock, key, frame, role=role, expect_role=expect_role, accept=accept, deadline=deadline,
        io_timeout_s=io_timeout_s, max_frame_bytes=max_frame_bytes, cipher=cipher,
    )


def answer_hello(
    sock: socket.socket,
    key: bytes,
    frame: Any,
    *,
    role: str,
    expect_role: str,
    accept: Callable[[dict[str, Any]], tuple[int | None, str | None, dict[str, Any]]],
    deadline: float,
    io_timeout_s: float,
    max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
    cipher: str = ciphers.DEFAULT_CIPHER,
) -> tuple[Channel, dict[str, Any]]:
    """Authenticate a client's complete HELLO ``frame``, answer it by ``deadline`` and return
    the channel and the client's HELLO; raises (answering nothing) for anything else."""
    ciphers.check_cipher(cipher)
    decoded = proto.decode_frame(key, frame, expected_seq=0, max_frame_bytes=max_frame_bytes)
    check_hello_header(proto.Header(decoded.msg_type, decoded.seq, len(decoded.payload)))
    hello = proto.decode_json(decoded.payload, "HELLO")
    client_nonce = _hello_check(hello, expect_role, "HELLO")
    nonce = secrets.token_bytes(proto.NONCE_BYTES)
    base = {"proto": PROTO_NAME, "role": role, "nonce": nonce.hex(), "echo": client_nonce.hex()}
    mixed = hello.get("cipher") != cipher
    if mixed:  # an authenticated peer with another cipher: tell it ours, so it can say why
        rank, peer, info = None, None, {}
    else:
        rank, peer, info = accept(hello)
    payload = proto.encode_json({**info, **base, "cipher": cipher})
    header = proto.pack_header(MsgType.HELLO, 0, len(payload))
    remaining = deadline - time.monotonic()
    sock.settimeout(max(remaining, 0.001))
    mac = ciphers.HmacCipher(key)  # HELLO frames: HMAC-SHA256 under the attempt key
    proto.send_buffers(sock, (header, payload, mac.seal(header, payload)), rank=rank, peer=peer)
    if mixed:
        _cipher_check(hello.get("cipher"), cipher, "a HELLO")
    c2s, s2c = proto.derive_session_keys(
        key, client_nonce, nonce, cipher, decoded.payload + payload
    )
    chan = Channel(
        sock,
        rank=rank,
        peer=peer,
        send_key=s2c,
        recv_key=c2s,
        io_timeout_s=io_timeout_s,
        max_frame_bytes=max_frame_bytes,
        cipher=cipher,
        send_direction="s2c",
    )
    return chan, hello


def connect_authenticated(
    address: tuple[str, int],
    key: bytes,
    *,
    role: str,
    expect_role: str,
    info: dict[str, Any],
    rank: int | None,
    peer: str | None,
    connect_timeout_s: float,
    handshake_timeout_s: float,
    io_timeout_s: float,
    max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
    buffer_bytes: int | None = None,
    cipher: str = ciphers.DEFAULT_CIPHER,
) -> tuple[Channel, dict[str, Any]]:
    """Connect and authenticate, retrying with exponential backoff and jitter.

    A try that is refused, reset, closed without an answer (a listener busy with a flood of
    junk connections closes the oldest unauthenticated ones) or not answered within
    ``handshake_timeout_s`` is retried after 50 ms, 100 ms, ... (at most 2 s, times a random
    factor in [0.5, 1]) while ``connect_timeout_s`` has not passed since the first try; the
    last error then says how many tries were made. Protocol and authentication errors (a
    peer that answered wrongly) are not retried.
    """
    deadline = time.monotonic() + connect_timeout_s
    delay = 0.05
    tries = 0
    while True:
        tries += 1
        remaining = deadline - time.monotonic()
        try:
            sock = connect(
                address, rank=rank, peer=peer, timeout_s=max(remaining, 0.001),
                buffer_bytes=buffer_bytes,
            )
            try:
                return client_handshake(
                    sock, key, role=role, expect_role=expect_role, info=info, rank=rank,
                    peer=peer, handshake_timeout_s=handshake_timeout_s, io_timeout_s=io_timeout_s,
                    max_frame_bytes=max_frame_bytes, cipher=cipher,
                )
            except BaseException:
                sock.close()
                raise
        except (PeerLost, PeerTimeout) as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = f"{exc.detail} (gave up after {tries} tries in {connect_timeout_s:g} s)"
                raise type(exc)(exc.rank, detail, peer=exc.peer) from None
            log.debug("connect to %s failed (try %d), retrying: %s", _who(rank, peer), tries, exc)
        time.sleep(min(delay * _jitter.uniform(0.5, 1.0), remaining))
        delay = min(delay * 2, 2.0)


_jitter = random.Random()
