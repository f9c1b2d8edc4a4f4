"""A node of the spanning tree: joins the tree, then runs pipelined collectives over it.

AllReduce (sum) runs in chunks of ``chunk_bytes``. For each chunk, a node receives each
child's partial sum (children in fixed order: ``2r+1`` then ``2r+2``), adds it to its own
chunk and sends the result to its parent; the root's sum then flows down the tree chunk by
chunk. Reduce and broadcast are pipelined: a helper thread carries the downward flow, so the
reduction of chunk ``i+1`` overlaps the transfer of chunk ``i`` down the tree. With
``overlap`` (the default) every outgoing link also has a writer thread: chunk ``k+1`` is sealed
(encrypted, with ``aes-gcm``) while chunk ``k`` is on the wire, and received chunks are
decrypted and added while the next ones arrive in the kernel's socket buffer. Frames are
received into reused buffers and decrypted straight into the result or a scratch chunk; a chunk
is added only after its tag is verified. The sum order is fixed by the tree (see
:mod:`allreduce.topology`), and every rank ends with the root's bytes, so the result is
bit-identical everywhere.

Slow is not dead. Between two collectives a rank may compute for a long time (a GC pause, a
slow disk, a skewed shard), while its neighbours already wait for its data. So a waiting rank
does not time out on the data; it checks that the neighbour is *alive*: every node runs one
heartbeat thread that sends an authenticated HEARTBEAT frame on each idle tree link every
``heartbeat_timeout_s / 4`` and takes the heartbeats waiting on links nobody reads
(:meth:`Channel.send_heartbeat <allreduce.channel.Channel.send_heartbeat>`,
:meth:`~allreduce.channel.Channel.poll_heartbeats`). A blocked receive or send on a link keeps
waiting while anything (data or heartbeat) arrives from that neighbour, and fails naming its
rank when

- nothing has arrived for ``heartbeat_timeout_s``: PeerTimeout (the process is frozen, e.g.
  SIGSTOP, swapped out, or the network is cut);
- the connection closes: PeerLost, at once (the process died: its kernel closes the socket);
- the neighbour is alive but one wait lasted ``max_wait_s`` (default: none): PeerTimeout, a
  bound for a rank whose main thread is stuck while its heartbeat thread runs.

Heartbeats go between tree neighbours over the links the collectives use, rather than to the
tree server: the rank that waits is the one that must judge, the link it waits on is the one
whose liveness matters (a server could see a rank alive while the link to it is cut), the
links are already authenticated and sequenced (a heartbeat is HMAC'd and replay-checked like
every frame), and nothing depends on the driver's tree server after the tree is formed. The
heartbeat thread needs the GIL: a C extension that holds it for longer than the heartbeat
timeout makes its rank look frozen (the solvers' numba kernels release it).

Every blocking call is still bounded: a wait on a live link wakes every
``min(heartbeat_timeout_s / 8, 1 s)`` to check the neighbour. On any failure the node sends
ABORT to its neighbours (who pass it on), so the whole tree stops promptly (a link with a
sealed frame still queued gets no ABORT, only the shutdown: its neighbour sees PeerLost at
once). ``io_timeout_s``
bounds the handshakes' sends and receives; with ``heartbeat_timeout_s=None`` (liveness off)
it bounds every receive of a collective as well.

Joining: a rank's listener (for its children) is served by an
:class:`~allreduce.acceptor.Acceptor` from the moment it opens, so junk connections are
accepted, bounded and closed while the rank registers and waits for the tree; children
connect to their parent with retries and backoff.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import ciphers
from . import protocol as proto
from .acceptor import Acceptor
from .channel import Channel, connect_authenticated, open_listener
from .client import ServerSession
from .communicator import CallStats, Communicator, wire_array
from .errors import AllreduceError, PeerAborted, PeerLost, PeerTimeout, ProtocolError
from .protocol import MsgType
from .topology import Placement, path_to_root

log = logging.getLogger(__name__)

_UP = {4: MsgType.UP_F32, 8: MsgType.UP_F64}
_DOWN = {4: MsgType.DOWN_F32, 8: MsgType.DOWN_F64}


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")


class TreeNode(Communicator):
    """One rank of the spanning tree, implementing :class:`Communicator` over sockets.

    Build it with :meth:`join`. Collectives must be called from one thread at a time, in the
    same order on every rank. Use it as a context manager: leaving the block with an exception
    tells the neighbours to abort.
    """

    def __init__(
        self,
        placement: Placement,
        parent: Channel | None,
        children: Sequence[Channel],
        *,
        chunk_bytes: int = 1 << 20,
        io_timeout_s: float = 120.0,
        heartbeat_timeout_s: float | None = 60.0,
        max_wait_s: float | None = None,
        overlap: bool = True,
    ) -> None:
        if chunk_bytes < 8:
            raise ValueError(f"chunk_bytes must be at least 8, got {chunk_bytes}")
        self._placement = placement
        self._parent = parent
        self._children = list(children)
        self._chunk_bytes = int(chunk_bytes)
        self._overlap = bool(overlap)  # writer threads: seal chunk k+1 while chunk k is sent
        self._io_timeout_s = io_timeout_s
        self._stats = CallStats()
        self._add_s = 0.0
        self._outputs = _OutputPool()
        self._seal_bufs: dict[int, list[Any]] = {}
        self._scratch: dict[np.dtype, list[np.ndarray]] = {}
        self._busy = threading.Lock()
        self._broken: BaseException | None = None
        self._closed = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if heartbeat_timeout_s is not None and self._links():
            for chan in self._links():
                chan.enable_liveness(heartbeat_timeout_s, max_wait_s)
            self._beat = threading.Thread(
                target=self._heartbeats,
                args=(heartbeat_timeout_s / 4,),
                name=f"rank{placement.rank}-heartbeat",
                daemon=True,
            )
            self._beat.start()

    def _heartbeats(self, interval_s: float) -> None:
        """Every ``interval_s``: a heartbeat on each idle link, and take the waiting ones."""
        links = self._links()
        while not self._stop.wait(interval_s):
            for chan in links:
                chan.send_heartbeat(min_interval_s=interval_s / 2)
                chan.poll_heartbeats()

    # -- joining ---------------------------------------------------------------------------

    @classmethod
    def join(
        cls,
        server_address: tuple[str, int],
        key: bytes,
        *,
        shard: int,
        attempt_id: str | int,
        host: str = "127.0.0.1",
        chunk_bytes: int = 1 << 20,
        connect_timeout_s: float = 30.0,
        handshake_timeout_s: float = 10.0,
        io_timeout_s: float = 120.0,
        startup_timeout_s: float = 600.0,
        max_frame_bytes: int = proto.DEFAULT_MAX_FRAME_BYTES,
        socket_buffer_bytes: int | None = None,
        session: ServerSession | None = None,
        heartbeat_timeout_s: float | None = 60.0,
        max_wait_s: float | None = None,
        max_unauthenticated: int = 1024,
        max_unauthenticated_per_source: int = 64,
        cipher: str = ciphers.DEFAULT_CIPHER,
        overlap: bool = True,
    ) -> TreeNode:
        """Listen on ``host`` (ephemeral port), register shard ``shard``, link up with the tree.

        ``session`` is an already connected :class:`ServerSession` (used for progress
        heartbeats during pass 1); it is closed once the topology arrives. Raises StandDown if
        another attempt of the shard won, StartupTimeout / RoundAborted if the round failed,
        PeerLost / PeerTimeout if a neighbour could not be reached.
        """
        key = proto.check_key(key)
        if session is not None and (session.shard, session.attempt_id) != (shard, str(attempt_id)):
            raise ValueError(
                f"the session belongs to shard {session.shard} attempt {session.attempt_id!r}, "
                f"not shard {shard} attempt {str(attempt_id)!r}"
            )
        if chunk_bytes > max_frame_bytes:
            raise ValueError(
                f"chunk_bytes ({chunk_bytes}) exceeds max_frame_bytes ({max_frame_bytes})"
            )
        listener = open_listener(host, backlog=128, buffer_bytes=socket_buffer_bytes)
        children = _Children(shard)
        acceptor = Acceptor(
            listener,
            key,
            name=f"rank {shard}",
            role="parent",
            expect_role="child",
            accept=children.accept,
            on_channel=children.on_channel,
            handshake_timeout_s=handshake_timeout_s,
            io_timeout_s=io_timeout_s,
            max_frame_bytes=max_frame_bytes,
            buffer_bytes=socket_buffer_bytes,
            max_pending=max_unauthenticated,
            max_pending_per_source=max_unauthenticated_per_source,
            cipher=cipher,
        ).start()
        try:
            if session is None:
                session = ServerSession.connect(
                    server_address,
                    key,
                    shard=shard,
                    attempt_id=attempt_id,
                    connect_timeout_s=connect_timeout_s,
                    handshake_timeout_s=handshake_timeout_s,
                    io_timeout_s=io_timeout_s,
                    max_frame_bytes=max_frame_bytes,
                    cipher=cipher,
                )
            with session:
                placement = session.register(
                    host, listener.getsockname()[1], timeout_s=startup_timeout_s
                )
            parent, kids = _link(
                placement,
                children,
                key,
                attempt_id=str(attempt_id),
                connect_timeout_s=connect_timeout_s,
                handshake_timeout_s=handshake_timeout_s,
                io_timeout_s=io_timeout_s,
                max_frame_bytes=max_frame_bytes,
                buffer_bytes=socket_buffer_bytes,
                cipher=cipher,
            )
        finally:
            acceptor.close()  # also closes the listener
            children.finish()
        log.info(
            "rank %d of %d linked (parent %s, children %s)",
            placement.rank,
            placement.size,
            placement.parent.rank if placement.parent else None,
            [c.rank for c in placement.children],
        )
        return cls(
            placement,
            parent,
            kids,
            chunk_bytes=chunk_bytes,
            io_timeout_s=io_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            max_wait_s=max_wait_s,
            overlap=overlap,
        )

    # -- Communicator ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._placement.rank

    @property
    def size(self) -> int:
        return self._placement.size

    @property
    def placement(self) -> Placement:
        return self._placement

    def allreduce(self, arr: Any) -> np.ndarray:
        a = wire_array(arr)
        return self._collective("allreduce", a, sources=self._children, own=True).reshape(a.shape)

    def broadcast(self, arr: Any, root: int = 0) -> np.ndarray:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root!r} is not a rank in 0..{self.size - 1}")
        a = wire_array(arr)
        path = path_to_root(root)
        if self.rank == root:
            sources: list[Channel] = []
        elif self.rank in path:  # forward from the child on the path towards ``root``
            below = path[path.index(self.rank) - 1]
            sources = [c for c in self._children if c.rank == below]
        else:
            sources = []
        own = self.rank == root
        up = self.rank in path
        return self._collective("broadcast", a, sources=sources, own=own, up=up).reshape(a.shape)

    def allreduce_scalars(self, values: Sequence[float]) -> list[float]:
        a = np.asarray(values, dtype="<f8").reshape(-1)
        return self._collective("allreduce_scalars", a, sources=self._children, own=True).tolist()

    def stats(self) -> dict[str, Any]:
        return self._stats.snapshot()

    def totals(self) -> dict[str, Any]:
        return dict(self._stats.totals)

    def perf(self) -> dict[str, float]:
        """Where this rank's collectives spent their time, summed over its links (see
        :meth:`Channel.perf <allreduce.channel.Channel.perf>`), plus ``add_s``: the additions
        of the reduce phase. Stages on different threads overlap, so they need not sum to the
        wall time."""
        out = {"add_s": self._add_s}
        for chan in self._links():
            for k, v in chan.perf().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def close(self, error: BaseException | None = None) -> None:
        """Close every link; with ``error`` (and no abort sent yet) send ABORT first."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # first: the heartbeat thread must not touch a closed link
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=5.0)
        if error is not None and self._broken is None:
            self._abort_links(error)
        for chan in self._links():
            chan.close()

    # -- the pipelined collective ----------------------------------------------------------

    def _links(self) -> list[Channel]:
        return ([self._parent] if self._parent is not None else []) + self._children

    def _buffers(self, dtype: np.dtype, per: int, count: int) -> list[np.ndarray]:
        bufs = self._scratch.get(dtype)
        if bufs is None or len(bufs) < count or bufs[0].size < per:
            bufs = [np.empty(per, dtype=dtype) for _ in range(count)]
            self._scratch[dtype] = bufs
        return bufs

    def _collective(
        self,
        op: str,
        src: np.ndarray,
        *,
        sources: Sequence[Channel],
        own: bool,
        up: bool = True,
    ) -> np.ndarray:
        """Run one collective.

        ``sources`` are the children whose chunks flow up into this node (in order); ``own``
        says whether this node's ``src`` is part of the sum; ``up`` whether this node takes
        part in the upward flow at all (every node always takes part in the downward flow).
        """
        if self._closed:
            raise AllreduceError(f"rank {self.rank}: the tree node is closed")
        if self._broken is not None:
            raise AllreduceError(
                f"rank {self.rank}: the tree node is unusable after an earlier failure: "
                f"{self._broken}"
            ) from self._broken
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("TreeNode collectives must be called from one thread at a time")
        try:
            return self._run(op, src.reshape(-1), sources, own, up)
        finally:
            self._busy.release()

    def _run(
        self, op: str, flat: np.ndarray, sources: Sequence[Channel], own: bool, up: bool
    ) -> np.ndarray:
        t0 = time.perf_counter()
        n, item = flat.size, flat.dtype.itemsize
        per = max(1, self._chunk_bytes // item)
        bounds = [(lo, min(lo + per, n)) for lo in range(0, n, per)] or [(0, 0)]
        nchunks = len(bounds)
        out = self._outputs.take(flat.dtype, n)
        root = self._parent is None
        parent, children = self._parent, self._children
        up_type, down_type = _UP[item], _DOWN[item]
        has_up = up or root
        has_down = self.size > 1
        # Pipelined (several chunks, both phases): each outgoing link gets a writer thread, so
        # chunk k+1 is sealed (encrypted) while chunk k is on the wire; a chunk going up is
        # built in one of two alternating target buffers, as a writer may still be sending
        # the previous one from the other.
        pipelined = has_up and has_down and nchunks > 1
        n_scratch = len(sources) if own else 0
        n_targets = 2 if pipelined else 1
        scratch = (
            self._buffers(flat.dtype, min(per, max(n, 1)), n_scratch + n_targets)
            if n_scratch or not root
            else []
        )
        targets = scratch[n_scratch : n_scratch + n_targets]
        first_ready = [0.0]
        failure: list[BaseException] = []
        fail_lock = threading.Lock()

        def fail(exc: BaseException) -> None:
            with fail_lock:
                first = not failure
                failure.append(exc)
            if first:
                self._broken = exc
                self._abort_links(exc)

        frame_bytes = min(per, max(n, 1)) * item
        up_w = None
        down_ws: list[_Writer] = []
        if pipelined and self._overlap:
            failed = failure.__len__
            if not root:
                up_w = _Writer(parent, self._seal_buffers(parent, frame_bytes), fail, failed)
            down_ws = [
                _Writer(c, self._seal_buffers(c, frame_bytes), fail, failed) for c in children
            ]

        def up_chunk(i: int) -> None:
            lo, hi = bounds[i]
            m = hi - lo
            slot = up_w.slot() if up_w is not None else 0
            target = out[lo:hi] if root else targets[slot][:m]
            if not sources:
                if root:
                    np.copyto(target, flat[lo:hi])
                else:
                    target = flat[lo:hi]  # a leaf sends its own chunk as is
            elif not own:
                sources[0].recv_data_into(up_type, _bytes(target))
            else:
                for j, chan in enumerate(sources):
                    chan.recv_data_into(up_type, _bytes(scratch[j][:m]))
                t = time.perf_counter()
                np.add(flat[lo:hi], scratch[0][:m], out=target)
                for j in range(1, len(sources)):
                    np.add(target, scratch[j][:m], out=target)
                self._add_s += time.perf_counter() - t
            if root:
                if i == 0:
                    first_ready[0] = time.perf_counter()
            elif up_w is not None:
                up_w.submit(slot, up_type, _bytes(target))
            else:
                parent.send(up_type, _bytes(target))  # type: ignore[union-attr]

        def down_chunk(i: int) -> None:
            lo, hi = bounds[i]
            view = _bytes(out[lo:hi])
            if not root:
                parent.recv_data_into(down_type, view)  # type: ignore[union-attr]
                if i == 0:
                    first_ready[0] = time.perf_counter()
            if down_ws:
                for w in down_ws:
                    w.submit(w.slot(), down_type, view)
            else:
                for chan in children:
                    chan.send(down_type, view)

        if pipelined:
            ready = threading.Semaphore(0)

            def downward() -> None:
                try:
                    for i in range(nchunks):
                        # The reduce loop releases once per chunk, and nchunks times on failure.
                        while root and not ready.acquire(timeout=self._io_timeout_s):
                            if failure:
                                return
                        if failure:
                            return
                        down_chunk(i)
                    for w in down_ws:
                        w.finish()
                except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                    fail(exc)

            helper = threading.Thread(
                target=downward, name=f"rank{self.rank}-{op}-down", daemon=True
            )
            helper.start()
            try:
                for i in range(nchunks):
                    up_chunk(i)
                    if root:
                        ready.release()
                if up_w is not None:
                    up_w.finish()
            except BaseException as exc:  # noqa: BLE001
                fail(exc)
            finally:
                if failure and root:
                    ready.release(nchunks)
                # Terminates: each blocking call in it gives up once its neighbour is silent for
                # heartbeat_timeout_s (or after max_wait_s), and a failure shuts the links down,
                # which wakes it at once.
                helper.join()
                for w in ([up_w] if up_w is not None else []) + down_ws:
                    w.close()
        else:
            try:
                if has_up:
                    for i in range(nchunks):
                        up_chunk(i)
                if has_down:
                    for i in range(nchunks):
                        down_chunk(i)
            except BaseException as exc:  # noqa: BLE001
                fail(exc)
        if failure:
            raise failure[0]
        t1 = time.perf_counter()
        if not has_down:
            first_ready[0] = t0
        self._stats.record(op, flat, nchunks, t1 - t0, first_ready[0] - t0)
        return out

    def _seal_buffers(self, chan: Channel, frame_bytes: int) -> list[Any]:
        """The link's reused ciphertext buffers (None where the cipher does not encrypt)."""
        if not chan.encrypts:
            return [None] * _Writer.DEPTH
        need = frame_bytes + chan.tag_bytes
        bufs = self._seal_bufs.get(id(chan))
        if bufs is None or len(bufs[0]) < need:
            bufs = [bytearray(need) for _ in range(_Writer.DEPTH)]
            self._seal_bufs[id(chan)] = bufs
        return bufs

    def _abort_links(self, exc: BaseException) -> None:
        """Tell every neighbour the collective is over (best effort), then break the links."""
        if isinstance(exc, PeerAborted):
            origin, reason = exc.rank, exc.detail
        else:
            origin, reason = self.rank, f"rank {self.rank}: {type(exc).__name__}: {exc}"
        for chan in self._links():
            chan.try_send_abort(origin, reason)
        for chan in self._links():
            chan.shutdown()


class _Stopped(Exception):
    """Another thread of the collective failed (its error is the one raised)."""


class _Writer:
    """Sends one link's sealed data frames from its own thread, in order.

    The collective's thread seals chunk k+1 (:meth:`Channel.seal_data`, into one of
    ``DEPTH`` reused buffers) while this thread has chunk k on the wire. A send error is
    handed to ``fail`` (which aborts the collective); a waiting caller stops when ``failed()``.
    """

    DEPTH = 2
    ABORT_GRACE_S = 0.25

    def __init__(
        self,
        chan: Channel,
        buffers: list[Any],
        fail: Callable[[BaseException], None],
        failed: Callable[[], int],
    ) -> None:
        self._chan = chan
        self._bufs = buffers
        self._fail, self._failed = fail, failed
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.DEPTH):
            self._free.put(i)
        self._todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"send-{chan.who}", daemon=True)
        self._thread.start()

    def slot(self) -> int:
        """A buffer slot whose previous frame has been sent (waits for one)."""
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if self._failed():
                    raise _Stopped() from None

    def submit(self, slot: int, msg_type: MsgType, view: memoryview) -> None:
        self._todo.put((slot, self._chan.seal_data(msg_type, view, self._bufs[slot])))

    def finish(self) -> None:
        """Wait until every submitted frame is sent."""
        self._todo.put(None)
        self._thread.join()
        if self._failed():
            raise _Stopped()

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            slot, frame = item
            try:
                self._chan.send_sealed(frame)
            except BaseException as exc:  # noqa: BLE001 - handed to the collective
                if isinstance(exc, PeerLost):
                    # a peer that closed the link may have sent an ABORT saying why: give the
                    # thread reading this link a moment to report it first
                    deadline = time.monotonic() + self.ABORT_GRACE_S
                    while not self._failed() and time.monotonic() < deadline:
                        time.sleep(0.005)
                self._fail(exc)
                return
            self._free.put(slot)


class _OutputPool:
    """Result arrays whose memory is reused once the caller has dropped them.

    A collective returns a new array the caller owns. Allocating a fresh multi-megabyte array
    per call costs the kernel's page faults (and, with transparent huge pages, compaction) on
    first touch, which was a large share of an AllReduce's time; so a large result is a fresh
    array over a pooled block of memory, and the block goes back to the pool (at most ``keep``
    per size) when that array and every view of it are gone (``weakref.finalize`` on the
    array: numpy views keep it alive as their base).
    """

    MIN_BYTES = 1 << 20

    def __init__(self, keep: int = 2) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._keep = keep

    def take(self, dtype: np.dtype, n: int) -> np.ndarray:
        nbytes = n * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return np.empty(n, dtype=dtype)
        free = self._free.get(nbytes)
        try:
            mem = free.pop() if free else bytearray(nbytes)
        except IndexError:  # emptied by another thread meanwhile
            mem = bytearray(nbytes)
        arr = np.frombuffer(mem, dtype=dtype)
        weakref.finalize(arr, self._give_back, nbytes, mem)
        return arr

    def _give_back(self, nbytes: int, mem: bytearray) -> None:
        free = self._free.setdefault(nbytes, [])
        if len(free) < self._keep:
            free.append(mem)


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


def _link(
    placement: Placement,
    children: _Children,
    key: bytes,
    *,
    attempt_id: str,
    connect_timeout_s: float,
    handshake_timeout_s: float,
    io_timeout_s: float,
    max_frame_bytes: int,
    buffer_bytes: int | None,
    cipher: str,
) -> tuple[Channel | None, list[Channel]]:
    """Connect to the parent and collect the children, each link authenticated."""
    me = placement.rank
    children.expect({c.rank for c in placement.children})
    parent_chan: Channel | None = None
    try:
        if placement.parent is not None:
            p = placement.parent
            parent_chan, reply = connect_authenticated(
                (p.host, p.port),
                key,
                role="child",
                expect_role="parent",
                info={"rank": me, "attempt_id": attempt_id},
                rank=p.rank,
                peer=None,
                connect_timeout_s=connect_timeout_s,
                handshake_timeout_s=handshake_timeout_s,
                io_timeout_s=io_timeout_s,
                max_frame_bytes=max_frame_bytes,
                buffer_bytes=buffer_bytes,
                cipher=cipher,
            )
            if reply.get("rank") != p.rank:
                raise ProtocolError(
                    f"rank {me} reached rank {reply.get('rank')!r} instead of its parent {p.rank}"
                )
        wait_s = connect_timeout_s + handshake_timeout_s
        missing = children.wait(wait_s)
        if missing:
            raise PeerTimeout(
                missing[0],
                f"child rank(s) {missing} of rank {me} did not connect within {wait_s:g} s",
            )
        kids = children.take([c.rank for c in placement.children])
    except BaseException:
        if parent_chan is not None:
            parent_chan.close()
        raise
    return parent_chan, kids
