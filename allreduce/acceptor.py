"""The listener side of a handshake: accept everything, authenticate on one thread, bound junk.

One :class:`Acceptor` serves one listening socket (the tree server's, or a rank's listener
that its children connect to). A single thread accepts every connection as soon as it
arrives, so junk never fills the kernel's listen backlog, and reads the HELLOs of all
unauthenticated connections without blocking (one selector, no thread per connection).

Bounds on what an unauthenticated peer can hold:

- at most ``max_pending_per_source`` unauthenticated connections per source address and
  ``max_pending`` in all. A new connection over a bound does not get refused: the oldest
  connection of that source (or of all) that has *sent nothing yet* is closed to make room,
  else the oldest one. Legitimate peers share source addresses with attackers (everything in
  a test comes from 127.0.0.1; pods share NAT addresses), so refusing new connections would
  lock them out, while a legitimate client sends its whole HELLO right after connecting and
  leaves the pending set at once; the rare one closed before it spoke retries with backoff
  (:func:`~allreduce.channel.connect_authenticated`);
- every unauthenticated connection is closed ``handshake_timeout_s`` after it was accepted;
- a HELLO is at most :data:`~allreduce.protocol.HELLO_MAX_BYTES`; its bytes are buffered as
  they arrive (never preallocated from the declared length), so the memory held per
  connection is at most a few KiB beyond the kernel's socket buffers.

A complete HELLO is authenticated (:func:`~allreduce.channel.answer_hello`, HMAC first), the
``accept`` callback approves it, the reply goes out, and ``on_channel(channel, hello)`` runs on
a thread of its own (an authenticated peer, bounded by the number of legitimate peers).
Connections closed unauthenticated are counted in :attr:`Acceptor.rejected`, logged one by one
at DEBUG and summed up at WARNING at most every :data:`REPORT_EVERY_S`.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import ciphers
from . import protocol as proto
from .channel import Channel, answer_hello, check_hello_header, tune_socket
from .errors import AllreduceError, ProtocolError

log = logging.getLogger(__name__)

REPORT_EVERY_S = 10.0
_ACCEPT_BATCH = 256  # accepts per wake-up, so reading HELLOs is never starved by a flood


class _Pending:
    __slots__ = ("sock", "fd", "addr", "source", "deadline", "buf", "need")

    def __init__(self, sock: socket.socket, addr: Any, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # the key in the pending set, also once the socket is closed
        self.addr = addr
        self.source = addr[0] if isinstance(addr, tuple) and addr else str(addr)
        self.deadline = deadline
        self.buf = bytearray()
        self.need = proto.HEADER_BYTES  # bytes of the HELLO frame known so far to be needed


class Acceptor:
    """Accepts and authenticates connections on ``listener`` (see the module docstring).

    ``accept(hello)`` returns ``(rank, peer_name, reply_info)`` or raises to refuse;
    ``on_channel(channel, hello)`` gets each authenticated peer. :meth:`close` stops accepting
    and closes the listener and every unauthenticated connection.
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
        max_pending: int = 1024,
        max_pending_per_source: int = 64,
        cipher: str = ciphers.DEFAULT_CIPHER,
    ) -> None:
        if max_pending < 1 or max_pending_per_source < 1:
            raise ValueError("max_pending and max_pending_per_source must be at least 1")
        self._listener = listener
        self._key = key
        self._name = name
        self._role = role
        self._expect_role = expect_role
        self._accept = accept
        self._on_channel = on_channel
        self._handshake_timeout_s = handshake_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._cipher = ciphers.check_cipher(cipher)
        self._buffer_bytes = buffer_bytes
        self._max_pending = max_pending
        self._max_per_source = max_pending_per_source
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()
        self._per_source: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-accept", daemon=True)
        self._sel: selectors.BaseSelector | None = None
        self._unreported = 0
        self._last_report = time.monotonic()
        self.rejected = 0  # connections closed without authenticating
        self.evicted = 0  # of those, closed to make room under a bound
        self.peak_pending = 0  # most unauthenticated connections held at once

    @property
    def pending(self) -> int:
        """Unauthenticated connections held now."""
        return len(self._pending)

    def start(self) -> Acceptor:
        self._thread.start()
        return self

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        self._listener.setblocking(False)
        with selectors.DefaultSelector() as sel:
            self._sel = sel
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            try:
                while not self._closed:
                    timeout = None
                    if self._pending:
                        first = next(iter(self._pending.values()))
                        timeout = max(first.deadline - time.monotonic(), 0.0)
                    for k, _ in sel.select(timeout):
                        if self._closed or k.fileobj is self._wake_r:
                            return
                        if k.fileobj is self._listener:
                            self._accept_some()
                        elif k.data is not None and self._pending.get(k.data.fd) is k.data:
                            self._read(k.data)
                    self._expire()
                    self._report()
            except Exception:  # noqa: BLE001 - keep the thread's death visible in the logs
                log.exception("%s: the accept loop failed", self._name)
            finally:
                for p in list(self._pending.values()):
                    self._drop(p)
                self._sel = None

    def _accept_some(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: free one held by junk, or back off a moment
                    victim = self._victim(None)
                    if victim is None:
                        time.sleep(0.05)
                        return
                    self._reject(victim, "closed to free a file descriptor", evicted=True)
                    continue
                return
            p = _Pending(sock, addr, time.monotonic() + self._handshake_timeout_s)
            try:
                sock.setblocking(False)
                tune_socket(sock, self._buffer_bytes)
            except OSError:
                sock.close()
                continue
            while self._per_source[p.source] >= self._max_per_source and self._reject(
                self._victim(p.source), "over the per-source bound", evicted=True
            ):
                pass
            while len(self._pending) >= self._max_pending and self._reject(
                self._victim(None), "over the bound", evicted=True
            ):
                pass
            self._pending[p.fd] = p
            self._per_source[p.source] += 1
            self.peak_pending = max(self.peak_pending, len(self._pending))
            assert self._sel is not None
            self._sel.register(sock, selectors.EVENT_READ, p)
            self._read(p)  # a legitimate client's HELLO is usually there already

    def _victim(self, source: str | None) -> _Pending | None:
        """The oldest connection (of ``source``) that sent nothing, else the oldest one."""
        oldest = None
        for p in self._pending.values():
            if source is not None and p.source != source:
                continue
            if not p.buf:
                return p
            if oldest is None:
                oldest = p
        return oldest

    def _read(self, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(p.need - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._reject(p, f"receive failed ({exc})")
            return
        if not chunk:
            self._reject(p, f"closed after {len(p.buf)} bytes")
            return
        p.buf += chunk
        if p.need == proto.HEADER_BYTES and len(p.buf) == proto.HEADER_BYTES:
            try:
                header = proto.parse_header(p.buf, max_frame_bytes=self._max_frame_bytes)
                check_hello_header(header)
            except ProtocolError as exc:
                self._reject(p, str(exc))
                return
            p.need = proto.HEADER_BYTES + header.length + proto.TAG_BYTES
        if len(p.buf) == p.need:
            self._finish(p)

    def _finish(self, p: _Pending) -> None:
        self._forget(p)
        try:
            chan, hello = answer_hello(
                p.sock,
                self._key,
                p.buf,
                role=self._role,
                expect_role=self._expect_role,
                accept=self._accept,
                deadline=p.deadline,
                io_timeout_s=self._io_timeout_s,
                max_frame_bytes=self._max_frame_bytes,
                cipher=self._cipher,
            )
        except (AllreduceError, OSError) as exc:
            self._count(p, str(exc), evicted=False)
            p.sock.close()
            return
        except Exception:  # noqa: BLE001 - a bug in a callback must not stop the listener
            log.exception("%s: handshake with %s failed unexpectedly", self._name, _addr(p.addr))
            self._count(p, "failed unexpectedly", evicted=False)
            p.sock.close()
            return
        with self._lock:
            closed = self._closed
        if closed:
            chan.close()
            return
        threading.Thread(
            target=self._serve, args=(chan, hello, p.addr), name=f"{self._name}-conn", daemon=True
        ).start()

    def _serve(self, chan: Channel, hello: dict[str, Any], addr: Any) -> None:
        try:
            self._on_channel(chan, hello)
        except Exception:  # noqa: BLE001
            log.exception(
                "%s: handling an authenticated connection from %s failed", self._name, _addr(addr)
            )
            chan.close()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self._reject(p, f"no valid HELLO within {self._handshake_timeout_s:g} s")

    # -- bookkeeping ---------------------------------------------------------------------------

    def _forget(self, p: _Pending) -> None:
        if self._pending.pop(p.fd, None) is not None:
            self._per_source[p.source] -= 1
            if not self._per_source[p.source]:
                del self._per_source[p.source]
            if self._sel is not None:
                try:
                    self._sel.unregister(p.sock)
                except (KeyError, ValueError):
                    pass

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        p.sock.close()

    def _reject(self, p: _Pending | None, why: str, *, evicted: bool = False) -> bool:
        if p is None:
            return False
        self._count(p, why, evicted=evicted)  # first: the peer may look as soon as it is closed
        self._drop(p)
        return True

    def _count(self, p: _Pending, why: str, *, evicted: bool) -> None:
        self.rejected += 1
        self.evicted += evicted
        self._unreported += 1
        log.debug("%s: closed an unauthenticated connection from %s: %s", self._name, _addr(p.addr), why)

    def _report(self) -> None:
        now = time.monotonic()
        if self._unreported and now - self._last_report >= REPORT_EVERY_S:
            log.warning(
                "%s: closed %d unauthenticated connection(s) in the last %.0f s "
                "(silence, junk, wrong key or over the bounds; %d held now)",
                self._name,
                self._unreported,
                now - self._last_report,
                len(self._pending),
            )
            self._unreported = 0
            self._last_report = now

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._unreported:
            log.info(
                "%s: closed %d unauthenticated connection(s) since the last report",
                self._name,
                self._unreported,
            )
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()


def _addr(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
