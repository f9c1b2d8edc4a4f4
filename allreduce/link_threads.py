"""The threads that move one link's data frames during a pipelined collective.

``_Writer`` seals and sends one outgoing link's frames, in order, on a sealer and a sender
thread (:meth:`Channel.seal_data` takes only the link's sequence lock, so sealing chunk k+1
overlaps the socket write of chunk k, and the collective's thread only fills buffers).
``_Reader`` receives one source link's frames on its own thread, in order, into a few reused
buffers, so the receive and the verification and decryption of chunk k+1 overlap the adding of
chunk k on the collective's thread. Both hand their errors to the collective's ``_Failure`` (the
first error of any of its threads is the one raised); a thread waiting on one of them stops
(``_Stopped``) as soon as that holds any error. Their threads start only with
:meth:`start`, inside the collective's error handling, so a failure to start one is the
collective's failure and the ones already started are joined.

A frame is used only after :meth:`Channel.recv_data_into` returned, i.e. after its tag was
verified; a reader hands out a buffer only then, and a buffer goes back to the reader only when
the collective's thread is done with it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .channel import Channel
from .errors import PeerLost
from .protocol import MsgType

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a thread waiting on another thread of the collective checks for a failure


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

    def take(self, q: queue.SimpleQueue) -> Any:
        """The next item of ``q``; ``_Stopped`` instead once the collective has failed (checked
        every ``_POLL_S`` while waiting)."""
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                if self.failed:
                    raise _Stopped() from None

    def raise_first(self) -> None:
        if self._errors:
            raise self._errors[0]


class _Stopped(Exception):
    """Another thread of the collective failed (its error is the one raised)."""


class _Writer:
    """Seals and sends one link's data frames, in order, on two threads of its own.

    The collective's thread fills one of ``DEPTH`` reused buffers and submits it; the sealer
    thread seals it (:meth:`Channel.seal_data`, into the slot's ciphertext buffer) while the
    sender thread has the frame before it on the wire (:meth:`Channel.send_sealed`), and the
    slot is free again once its frame is sent. So filling chunk k+2, sealing chunk k+1 and
    sending chunk k overlap, and the links of a node (its parent's, its children's) seal in
    parallel. A seal or send error is recorded in ``failure`` (which aborts the collective); a
    caller waiting for a slot stops once ``failure`` holds any error.
    """

    DEPTH = 3
    ABORT_GRACE_S = 0.25

    def __init__(self, chan: Channel, buffers: list[Any], failure: _Failure) -> None:
        if len(buffers) != self.DEPTH:
            raise ValueError(f"a writer needs {self.DEPTH} buffers, got {len(buffers)}")
        self._chan = chan
        self._bufs = buffers
        self._failure = failure
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.DEPTH):
            self._free.put(i)
        self._to_seal: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._to_send: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sealer = threading.Thread(target=self._seal_loop, name=f"seal-{chan.who}", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name=f"send-{chan.who}", daemon=True)

    def start(self) -> None:
        self._sender.start()
        self._sealer.start()

    def slot(self) -> int:
        """A buffer slot whose previous frame has been sent (waits for one)."""
        return self._failure.take(self._free)

    def submit(self, slot: int, msg_type: MsgType, view: memoryview) -> None:
        """Seal and send ``view`` (unchanged until its slot is free again) as the next frame."""
        self._to_seal.put((slot, msg_type, view))

    def finish(self) -> None:
        """Wait until every submitted frame is sent."""
        self._to_seal.put(None)
        self._sealer.join()
        self._sender.join()
        if self._failure.failed:
            raise _Stopped()

    def close(self) -> None:
        """Stop the threads (after the frames already submitted); nothing if they never started."""
        if self._sealer.ident is None and self._sender.ident is None:
            return
        self._to_seal.put(None)
        if self._sealer.ident is None:
            self._to_send.put(None)
        for t in (self._sealer, self._sender):
            if t.ident is not None:
                t.join(timeout=5.0)
                if t.is_alive():  # blocked on a link the failure did not wake: it ends with the link
                    log.warning("%s still running 5 s after its collective ended", t.name)

    def _seal_loop(self) -> None:
        try:
            while True:
                item = self._to_seal.get()
                if item is None or self._failure.failed:
                    return
                slot, msg_type, view = item
                try:
                    frame = self._chan.seal_data(msg_type, view, self._bufs[slot])
                except BaseException as exc:  # noqa: BLE001 - handed to the collective
                    self._failure.record(exc)
                    return
                self._to_send.put((slot, frame))
        finally:
            self._to_send.put(None)  # the sender stops after the frames sealed so far

    def _send_loop(self) -> None:
        while True:
            item = self._to_send.get()
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
        slot = self._failure.take(self._ready)
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
            try:
                slot = self._failure.take(self._free)
            except _Stopped:
                return
            if self._failure.failed:
                return
            try:
                self._chan.recv_data_into(self._type, memoryview(self._bufs[slot][:m]).cast("B"))
            except BaseException as exc:  # noqa: BLE001 - handed to the collective
                self._failure.record(exc)
                return
            self._ready.put(slot)
