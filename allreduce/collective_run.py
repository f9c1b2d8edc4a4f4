"""One collective (AllReduce, reduce, broadcast) passing through one node of the tree, in chunks.

:class:`~allreduce.node.TreeNode` plans each call (``_Plan``: the array's chunks of
``chunk_bytes`` and this node's part: which children's chunks flow up into it, whether its own
array is part of the sum, whether it is the root) and hands ``_CollectiveRun`` everything it
works on: the links to the parent and children, the reused chunk buffers, the writers and a
``_Failure``. Nothing here opens, closes or aborts a link: on the first error ``_Failure``
calls the node's callback, which sends ABORT and shuts the links down.

Upward flow: for each chunk, this node's chunk plus each child's partial sum is sent to the
parent (the root keeps the sum in the result). Downward flow: each chunk of the root's result
comes from the parent and goes to every child. The reduction order is fixed: a chunk's sum is
this node's chunk, then each child's chunk added in the children's order (``2r+1`` then
``2r+2``, see :mod:`allreduce.topology`), a child's chunk added only after its frame's tag is
verified; the root's bytes then go down unchanged, so every rank ends with the same bits.

Window (``window`` = W > 0, pipelined, not at the root): chunk ``i`` goes up only once chunk
``i − W`` of the result has come down from the parent. A result chunk exists only when every
rank's chunk has reached the root, so no up-flow runs more than about W chunks ahead of the
slowest one. Without it a flow whose chunks are ready early (a leaf's own array) runs ahead
into the peer's socket buffer (Linux autotunes it up to ``tcp_rmem``'s maximum, 32 MiB here)
and takes the capacity of a link it shares with a flow the collective waits for. Chunk ``i −
W`` depends only on chunks up to ``i − W`` of every rank, which precede chunk ``i`` in every
flow, so the window cannot deadlock; W must cover the chunks in flight on the round trip up
and down the tree (about 2·depth + 1) or it idles the links.

Threading: not pipelined, the calling thread runs every chunk up, then every chunk down.
Pipelined (several chunks), the calling thread runs the upward flow while a
``_DownwardFlow`` thread runs the downward one (at the root, chunk ``i`` goes down only once
it is summed), and with ``overlap`` one ``_Writer`` per outgoing link seals and sends the
frames in order on two threads of its own, and one ``_Reader`` thread per child whose
chunks are added here receives and opens them while the calling thread adds the chunk before
(:mod:`allreduce.link_threads`). Every thread of a call is joined before the
call returns; errors from any of them go to ``_Failure`` and the caller raises the first one.
Calls must not overlap on one node (the node serialises them). ``_OutputPool`` hands out result
arrays whose memory returns to the pool from whichever thread drops the last reference.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .channel import Channel
from .link_threads import _POLL_S, _Failure, _Reader, _Writer
from .protocol import MsgType

_UP = {4: MsgType.UP_F32, 8: MsgType.UP_F64}
_DOWN = {4: MsgType.DOWN_F32, 8: MsgType.DOWN_F64}


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")


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
        window: int = 0,
        readers: Sequence[_Reader] = (),
    ) -> None:
        self.plan = plan
        self._window = window if parent is not None else 0  # the root waits for no one
        self._received = threading.Semaphore(0)  # one release per result chunk received from the parent
        self._flat, self._out = flat, out
        self._parent, self._children, self._sources = parent, children, sources
        self._scratch, self._targets = scratch, targets
        self._up_writer, self._down_writers = up_writer, down_writers
        self._readers = list(readers)  # one per source, in order, or none (the calling thread receives)
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
        writers = ([self._up_writer] if self._up_writer is not None else []) + self._down_writers
        try:
            for t in (*self._readers, *writers, down):
                t.start()
            for i in range(self.plan.nchunks):
                # chunk i - W came down: one release per chunk received, one taken per chunk sent from W on
                if self._window and i >= self._window and not _acquire(self._received, self._failure, _POLL_S):
                    break  # the collective failed: the error is already recorded
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
            for r in self._readers:
                r.join()
            for w in writers:
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
        (the fixed order that makes the sum bit-identical on every rank). The children's chunks
        come from their readers (received and verified on the readers' threads while this one
        added the chunk before), or, without readers, are received here into the scratch chunks."""
        m = hi - lo
        taken = [r.take() for r in self._readers]
        if taken:
            chunks = [chunk for _, chunk in taken]
        else:
            chunks = [self._scratch[j][:m] for j in range(len(self._sources))]
            for chan, chunk in zip(self._sources, chunks, strict=True):
                chan.recv_data_into(self.plan.up_type, _bytes(chunk))
        try:
            t = time.perf_counter()
            np.add(self._flat[lo:hi], chunks[0], out=target)
            for chunk in chunks[1:]:
                np.add(target, chunk, out=target)
            self.add_s += time.perf_counter() - t
        finally:
            for r, (slot, _) in zip(self._readers, taken, strict=True):
                r.give_back(slot)

    def down_chunk(self, i: int) -> None:
        """Chunk ``i`` of the result going down: from the parent into ``out`` (the root has it
        there already), then to every child."""
        p = self.plan
        lo, hi = p.bounds[i]
        view = _bytes(self._out[lo:hi])
        if not p.root:
            self._parent.recv_data_into(p.down_type, view)  # type: ignore[union-attr]
            self._received.release()
            if i == 0:
                self.first_ready = time.perf_counter()
        if self._down_writers:
            for w in self._down_writers:
                w.submit(w.slot(), p.down_type, view)
        else:
            for chan in self._children:
                chan.send(p.down_type, view)


def _acquire(sem: threading.Semaphore, failure: _Failure, poll_s: float) -> bool:
    """Take one release of ``sem``; False as soon as the collective failed (the thread releasing
    it gives up within its own timeouts, and a failure is recorded then)."""
    while not sem.acquire(timeout=poll_s):
        if failure.failed:
            return False
    return not failure.failed


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
        if self._thread.ident is not None:  # started
            self._thread.join()

    def _may_send(self) -> bool:
        """Wait until the next chunk may go down; False if the collective failed meanwhile."""
        if self._gated:
            return _acquire(self._summed, self._failure, self._poll_s)
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
