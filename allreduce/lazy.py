"""A communicator that joins the tree on its first collective.

A training task knows its rank (= its shard) and the tree size before the tree exists; it joins
only when its first pass is done, which is exactly when the solver makes its first collective
call. ``LazyCommunicator`` defers ``join`` to that moment, so solvers stay unaware of
registration and speculative execution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from terascale.allreduce.communicator import Communicator


class LazyCommunicator(Communicator):
    def __init__(self, rank: int, size: int, join: Callable[[], Communicator]) -> None:
        self._rank, self._size, self._join = rank, size, join
        self._comm: Communicator | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def joined(self) -> bool:
        return self._comm is not None

    def _c(self) -> Communicator:
        if self._comm is None:
            self._comm = self._join()
            if (self._comm.rank, self._comm.size) != (self._rank, self._size):
                raise RuntimeError(
                    f"joined the tree as rank {self._comm.rank} of {self._comm.size}, expected {self._rank} of {self._size}"
                )
        return self._comm

    def allreduce(self, arr: Any) -> np.ndarray:
        return self._c().allreduce(arr)

    def broadcast(self, arr: Any, root: int = 0) -> np.ndarray:
        return self._c().broadcast(arr, root)

    def allreduce_scalars(self, values: Sequence[float]) -> list[float]:
        return self._c().allreduce_scalars(values)

    def stats(self) -> dict[str, Any]:
        if self._comm is None:
            return {"calls": [], "totals": {"calls": 0, "bytes": 0, "wall_s": 0.0, "wait_s": 0.0, "transfer_s": 0.0}}
        return self._comm.stats()

    def totals(self) -> dict[str, Any]:
        return self.stats()["totals"] if self._comm is None else self._comm.totals()

    def close(self, error: BaseException | None = None) -> None:
        if self._comm is not None:
            self._comm.close(error)
