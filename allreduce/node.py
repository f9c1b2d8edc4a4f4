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
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
        links = _LinkSettings(
            key=key,
            attempt_id=str(attempt_id),
            connect_timeout_s=connect_timeout_s,
            handshake_timeout_s=handshake_timeout_s,
            io_timeout_s=io_timeout_s,
            max_frame_bytes=max_frame_bytes,
            buffer_bytes=socket_buffer_bytes,
            cipher=cipher,
        )
        listener = open_listener(host, backlog=128, buffer_bytes=socket_buffer_bytes)
        children = _Children(shard)
        acceptor = _child_acceptor(
            listener,
            shard,
            children,
            links,
            max_pending=max_unauthenticated,
            max_pending_per_source=max_unauthenticated_per_source,
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
            parent, kids = _link(placement, children, links)
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
        """Plan the collective, take its buffers and writers, run its flows, raise the first
        failure or record the call's statistics."""
        t0 = time.perf_counter()
        plan = _Plan.make(
            flat.size,
            flat.dtype.itemsize,
            self._chunk_bytes,
            root=self._parent is None,
            size=self.size,
            n_sources=len(sources),
            own=own,
            up=up,
        )
        out = self._outputs.take(flat.dtype, flat.size)
        failure = _Failure(self._break)
        scratch, targets = self._chunk_buffers(plan, flat.dtype)
        up_writer, down_writers = self._writers(plan, flat.dtype.itemsize, failure)
        run = _CollectiveRun(
            plan,
            flat,
            out,
            parent=self._parent,
            children=self._children,
            sources=sources,
            scratch=scratch,
            targets=targets,
            up_writer=up_writer,
            down_writers=down_writers,
            failure=failure,
        )
        try:
            if plan.pipelined:
                run.run_pipelined(name=f"rank{self.rank}-{op}-down", poll_s=self._io_timeout_s)
            else:
                run.run_in_turn()
        finally:
            self._add_s += run.add_s
        failure.raise_first()
        t1 = time.perf_counter()
        first_ready = run.first_ready if plan.has_down else t0
        self._stats.record(op, flat, plan.nchunks, t1 - t0, first_ready - t0)
        return out

    def _break(self, exc: BaseException) -> None:
        """The first failure of a collective: the node is unusable, the neighbours are told."""
        self._broken = exc
        self._abort_links(exc)

    def _chunk_buffers(
        self, plan: _Plan, dtype: np.dtype
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The collective's reused chunk buffers: (one per child whose partial sum is added here,
        the ones a chunk going up is built in). Pipelined, a chunk going up is built in one of
        two alternating targets, as a writer may still be sending the previous one from the
        other."""
        n_scratch = plan.n_sources if plan.own else 0
        n_targets = 2 if plan.pipelined else 1
        if not n_scratch and plan.root:
            return [], []
        bufs = self._buffers(dtype, plan.frame_items, n_scratch + n_targets)
        return bufs[:n_scratch], bufs[n_scratch : n_scratch + n_targets]

    def _writers(
        self, plan: _Plan, itemsize: int, failure: _Failure
    ) -> tuple[_Writer | None, list[_Writer]]:
        """With ``overlap``, a pipelined collective's writer threads: (the parent's link's, the
        children's links'), so chunk k+1 is sealed (encrypted) while chunk k is on the wire."""
        if not (plan.pipelined and self._overlap):
            return None, []
        frame_bytes = plan.frame_items * itemsize
        up = None
        if self._parent is not None:
            up = _Writer(self._parent, self._seal_buffers(self._parent, frame_bytes), failure)
        down = [_Writer(c, self._seal_buffers(c, frame_bytes), failure) for c in self._children]
        return up, down

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


@dataclass(frozen=True)
class _Plan:
    """How one collective passes through this node: its chunks and this node's part in it."""

    bounds: tuple[tuple[int, int], ...]  # [lo, hi) of each chunk; one empty chunk if n = 0
    frame_items: int  # elements in the largest chunk
    up_type: MsgType
    down_type: MsgType
    n_sources: int  # children whose chunks flow up into this node
    own: bool  # this node's array is part of the sum
    root: bool
    has_up: bool  # this node takes part in the upward flow
    has_down: bool  # there is a downward flow (more than one rank)
    pipelined: bool  # several chunks and both flows: the downward flow runs on its own thread

    @classmethod
    def make(
        cls,
        n: int,
        itemsize: int,
        chunk_bytes: int,
        *,
        root: bool,
        size: int,
        n_sources: int,
        own: bool,
        up: bool,
    ) -> _Plan:
        per = max(1, chunk_bytes // itemsize)
        bounds = tuple((lo, min(lo + per, n)) for lo in range(0, n, per)) or ((0, 0),)
        has_up = up or root
        has_down = size > 1
        return cls(
            bounds=bounds,
            frame_items=min(per, max(n, 1)),
            up_type=_UP[itemsize],
            down_type=_DOWN[itemsize],
            n_sources=n_sources,
            own=own,
            root=root,
            has_up=has_up,
            has_down=has_down,
            pipelined=has_up and has_down and len(bounds) > 1,
        )

    @property
    def nchunks(self) -> int:
        return len(self.bounds)


class _Failure:
    """The errors of one collective's threads (the calling thread, the downward flow, the
    writers). The first one recorded is the one raised, and it calls ``on_first`` (which aborts
    the links, waking every thread blocked on them)."""

    def __init__(self, on_first: Callable[[BaseException], None]) -> None:
        self._on_first = on_first
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    @property
    def failed(self) -> bool:
        return bool(self._errors)

    def record(self, exc: BaseException) -> None:
        with self._lock:
            first = not self._errors
            self._errors.append(exc)
        if first:
            self._on_first(exc)

    def raise_first(self) -> None:
        if self._errors:
            raise self._errors[0]


class _CollectiveRun:
    """One collective passing through one node: the upward flow (reduce: each chunk summed here
    and sent to the parent) and the downward flow (each chunk of the root's result received
    from the parent and sent to the children), chunk by chunk.

    Not pipelined, the calling thread runs every chunk up, then every chunk down. Pipelined, the
    calling thread runs the upward flow while a :class:`_DownwardFlow` thread runs the downward
    one. Every error goes to ``failure``; the caller raises the first one.
    """

    def __init__(
        self,
        plan: _Plan,
        flat: np.ndarray,
        out: np.ndarray,
        *,
        parent: Channel | None,
        children: Sequence[Channel],
        sources: Sequence[Channel],
        scratch: list[np.ndarray],
        targets: list[np.ndarray],
        up_writer: _Writer | None,
        down_writers: list[_Writer],
        failure: _Failure,
    ) -> None:
        self.plan = plan
        self._flat, self._out = flat, out
        self._parent, self._children, self._sources = parent, children, sources
        self._scratch, self._targets = scratch, targets
        self._up_writer, self._down_writers = up_writer, down_writers
        self._failure = failure
        self.first_ready = 0.0  # when the first chunk of the result was in ``out``
        self.add_s = 0.0  # time spent adding children's chunks

    def run_in_turn(self) -> None:
        """Every chunk up, then every chunk down, on the calling thread."""
        try:
            if self.plan.has_up:
                for i in range(self.plan.nchunks):
                    self.up_chunk(i)
            if self.plan.has_down:
                for i in range(self.plan.nchunks):
                    self.down_chunk(i)
        except BaseException as exc:  # noqa: BLE001
            self._failure.record(exc)

    def run_pipelined(self, *, name: str, poll_s: float) -> None:
        """The upward flow on the calling thread, the downward flow on a thread of its own."""
        down = _DownwardFlow(
            self.down_chunk,
            self.plan.nchunks,
            self._down_writers,
            self._failure,
            gated=self.plan.root,
            poll_s=poll_s,
            name=name,
        )
        down.start()
        try:
            for i in range(self.plan.nchunks):
                self.up_chunk(i)
                down.chunk_ready()
            if self._up_writer is not None:
                self._up_writer.finish()
        except BaseException as exc:  # noqa: BLE001
            self._failure.record(exc)
        finally:
            if self._failure.failed:
                down.release_all()
            # Terminates: each blocking call in it gives up once its neighbour is silent for
            # heartbeat_timeout_s (or after max_wait_s), and a failure shuts the links down,
            # which wakes it at once.
            down.join()
            writers = [self._up_writer] if self._up_writer is not None else []
            for w in writers + self._down_writers:
                w.close()

    def up_chunk(self, i: int) -> None:
        """Chunk ``i`` going up: this node's chunk plus its children's partial sums, in order,
        sent to the parent (the root keeps the sum in ``out``)."""
        p = self.plan
        lo, hi = p.bounds[i]
        m = hi - lo
        slot = self._up_writer.slot() if self._up_writer is not None else 0
        target = self._out[lo:hi] if p.root else self._targets[slot][:m]
        if not self._sources:
            if p.root:
                np.copyto(target, self._flat[lo:hi])
            else:
                target = self._flat[lo:hi]  # a leaf sends its own chunk as is
        elif not p.own:
            self._sources[0].recv_data_into(p.up_type, _bytes(target))
        else:
            self._sum_into(target, lo, hi)
        if p.root:
            if i == 0:
                self.first_ready = time.perf_counter()
        elif self._up_writer is not None:
            self._up_writer.submit(slot, p.up_type, _bytes(target))
        else:
            self._parent.send(p.up_type, _bytes(target))  # type: ignore[union-attr]

    def _sum_into(self, target: np.ndarray, lo: int, hi: int) -> None:
        """``target`` = this node's ``[lo, hi)`` + each child's chunk, in the children's order
        (the fixed order that makes the sum bit-identical on every rank)."""
        m = hi - lo
        for j, chan in enumerate(self._sources):
            chan.recv_data_into(self.plan.up_type, _bytes(self._scratch[j][:m]))
        t = time.perf_counter()
        np.add(self._flat[lo:hi], self._scratch[0][:m], out=target)
        for j in range(1, len(self._sources)):
            np.add(target, self._scratch[j][:m], out=target)
        self.add_s += time.perf_counter() - t

    def down_chunk(self, i: int) -> None:
        """Chunk ``i`` of the result going down: from the parent into ``out`` (the root has it
        there already), then to every child."""
        p = self.plan
        lo, hi = p.bounds[i]
        view = _bytes(self._out[lo:hi])
        if not p.root:
            self._parent.recv_data_into(p.down_type, view)  # type: ignore[union-attr]
            if i == 0:
                self.first_ready = time.perf_counter()
        if self._down_writers:
            for w in self._down_writers:
                w.submit(w.slot(), p.down_type, view)
        else:
            for chan in self._children:
                chan.send(p.down_type, view)


class _DownwardFlow:
    """The downward flow of a pipelined collective, on a thread of its own, so the reduction of
    chunk ``i+1`` overlaps the transfer of chunk ``i`` down the tree.

    ``send_chunk(i)`` moves chunk ``i`` down; then the writers are drained. At the root
    (``gated``) chunk ``i`` may go down only once the reduce loop has summed it: the reduce loop
    calls :meth:`chunk_ready` once per chunk, and :meth:`release_all` when it failed; a waiting
    thread also checks ``failure`` every ``poll_s``. Elsewhere the chunks come from the parent,
    so nothing gates them. The thread's error goes to ``failure``; the thread stops before its
    next chunk once ``failure`` holds any error.
    """

    def __init__(
        self,
        send_chunk: Callable[[int], None],
        nchunks: int,
        writers: list[_Writer],
        failure: _Failure,
        *,
        gated: bool,
        poll_s: float,
        name: str,
    ) -> None:
        self._send_chunk = send_chunk
        self._nchunks = nchunks
        self._writers = writers
        self._failure = failure
        self._gated = gated
        self._poll_s = poll_s
        self._summed = threading.Semaphore(0)  # one release per chunk the reduce loop summed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def chunk_ready(self) -> None:
        """The reduce loop has summed its next chunk: at the root, that chunk may go down."""
        if self._gated:
            self._summed.release()

    def release_all(self) -> None:
        """The reduce loop failed: wake the thread if it waits for a chunk (it then stops)."""
        if self._gated:
            self._summed.release(self._nchunks)

    def join(self) -> None:
        self._thread.join()

    def _may_send(self) -> bool:
        """Wait until the next chunk may go down; False if the collective failed meanwhile."""
        while self._gated and not self._summed.acquire(timeout=self._poll_s):
            if self._failure.failed:
                return False
        return not self._failure.failed

    def _run(self) -> None:
        try:
            for i in range(self._nchunks):
                if not self._may_send():
                    return
                self._send_chunk(i)
            for w in self._writers:
                w.finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            self._failure.record(exc)


class _Stopped(Exception):
    """Another thread of the collective failed (its error is the one raised)."""


class _Writer:
    """Sends one link's sealed data frames from its own thread, in order.

    The collective's thread seals chunk k+1 (:meth:`Channel.seal_data`, into one of
    ``DEPTH`` reused buffers) while this thread has chunk k on the wire. A send error is
    recorded in ``failure`` (which aborts the collective); a waiting caller stops once
    ``failure`` holds any error.
    """

    DEPTH = 2
    ABORT_GRACE_S = 0.25

    def __init__(self, chan: Channel, buffers: list[Any], failure: _Failure) -> None:
        self._chan = chan
        self._bufs = buffers
        self._failure = failure
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
                if self._failure.failed:
                    raise _Stopped() from None

    def submit(self, slot: int, msg_type: MsgType, view: memoryview) -> None:
        self._todo.put((slot, self._chan.seal_data(msg_type, view, self._bufs[slot])))

    def finish(self) -> None:
        """Wait until every submitted frame is sent."""
        self._todo.put(None)
        self._thread.join()
        if self._failure.failed:
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
                    while not self._failure.failed and time.monotonic() < deadline:
                        time.sleep(0.005)
                self._failure.record(exc)
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
