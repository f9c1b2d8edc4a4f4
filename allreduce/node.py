"""A node of the spanning tree: joins the tree, then runs pipelined collectives over it.

AllReduce (sum) runs in chunks of ``chunk_bytes``. For each chunk, a node receives each
child's partial sum (children in fixed order: ``2r+1`` then ``2r+2``), adds it to its own
chunk and sends the result to its parent; the root's sum then flows down the tree chunk by
chunk. Reduce and broadcast are pipelined: a helper thread carries the downward flow, so the
reduction of chunk ``i+1`` overlaps the transfer of chunk ``i`` down the tree. With
``overlap`` (the default) every outgoing link also has a writer (a sealer and a sender thread):
chunk ``k+1`` is sealed (encrypted, with ``aes-gcm``) while chunk ``k`` is on the wire, and the
links seal in parallel; and every child whose chunks
are added here has a reader thread, which receives and decrypts chunk ``k+1`` while chunk ``k``
is added (:mod:`allreduce.link_threads`). Frames are
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

The machinery of one collective lives in :mod:`allreduce.collective_run`, the linking with the
tree neighbours in :mod:`allreduce.tree_links`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import ciphers, endpoints
from . import protocol as proto
from .channel import Channel, open_listener
from .client import ServerSession
from .collective_run import _CollectiveRun, _OutputPool, _Plan
from .communicator import CallStats, Communicator, wire_array
from .errors import AllreduceError, PeerAborted
from .link_threads import _Failure, _Reader, _Writer
from .topology import Placement, depth, path_to_root
from .tree_links import _child_acceptor, _Children, _link, _LinkSettings

log = logging.getLogger(__name__)


def auto_window(size: int) -> int:
    """The AllReduce's window in chunks (:mod:`allreduce.collective_run`) for a tree of ``size``
    ranks: its depth + 2, or none (0) for one or two ranks, whose links carry one flow each way
    (nothing to run ahead of). Measured on 1 Gbit/s links (K = 2, 3, 4, 8 hosts, 1 MiB chunks,
    docs/pages/explanation/scaling.md), the best windows were any, 2-3, 4-5 and 5: a smaller one idles the links
    while a chunk makes its round trip through the tree, a larger one lets flows run ahead again;
    at K = 2 over loopback a window of 3 cost 2-6 ms of a 50 ms AllReduce of 32 MiB."""
    return depth(size) + 2 if size > 2 else 0


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
        window_chunks: int | None = None,
    ) -> None:
        if chunk_bytes < 8:
            raise ValueError(f"chunk_bytes must be at least 8, got {chunk_bytes}")
        self._placement = placement
        self._parent = parent
        self._children = list(children)
        self._chunk_bytes = int(chunk_bytes)
        self._overlap = bool(overlap)  # writer and reader threads per link (see the module docstring)
        if window_chunks is not None and window_chunks < 0:
            raise ValueError(f"window_chunks must be >= 0, got {window_chunks}")
        # chunk i goes up after result chunk i - W came down (0: off; None: auto_window)
        self._window = auto_window(placement.size) if window_chunks is None else int(window_chunks)
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
        advertise_host: str = "",
        port_range: tuple[int, int] | None = None,
        window_chunks: int | None = None,
    ) -> TreeNode:
        """Listen on ``host`` (ephemeral port), register shard ``shard``, link up with the tree.

        The listener binds ``host`` (a wildcard binds every interface) on an ephemeral port or
        the first free port of ``port_range``; the rank registers ``advertise_host or host``,
        the address its children dial (``allreduce.endpoints``: never a wildcard).

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
        advertised = endpoints.dialable(advertise_host or host, f"shard {shard}'s advertised address")
        listener = open_listener(host, backlog=128, buffer_bytes=socket_buffer_bytes, port_range=port_range)
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
                    advertised, listener.getsockname()[1], timeout_s=startup_timeout_s
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
            window_chunks=window_chunks,
        )

    @property
    def window_chunks(self) -> int:
        """The AllReduce's window in chunks (0: off; see :mod:`allreduce.collective_run`)."""
        return self._window

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
        readers = self._readers(plan, sources, scratch, failure)
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
            window=self._window,
            readers=readers,
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
        """The collective's reused chunk buffers: (those the children's partial sums added here
        are received into: one per child, or ``_Reader.DEPTH`` per child when readers receive
        them; the ones a chunk going up is built in). Pipelined, a chunk going up is built in the
        target of the up writer's free slot (``_Writer.DEPTH`` of them), as the writer may still be
        sealing or sending the chunks before it from the others."""
        n_scratch = (plan.n_sources * (_Reader.DEPTH if self._reads(plan) else 1)) if plan.own else 0
        n_targets = _Writer.DEPTH if plan.pipelined else 1
        if not n_scratch and plan.root:
            return [], []
        bufs = self._buffers(dtype, plan.frame_items, n_scratch + n_targets)
        return bufs[:n_scratch], bufs[n_scratch : n_scratch + n_targets]

    def _reads(self, plan: _Plan) -> bool:
        """Whether the children's chunks added here come through ``_Reader`` threads: with
        ``overlap``, in a pipelined collective that adds this node's own chunk to theirs."""
        return plan.pipelined and self._overlap and plan.own and plan.n_sources > 0

    def _readers(
        self, plan: _Plan, sources: Sequence[Channel], scratch: list[np.ndarray], failure: _Failure
    ) -> list[_Reader]:
        """One reader thread per source (started here, joined by the run), each with its
        ``_Reader.DEPTH`` chunk buffers out of ``scratch``; none unless :meth:`_reads`."""
        if not self._reads(plan):
            return []
        sizes = [hi - lo for lo, hi in plan.bounds]
        d = _Reader.DEPTH
        return [_Reader(chan, plan.up_type, scratch[j * d : (j + 1) * d], sizes, failure)
                for j, chan in enumerate(sources)]

    def _writers(
        self, plan: _Plan, itemsize: int, failure: _Failure
    ) -> tuple[_Writer | None, list[_Writer]]:
        """With ``overlap``, a pipelined collective's writers: (the parent's link's, the
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

