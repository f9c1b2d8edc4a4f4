"""The threads that move one link's data frames during a pipelined collective.

``_Writer`` sends one outgoing link's frames from its own thread, in order, while the thread
that produces them seals the next one (:meth:`Channel.seal_data` takes only the link's sequence
lock, so sealing chunk k+1 overlaps the socket write of chunk k). ``_Reader`` receives one
source link's frames on its own thread, in order, into a few reused buffers, so the receive and
the verification and decryption of chunk k+1 overlap the adding of chunk k on the collective's
thread. Both hand their errors to the collective's ``_Failure``; a thread waiting on one of
them stops (``_Stopped``) as soon as that holds any error. Their threads start only with
:meth:`start`, inside the collective's error handling, so a failure to start one is the
collective's failure and the ones already started are joined.

A frame is used only after :meth:`Channel.recv_data_into` returned, i.e. after its tag was
verified; a reader hands out a buffer only then, and a buffer goes back to the reader only when
the collective's thread is done with it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .channel import Channel
from .errors import PeerLost
from .protocol import MsgType

if TYPE_CHECKING:
    from .collective_run import _Failure

_POLL_S = 0.05  # how often a thread waiting on another thread of the collective checks for a failure


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

    def start(self) -> None:
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
        """Stop the thread (after the frames already submitted); nothing if it never started."""
        if self._thread.ident is None:
            return
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


class _Reader:
    """Receives one source link's data frames from its own thread, in order.

    Frame ``i`` (``sizes[i]`` items) lands in one of ``DEPTH`` reused buffers; :meth:`take`
    hands the collective's thread the buffer of the next frame once it has been received and
    verified, :meth:`give_back` returns it. The reader is at most ``DEPTH`` frames ahead of the
    collective's thread, so it never reads further ahead than its buffers allow (the rest waits
    in the kernel's socket buffer, as it would without the reader). A receive error is recorded
    in ``failure`` (which aborts the collective, waking every thread blocked on a link).
    """

    DEPTH = 3

    def __init__(
        self,
        chan: Channel,
        msg_type: MsgType,
        buffers: Sequence[np.ndarray],
        sizes: Sequence[int],
        failure: _Failure,
    ) -> None:
        if len(buffers) != self.DEPTH:
            raise ValueError(f"a reader needs {self.DEPTH} buffers, got {len(buffers)}")
        self._chan = chan
        self._type = msg_type
        self._bufs = buffers
        self._sizes = tuple(sizes)
        self._failure = failure
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.DEPTH):
            self._free.put(i)
        self._ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._next = 0  # the frame the next take() returns
        self._thread = threading.Thread(target=self._run, name=f"recv-{chan.who}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self) -> tuple[int, np.ndarray]:
        """(slot, the next frame's items): waits until it is received and verified."""
        while True:
            try:
                slot = self._ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._failure.failed:
                    raise _Stopped() from None
        m = self._sizes[self._next]
        self._next += 1
        return slot, self._bufs[slot][:m]

    def give_back(self, slot: int) -> None:
        """The collective's thread is done with the buffer of ``slot``."""
        self._free.put(slot)

    def join(self) -> None:
        """Wait for the thread: it ends after its last frame, or soon after a failure (a link
        shut down wakes a blocked receive; a wait for a free buffer checks the failure); nothing
        if it never started."""
        if self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        for m in self._sizes:
            while True:
                try:
                    slot = self._free.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if self._failure.failed:
                        return
            if self._failure.failed:
                return
            try:
                self._chan.recv_data_into(self._type, memoryview(self._bufs[slot][:m]).cast("B"))
            except BaseException as exc:  # noqa: BLE001 - handed to the collective
                self._failure.record(exc)
                return
            self._ready.put(slot)
