"""The spanning-tree server: survivors register, the first per shard wins, the tree is built.

This is the terascale paper's speculative-execution trick (section 2.3): the tree is formed
only once every shard ``0..K-1`` has a *survivor*, the first attempt of that shard to finish
its first pass and register. Later attempts of the same shard are told to stand down; the
balanced binary tree is built over the survivors only (rank = shard index).

In production the server runs on the Spark driver; here it is a plain object with threads::

    with TreeServer(num_shards=K, key=key, host=driver_host) as server:
        ...  # hand server.address and the key to the tasks
        placements = server.wait_tree(timeout=...)   # or StartupTimeout naming missing shards

Connections must authenticate (a valid HMAC'd HELLO within ``handshake_timeout_s``); junk is
closed without taking a slot, and at most ``max_unauthenticated_per_source`` /
``max_unauthenticated`` connections wait unauthenticated at once (see
:mod:`allreduce.acceptor`: a flood of idle connections cannot lock workers out). Workers may send PROGRESS heartbeats at any time, which the
driver reads through :meth:`TreeServer.progress` / :meth:`TreeServer.slowest_shard` to decide
which shard a spare should race. The key is never logged.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import ciphers
from . import protocol as proto
from .acceptor import Acceptor
from .channel import Channel, open_listener
from .endpoints import dialable
from .errors import (
    AllreduceError,
    PeerLost,
    PeerTimeout,
    ProtocolError,
    RoundAborted,
    StartupTimeout,
)
from .protocol import MsgType
from .topology import Placement, build_tree

log = logging.getLogger(__name__)

WAITING, FORMED, FAILED = "waiting", "formed", "failed"
_WORKER_MESSAGES = frozenset({MsgType.REGISTER, MsgType.PROGRESS})
_SPARE_MESSAGES = frozenset({MsgType.SPARE_POLL})


@dataclass(frozen=True)
class ProgressReport:
    """The latest pass-1 progress of one attempt of one shard."""

    shard: int
    attempt_id: str
    rows_done: int
    age_s: float  # seconds since the report arrived
    survivor: bool  # this attempt is its shard's survivor


def _peer_address(chan: Channel) -> str:
    """``host:port`` of the connection's far end, for the log."""
    try:
        host, port = chan.sock.getpeername()[:2]
    except OSError:
        return "an unknown address"
    return f"{host}:{port}"


class _Worker:
    __slots__ = ("chan", "shard", "attempt_id", "addr", "registered", "done")

    def __init__(self, chan: Channel, shard: int, attempt_id: str, addr: str) -> None:
        self.chan = chan
        self.shard = shard
        self.attempt_id = attempt_id
        self.addr = addr
        self.registered: tuple[str, int] | None = None  # listening endpoint once a survivor
        self.done = False  # told its fate (topology / stand-down / abort)

    def __str__(self) -> str:
        return f"shard {self.shard} attempt {self.attempt_id!r}"


class TreeServer:
    """Collects registrations of ``num_shards`` shards and hands out the tree.

    Binds ``host`` on an ephemeral port, or on the first free port of ``port_range``
    (``allreduce.endpoints.listen``); :attr:`address` is ``(advertise_host or host, port)``, what
    the workers dial (a wildcard ``host`` needs an ``advertise_host``). ``startup_timeout_s`` counts from :meth:`start`: a
    worker may stay silent until then (its whole first pass), but once a frame starts it must
    arrive within ``io_timeout_s``, which also bounds every send to a worker. Connections still
    idle ``io_timeout_s`` after the startup deadline are closed.
    """

    def __init__(
        self,
        num_shards: int,
        key: bytes,
        *,
        host: str = "127.0.0.1",
        handshake_timeout_s: float = 10.0,
        io_timeout_s: float = 120.0,
        startup_timeout_s: float = 600.0,
        max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
        spare_after: int | None = None,
        max_unauthenticated: int = 1024,
        max_unauthenticated_per_source: int = 64,
        cipher: str = ciphers.DEFAULT_CIPHER,
        advertise_host: str = "",
        port_range: tuple[int, int] | None = None,
    ) -> None:
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}")
        if not host:
            raise ValueError("host must name the interface to bind (e.g. the driver host), not ''")
        self.num_shards = num_shards
        self._key = proto.check_key(key)
        self._host = host
        self._advertise = dialable(advertise_host or host, "the tree server's advertised address")
        self._port_range = port_range
        self._handshake_timeout_s = handshake_timeout_s
        self._io_timeout_s = io_timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._cipher = ciphers.check_cipher(cipher)
        self._max_pending = max_unauthenticated
        self._max_pending_per_source = max_unauthenticated_per_source
        self._cond = threading.Condition()
        self._state = WAITING
        self._failure: AllreduceError | None = None
        self._survivors: dict[int, _Worker] = {}
        self._workers: set[_Worker] = set()
        self._progress: dict[tuple[int, str], tuple[int, float]] = {}
        self._placements: list[Placement] | None = None
        self._listener = None
        self._acceptor: Acceptor | None = None
        self._watchdog: threading.Thread | None = None
        self._started = False
        self._closed = False
        self._deadline = 0.0
        # spares race a shard once this many shards have survivors (default: half, rounded up)
        self.spare_after = (num_shards + 1) // 2 if spare_after is None else int(spare_after)
        self._raced: dict[int, int] = {}  # shard -> the spare racing it

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> TreeServer:
        """Bind, start accepting, and start the startup-timeout clock."""
        if self._started:
            raise RuntimeError("the tree server is already started")
        self._started = True
        self._deadline = time.monotonic() + self._startup_timeout_s
        self._listener = open_listener(self._host, port_range=self._port_range)
        self._acceptor = Acceptor(
            self._listener,
            self._key,
            name="tree server",
            role="server",
            expect_role="worker",
            accept=self._accept_hello,
            on_channel=self._serve,
            handshake_timeout_s=self._handshake_timeout_s,
            io_timeout_s=self._io_timeout_s,
            max_frame_bytes=self._max_frame_bytes,
            max_pending=self._max_pending,
            max_pending_per_source=self._max_pending_per_source,
            cipher=self._cipher,
        ).start()
        self._watchdog = threading.Thread(
            target=self._watch, name="tree-server-watchdog", daemon=True
        )
        self._watchdog.start()
        host, port = self.bound_address
        log.info("tree server listening on %s:%d (workers dial %s:%d) for %d shard(s)", host, port,
                 self._advertise, port, self.num_shards)
        return self

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the workers connect to: the advertised host and the bound port."""
        return self._advertise, self.bound_address[1]

    @property
    def bound_address(self) -> tuple[str, int]:
        """``(host, port)`` the listener is bound to (``getsockname``)."""
        if self._listener is None:
            raise RuntimeError("the tree server is not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def rejected_connections(self) -> int:
        """Connections closed because they did not authenticate (junk, probes, wrong key)."""
        return self._acceptor.rejected if self._acceptor is not None else 0

    @property
    def acceptor(self) -> Acceptor | None:
        """The listener's acceptor (its counters: ``rejected``, ``evicted``, ``peak_pending``)."""
        return self._acceptor

    @property
    def state(self) -> str:
        """``"waiting"``, ``"formed"`` or ``"failed"``."""
        with self._cond:
            return self._state

    def wait_tree(self, timeout: float | None = None) -> list[Placement]:
        """Block until the tree is formed and return every rank's placement (index = rank).

        Raises the round's failure (StartupTimeout naming the missing shards, RoundAborted), or
        TimeoutError if ``timeout`` passes first (the round itself goes on).
        """
        with self._cond:
            done = self._cond.wait_for(lambda: self._state != WAITING, timeout)
            if not done:
                raise TimeoutError(
                    f"the tree did not form within {timeout:g} s; unfinished shards: {self._unfinished()}"
                )
            if self._state == FORMED:
                assert self._placements is not None
                return list(self._placements)
            assert self._failure is not None
            raise self._failure

    def fail(self, reason: str) -> None:
        """Abort the round (if the tree is not formed yet) and tell every connected worker."""
        self._fail(RoundAborted(reason))

    def close(self) -> None:
        """Abort a round still waiting, stop accepting, close every connection."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._fail(RoundAborted("the tree server was closed before the tree formed"))
        if self._acceptor is not None:
            self._acceptor.close()
        with self._cond:
            workers = list(self._workers)
            self._cond.notify_all()
        for w in workers:
            w.chan.close()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5.0)

    def __enter__(self) -> TreeServer:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries for the driver ------------------------------------------------------------

    def unfinished_shards(self) -> list[int]:
        """Shards without a survivor yet, ascending."""
        with self._cond:
            return self._unfinished()

    def _unfinished(self) -> list[int]:
        return [s for s in range(self.num_shards) if s not in self._survivors]

    def survivors(self) -> dict[int, str]:
        """``{shard: attempt_id}`` of the registered survivors."""
        with self._cond:
            return {s: w.attempt_id for s, w in sorted(self._survivors.items())}

    def endpoints(self) -> dict[int, tuple[str, int]]:
        """``{shard: (host, port)}``: where each registered survivor listens for its children."""
        with self._cond:
            return {s: w.registered for s, w in sorted(self._survivors.items()) if w.registered}

    def progress(self) -> list[ProgressReport]:
        """The latest PROGRESS of every (shard, attempt) heard from, sorted by shard."""
        now = time.monotonic()
        with self._cond:
            return [
                ProgressReport(
                    s, a, rows, now - t, s in self._survivors and self._survivors[s].attempt_id == a
                )
                for (s, a), (rows, t) in sorted(self._progress.items())
            ]

    def slowest_shard(self) -> int | None:
        """The unfinished shard whose best attempt has done the fewest rows (None if none).

        Shards never heard from count as 0 rows; ties go to the lowest shard index.
        """
        with self._cond:
            unfinished = self._unfinished()
            if not unfinished:
                return None
            best = {s: 0 for s in unfinished}
            for (s, _), (rows, _) in self._progress.items():
                if s in best:
                    best[s] = max(best[s], rows)
            return min(unfinished, key=lambda s: (best[s], s))

    # -- connections -----------------------------------------------------------------------

    def _accept_hello(self, hello: dict[str, Any]) -> tuple[int | None, str | None, dict[str, Any]]:
        if "spare" in hello:
            spare = hello["spare"]
            if isinstance(spare, bool) or not isinstance(spare, int) or not 0 <= spare < 1 << 20:
                raise ProtocolError(f"HELLO names an invalid spare {spare!r}")
            return None, f"spare {spare}", {"num_shards": self.num_shards}
        shard, attempt = hello.get("shard"), hello.get("attempt_id")
        if (
            isinstance(shard, bool)
            or not isinstance(shard, int)
            or not 0 <= shard < self.num_shards
        ):
            raise ProtocolError(f"HELLO names shard {shard!r}, not in 0..{self.num_shards - 1}")
        if not isinstance(attempt, str) or not 0 < len(attempt) <= 200:
            raise ProtocolError(f"HELLO of shard {shard} has an invalid attempt_id")
        return None, f"shard {shard} attempt {attempt!r}", {"num_shards": self.num_shards}

    def _serve(self, chan: Channel, hello: dict[str, Any]) -> None:
        """Handle one authenticated worker (runs on its handshake thread until it leaves)."""
        if "spare" in hello:
            self._serve_spare(chan, int(hello["spare"]))
            return
        w = _Worker(chan, hello["shard"], hello["attempt_id"], _peer_address(chan))
        with self._cond:
            self._workers.add(w)
            failed = self._failure if self._state == FAILED else None
            winner = self._survivors.get(w.shard)
            formed = self._state == FORMED
        log.debug("tree server: %s connected from %s", w, w.addr)
        if failed is not None:
            self._send_abort(w, failed)
        elif winner is not None or formed:  # a spare for a shard that is already won
            w.done = True
            why = (
                f"attempt {winner.attempt_id!r} registered first"
                if winner
                else "the tree is formed"
            )
            log.info("tree server: %s told to stand down (%s)", w, why)
            self._send(w, MsgType.STAND_DOWN, {"shard": w.shard, "reason": why})
        try:
            while True:
                # Idle until the startup deadline (plus io_timeout_s of grace, so the round's
                # outcome reaches the worker first) at most; a frame itself within io_timeout_s.
                idle_s = max(self._deadline - time.monotonic(), 0.0) + self._io_timeout_s
                if not chan.readable(idle_s):
                    raise PeerTimeout(None, "silent past the startup deadline", peer=str(w))
                mtype, msg = chan.recv_control(_WORKER_MESSAGES)
                if msg.get("shard") != w.shard or msg.get("attempt_id") != w.attempt_id:
                    raise ProtocolError(
                        f"{w} sent a {mtype.name} for shard {msg.get('shard')!r} "
                        f"attempt {msg.get('attempt_id')!r}"
                    )
                if mtype is MsgType.PROGRESS:
                    self._on_progress(w, msg)
                else:
                    self._on_register(w, msg)
        except AllreduceError as exc:
            quiet = w.done or (isinstance(exc, (PeerLost, PeerTimeout)) and not w.registered)
            log.log(logging.DEBUG if quiet else logging.WARNING, "tree server: %s left: %s", w, exc)
        finally:
            self._drop(w)
            chan.close()

    # -- spares: speculative execution inside the barrier stage ----------------------------

    def _serve_spare(self, chan: Channel, spare: int) -> None:
        """Answer a spare's polls: the shard to race, ``done`` once no race is worth it."""
        # once per spare and job: where the spares run (which host may take a straggler's shard)
        log.info("tree server: spare %d connected from %s", spare, _peer_address(chan))
        try:
            while True:
                idle_s = max(self._deadline - time.monotonic(), 0.0) + self._io_timeout_s
                if not chan.readable(idle_s):
                    raise PeerTimeout(None, "silent past the startup deadline", peer=f"spare {spare}")
                _, msg = chan.recv_control(_SPARE_MESSAGES)
                shard, done = self._assign_spare(spare)
                chan.send_json(MsgType.ASSIGN, {"shard": shard, "done": done})
                if shard is not None or done:
                    return
        except AllreduceError as exc:
            log.debug("tree server: spare %d left: %s", spare, exc)
        finally:
            chan.close()

    def _assign_spare(self, spare: int) -> tuple[int | None, bool]:
        """(shard, done): race the slowest unraced unfinished shard once enough shards finished.

        A spare starts racing when at least ``spare_after`` of the shards have a survivor, so
        it takes a real straggler rather than whichever shard started last.
        """
        with self._cond:
            if self._state != WAITING:
                return None, True
            unfinished = [s for s in self._unfinished() if s not in self._raced]
            if not unfinished:
                return None, not self._unfinished()
            if len(self._survivors) < self.spare_after:
                return None, False
            best = {s: 0 for s in unfinished}
            for (s, _), (rows, _) in self._progress.items():
                if s in best:
                    best[s] = max(best[s], rows)
            shard = min(unfinished, key=lambda s: (best[s], s))
            self._raced[shard] = spare
        log.info("tree server: spare %d races shard %d (rows done by its slowest attempt: %d)", spare, shard, best[shard])
        return shard, False

    def _on_progress(self, w: _Worker, msg: dict[str, Any]) -> None:
        rows = msg.get("rows_done")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ProtocolError(f"{w} sent an invalid rows_done {rows!r}")
        with self._cond:
            self._progress[(w.shard, w.attempt_id)] = (rows, time.monotonic())

    def _on_register(self, w: _Worker, msg: dict[str, Any]) -> None:
        host, port = msg.get("host"), msg.get("port")
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            raise ProtocolError(f"{w} registered an invalid host")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ProtocolError(f"{w} registered an invalid port {port!r}")
        topology: list[tuple[_Worker, Placement]] = []
        stand_down: list[tuple[_Worker, str]] = []
        with self._cond:
            if self._state == FAILED:
                failure = self._failure
            else:
                failure = None
                winner = self._survivors.get(w.shard)
                if self._state == FORMED or winner is not None:
                    why = (
                        f"attempt {winner.attempt_id!r} registered first"
                        if winner
                        else "the tree is formed"
                    )
                    stand_down.append((w, why))
                else:
                    w.registered = (host, port)
                    self._survivors[w.shard] = w
                    log.info(
                        "tree server: %s registered as the survivor (listening on %s:%d); %d of %d shards",
                        w,
                        host,
                        port,
                        len(self._survivors),
                        self.num_shards,
                    )
                    why = f"attempt {w.attempt_id!r} registered first"
                    stand_down += [
                        (o, why)
                        for o in self._workers
                        if o.shard == w.shard and o is not w and not o.done
                    ]
                    if len(self._survivors) == self.num_shards:
                        topology, more = self._form_tree()
                        stand_down += more
        if failure is not None:
            self._send_abort(w, failure)
        for loser, why in stand_down:
            loser.done = True
            log.info("tree server: %s told to stand down (%s)", loser, why)
            self._send(loser, MsgType.STAND_DOWN, {"shard": loser.shard, "reason": why})
        for survivor, placement in topology:
            self._send(survivor, MsgType.TOPOLOGY, {"placement": placement.to_json()})

    def _form_tree(self) -> tuple[list[tuple[_Worker, Placement]], list[tuple[_Worker, str]]]:
        """Build the tree over the survivors (lock held); returns the messages to send."""
        ranked = [self._survivors[s] for s in range(self.num_shards)]
        placements = build_tree([w.registered for w in ranked])  # type: ignore[misc]
        self._placements = placements
        self._state = FORMED
        self._cond.notify_all()
        for w in ranked:
            w.done = True
        losers = [(o, "the tree is formed") for o in self._workers if not o.done]
        log.info(
            "tree server: tree formed over %d rank(s): %s",
            len(ranked),
            ", ".join(f"{p.rank}<-{[c.rank for c in p.children]}" for p in placements[:16])
            + (" ..." if len(placements) > 16 else ""),
        )
        return list(zip(ranked, placements, strict=True)), losers

    def _drop(self, w: _Worker) -> None:
        with self._cond:
            self._workers.discard(w)
            if self._state == WAITING and self._survivors.get(w.shard) is w:
                del self._survivors[w.shard]
                log.warning(
                    "tree server: survivor %s disconnected before the tree formed; "
                    "shard %d is unfinished again",
                    w,
                    w.shard,
                )

    def _send(self, w: _Worker, mtype: MsgType, obj: dict[str, Any]) -> None:
        try:
            w.chan.send_json(mtype, obj)
        except AllreduceError as exc:
            log.warning("tree server: could not send %s to %s: %s", mtype.name, w, exc)

    def _send_abort(self, w: _Worker, failure: AllreduceError) -> None:
        w.done = True
        msg: dict[str, Any] = {"origin": None, "reason": str(failure)}
        if isinstance(failure, StartupTimeout):
            msg["missing_shards"] = list(failure.missing_shards)
            msg["timeout_s"] = failure.timeout_s
        self._send(w, MsgType.ABORT, msg)

    # -- failure ---------------------------------------------------------------------------

    def _watch(self) -> None:
        with self._cond:
            self._cond.wait_for(
                lambda: self._state != WAITING or self._closed, self._startup_timeout_s
            )
            if self._state != WAITING or self._closed:
                return
            missing = self._unfinished()
        self._fail(StartupTimeout(missing, self._startup_timeout_s))

    def _fail(self, failure: AllreduceError) -> None:
        with self._cond:
            if self._state != WAITING:
                return
            self._state = FAILED
            self._failure = failure
            workers = list(self._workers)
            self._cond.notify_all()
        log.error("tree server: round failed: %s", failure)
        for w in workers:
            self._send_abort(w, failure)
