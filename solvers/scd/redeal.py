"""Dual CoCoA with the rows re-dealt to the ranks every round (``partition = "redeal"``).

With fixed shards, CoCoA's rounds can only move dual mass between examples of the same shard.
At small ``lam N`` and shards drawn from one distribution, the slow modes of the dual are
exactly the moves of mass *between* shards along the frequent features: both shards push the
shared coordinates the same way, sigma' (or gamma) damps each push by K, and the duality gap
decays sublinearly where one rank's decays linearly. Dealing the rows afresh every round turns
those moves into moves inside one rank's subproblem, and the gap decays linearly again
(measurements: docs/pages/explanation/design-notes.md).

The price is memory and one longer message:

* every rank holds *all* rows (gathered once with K broadcasts, as the primal formulation does;
  K times the CSR of one shard) and all dual variables alpha (8 bytes per row);
* round r: one permutation of the row buckets, seeded by (seed, r, K) and the same on every
  rank, is dealt round-robin; each rank runs its H local epochs on its buckets only;
* the message carries [dw | dalpha over all rows | ...]: each row's dalpha comes from the one
  rank it was dealt to (the others add 0.0, exactly), so after the allreduce every rank holds
  the same alpha to the bit, and w = w(alpha) as with fixed shards.

The CoCoA+ analysis holds round by round for any partition, so sigma' and gamma are as before.
Use it when the whole data set fits in one worker's memory; fixed shards otherwise.
"""

from __future__ import annotations

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.data import CSRData
from terascale.solvers.scd.dual_kernels import apply_dual_step, axpy, objective_sums_rows
from terascale.solvers.scd.dual_problem import DualProblem
from terascale.solvers.scd.params import CocoaParams
from terascale.solvers.scd.partition import shards_in_rank_order


def gather_rows(data: CSRData, comm: Communicator) -> CSRData:
    """Every rank's rows, in rank order, on every rank (K broadcasts; the data itself with K = 1)."""
    if comm.size == 1:
        return data
    ptrs, idx, vals, labs, wts, offset = [], [], [], [], [], 0
    for _, ptr, ind, val, lab, wt in shards_in_rank_order(data, comm):
        ptrs.append(ptr[1:] + offset if ptrs else ptr + offset)
        offset += int(ptr[-1])
        idx.append(ind)
        vals.append(val)
        labs.append(lab)
        wts.append(wt)
    return CSRData(np.concatenate(ptrs), np.concatenate(idx), np.concatenate(vals),
                   np.concatenate(labs), np.concatenate(wts), data.n_features)


class RedealtDualProblem(DualProblem):
    """One rank's side of dual CoCoA over all rows, on the buckets dealt to it each round.

    Every rank holds the same rows, so the features that occur are known without a collective:
    w, dw and the message live in the local solver's compact numbering (``[active | bias]``;
    features no row holds stay exactly 0), and the model and checkpoints are expanded to all
    features. The shared message is ``[dw (active + 1) | dalpha (all rows)]``; ``alpha`` is
    replicated and identical on every rank. The gap pieces of a point are summed over the rows
    each rank was dealt (the shares partition the rows), or over a fixed 1/K slice of the rows
    when no proposal is made (the last point of a run stopped by ``max_rounds``)."""

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float):
        super().__init__(gather_rows(data, comm), comm, params, n_weight)
        self.space = self.solver.space
        self.solver.compact_io = True
        m = self.space.size + 1
        self.w = np.zeros(m)
        # the round's message: the local solver writes dw and dalpha straight into its halves
        self._delta = np.zeros(m + self.data.n_rows)
        self.dw = self._delta[:m]
        self.dalpha = self._delta[m:]

    @property
    def shared_len(self) -> int:
        return self._delta.shape[0]

    def _deal(self, round_index: int) -> None:
        self.solver.dealt = self.solver.schedule.deal(self.p.seed, round_index, self.comm.rank,
                                                      self.comm.size)

    def propose(self, round_index: int) -> None:
        self._deal(round_index)
        super().propose(round_index)

    def evaluate_and_propose(self, round_index: int) -> np.ndarray:
        self._deal(round_index)
        return super().evaluate_and_propose(round_index)

    def eval_pieces(self) -> np.ndarray:
        d, n, k, r = self.data, self.data.n_rows, self.comm.size, self.comm.rank
        return np.array(objective_sums_rows(
            d.indptr, self.solver.indices, d.values, d.labels, d.weights, self.alpha, self.w,
            self.loss, self.p.bias_scale, self.space.size, r * n // k, (r + 1) * n // k))

    def shared_delta(self) -> np.ndarray:
        return self._delta

    def gamma(self, delta: np.ndarray, sums: np.ndarray) -> float:
        return super().gamma(delta[:self.w.shape[0]], sums)

    def apply(self, gamma: float, delta: np.ndarray) -> None:
        m = self.w.shape[0]
        apply_dual_step(self.loss, self.data.labels, self.alpha, delta[m:], gamma)
        axpy(self.w, gamma, delta[:m])

    def model(self) -> np.ndarray:
        return self.space.expand(self.w)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.alpha.copy(), self.space.expand(self.w)

    def restore(self, local: np.ndarray, shared: np.ndarray) -> None:
        n, m = self.data.n_rows, self.data.n_features + 1
        if local.shape != (n,) or shared.shape != (m,):
            raise ValueError(f"resume state does not fit these rows: alpha {local.shape} vs {(n,)}, "
                             f"w {shared.shape} vs {(m,)}")
        w = self.space.compact(shared)
        if not np.array_equal(self.space.expand(w), shared):
            raise ValueError("resume state: w is non-zero on features that no row holds")
        np.copyto(self.alpha, local)
        np.copyto(self.w, w)
