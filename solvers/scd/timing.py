"""Per-round compute / stall / transfer seconds of one rank, from the communicator's stats.

``stall_s`` is the growth of the communicator's ``wait_s`` total (waiting for the slowest rank
to enter a collective), ``transfer_s`` the growth of its ``transfer_s`` total (streaming the
rest), and ``compute_s`` the remainder of the round's wall time on this rank.

The totals come from ``Communicator.totals()``, which does not copy the per-call records
(``stats()`` does, at a cost that grows with the records kept).
"""

from __future__ import annotations

import time

from terascale.allreduce.communicator import Communicator


def _totals(comm: Communicator) -> dict:
    return comm.totals()


class RoundClock:
    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._mark()

    def _mark(self) -> None:
        totals = _totals(self.comm)
        self._t = time.perf_counter()
        self._wait = float(totals["wait_s"])
        self._transfer = float(totals["transfer_s"])

    def lap(self) -> tuple[float, float, float]:
        """(compute_s, stall_s, transfer_s) since the previous lap (or construction)."""
        now = time.perf_counter()
        totals = _totals(self.comm)
        stall = float(totals["wait_s"]) - self._wait
        transfer = float(totals["transfer_s"]) - self._transfer
        compute = max(0.0, (now - self._t) - stall - transfer)
        self._t, self._wait, self._transfer = now, float(totals["wait_s"]), float(totals["transfer_s"])
        return compute, stall, transfer
