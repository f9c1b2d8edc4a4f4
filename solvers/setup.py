"""Input validation and agreement: local checks first, then the run's first collective.

Each rank checks its own data before doing anything (:func:`solvers.shard.find_problem`). The
collective half is deferred: :class:`AgreeingCommunicator` (the solvers' view of the
communicator) runs it just before the first collective the solver makes, i.e. after the first
pass over the data, so a task joins the tree (with ``allreduce.lazy.LazyCommunicator``) only
once its first pass is done, as speculative execution requires. A rank whose own data are
invalid does no work and goes straight to the agreement.

The agreement is one float64 AllReduce of a vector with one block per rank,
``[problem code, n_features, Σ training weights, Σ held-out weights]``. If any rank has a
problem every rank raises: the one that found it with the details, the others naming it. So no
rank is left waiting in a collective. It also yields the totals of the mean-form objective.
"""

from __future__ import annotations

import numpy as np

from terascale.allreduce.communicator import Communicator, WrappedCommunicator
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError, NonFiniteInputError
from terascale.solvers.shard import Shard, find_problem

_OK, _NON_FINITE, _INVALID = 0.0, 1.0, 2.0
_SLOTS = 4


def _code(problem: InvalidInputError | None) -> float:
    if problem is None:
        return _OK
    return _NON_FINITE if isinstance(problem, NonFiniteInputError) else _INVALID


def _local_check(data: CSRData, what: str, loss: str) -> tuple[Shard | None, InvalidInputError | None]:
    try:
        shard = Shard.from_csr(data)
    except (TypeError, ValueError, OverflowError) as exc:
        return None, InvalidInputError(f"{what}: cannot convert to the kernel dtypes: {exc}")
    return shard, find_problem(data, shard, what, loss)


class Inputs:
    """This rank's validated shards (local checks at construction) and, once :meth:`agree` has
    run, the totals over all ranks."""

    def __init__(self, rank: int, data: CSRData, holdout: CSRData | None, loss: str, consume: bool = False):
        self.n_features = int(data.n_features)
        #: the caller handed the training data over: an online phase may relabel the indices for
        #: its duration (solvers.hot), giving them back exactly when it ends, and L-BFGS's working
        #: table renumbers them in place (solvers.local_table); after that ``train`` holds local numbers
        self.consume = consume
        #: L-BFGS's working table, made once per ``train`` call (``solvers.local_table.working_table``)
        self.table = None
        self.train, self.problem = _local_check(data, f"rank {rank} training data", loss)
        self.holdout: Shard | None = None
        if self.problem is None and holdout is not None:
            self.holdout, self.problem = _local_check(holdout, f"rank {rank} held-out data", loss)
            if self.problem is None and holdout.n_features != data.n_features:
                self.problem = InvalidInputError(
                    f"rank {rank}: held-out n_features = {holdout.n_features} differs from the "
                    f"training data's {data.n_features}"
                )
        self.agreed = False
        self.total_weight = float("nan")  # W: Σ training importance weights over all ranks
        self.holdout_weight = 0.0  # Σ held-out importance weights over all ranks (0: none)

    def agree(self, comm: Communicator) -> None:
        """The collective half (see the module docstring); raises on every rank on a problem."""
        vec = np.zeros(_SLOTS * comm.size, dtype=np.float64)
        base = _SLOTS * comm.rank
        vec[base] = _code(self.problem)
        vec[base + 1] = float(self.n_features)
        if self.problem is None:
            vec[base + 2] = self.train.weight_sum()
            vec[base + 3] = self.holdout.weight_sum() if self.holdout is not None else 0.0
        blocks = comm.allreduce(vec).reshape(comm.size, _SLOTS)
        if self.problem is not None:
            raise self.problem
        bad = [r for r in range(comm.size) if blocks[r, 0] != _OK]
        if bad:
            cls = NonFiniteInputError if any(blocks[r, 0] == _NON_FINITE for r in bad) else InvalidInputError
            raise cls(f"invalid input data on rank(s) {bad} (see the error raised there)")
        if len({int(v) for v in blocks[:, 1]}) > 1:
            raise InvalidInputError(f"ranks disagree on n_features: {blocks[:, 1].astype(int).tolist()}")
        total = float(sum(blocks[:, 2].tolist()))  # a fixed order: the same on every rank
        if not total > 0.0:
            raise InvalidInputError("no training data: the importance weights sum to 0 over all ranks")
        self.total_weight = total
        self.holdout_weight = float(sum(blocks[:, 3].tolist()))
        self.agreed = True


class AgreeingCommunicator(WrappedCommunicator):
    """The solvers' view of the caller's communicator: its first collective runs the input
    agreement first. ``close`` does nothing: the caller owns the communicator."""

    def __init__(self, inner: Communicator, inputs: Inputs):
        super().__init__(inner)
        self.inputs = inputs

    def _ready(self) -> Communicator:
        if not self.inputs.agreed:
            self.inputs.agree(self.inner)
        return self.inner

    def close(self, error: BaseException | None = None) -> None:
        pass
