"""L-BFGS preconditioners M⁻¹ ≈ (∇²f)⁻¹ at the start of the phase: Jacobi, and Jacobi plus a
field-level coarse correction.

**Jacobi** (:class:`Jacobi`): M⁻¹ = D⁻¹, D = diag ∇²f floored at 1e-12·max D.

**Two-level** (:class:`TwoLevel`): M⁻¹ = D⁻¹ + S·E⁻¹·Sᵀ, the additive two-level preconditioner of
domain decomposition, with a coarse space S of one column per feature group (a field of the
click log, from the dataset's group map) and one for the intercept, and E = Sᵀ·∇²f·S exact on
it. Why: with one-hot fields every row holds exactly one feature of a field without missing
values, so adding c to all of that field's weights and −c to the intercept leaves every margin
unchanged. Along such directions the objective bends only through the penalty (λ times the
field's size), while D sees the data's curvature: the diagonal overestimates their curvature by
orders of magnitude and L-BFGS crawls along them. E has one row per group: ~40 for Criteo.
(The evidence that the error left near the optimum lies along these directions:
``docs/pages/explanation/design-notes.md``.)

E's data part is estimated from every ``stride``-th run of 512 rows of each rank
(:mod:`solvers.kernels.sampling`: about 2¹⁵ rows per rank; every row on small shards): a
direction the data do not bend is not bent in any subset of rows either, so sampling keeps E's
near-null directions exact and only blurs the well-determined part. Every rank factors the same AllReduced E (a deterministic
LDLᵀ with pivots floored at 1e-12·max E_gg) and applies the same arithmetic: ranks never drift.
"""

from __future__ import annotations

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.data import NO_GROUP
from terascale.solvers.kernels import coarse as C
from terascale.solvers.kernels.sampling import sample_stride
from terascale.solvers.kernels.vector import weighted_dot
from terascale.solvers.state import own
from terascale.solvers.threads import SERIAL, RowThreads

_DIAG_FLOOR = 1e-12
#: Rows per rank the coarse matrix is estimated from (at least; every row below twice this).
COARSE_SAMPLE_ROWS = 1 << 15


def jacobi_inverse(hess_diag: np.ndarray) -> np.ndarray:
    """1 / max(D_j, 1e-12·max D) (1 everywhere if D is all zero)."""
    return 1.0 / np.maximum(hess_diag, _floor(hess_diag))


def _floor(diag: np.ndarray) -> float:
    """1e-12·max of a (Hessian) diagonal, or 1 if it has no positive entry."""
    top = float(diag.max()) if diag.size else 0.0
    return _DIAG_FLOOR * top if top > 0.0 else 1.0


class Jacobi:
    kind = "jacobi"

    def __init__(self, inv_diag: np.ndarray):
        self.inv_diag = inv_diag

    def apply(self, q: np.ndarray) -> np.ndarray:
        """M⁻¹·q as a new float64 array."""
        return q * self.inv_diag

    def quad(self, y: np.ndarray) -> float:
        """yᵀ·M⁻¹·y."""
        return weighted_dot(y, self.inv_diag, y)

    def to_state(self) -> dict[str, np.ndarray]:
        return {"lbfgs_inv_diag": self.inv_diag}


class TwoLevel(Jacobi):
    """D⁻¹ + S·E⁻¹·Sᵀ over the compact coordinates; ``group[j]`` the coarse column of active
    feature j (-1: none), ``E`` the (G+1)×(G+1) coarse matrix (the intercept's column last)."""

    kind = "two_level"

    def __init__(self, inv_diag: np.ndarray, group: np.ndarray, E: np.ndarray):
        super().__init__(inv_diag)
        self.group = np.ascontiguousarray(group, dtype=np.int16)
        self.E = np.ascontiguousarray(E, dtype=np.float64)
        self.n_groups = self.E.shape[0] - 1
        self.L, self.D = C.ldl_factor(self.E, _floor(np.diag(self.E)))

    def _coarse(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = np.empty(self.n_groups + 1)
        C.restrict(q, self.group, self.n_groups, t)
        z = t.copy()
        C.ldl_solve(self.L, self.D, z)
        return t, z

    def apply(self, q: np.ndarray) -> np.ndarray:
        r = q * self.inv_diag
        C.prolong(self._coarse(q)[1], self.group, self.n_groups, r)
        return r

    def quad(self, y: np.ndarray) -> float:
        t, z = self._coarse(y)
        return weighted_dot(y, self.inv_diag, y) + float(sum((t * z).tolist()))

    def to_state(self) -> dict[str, np.ndarray]:
        return {"lbfgs_inv_diag": self.inv_diag, "lbfgs_coarse_group": self.group, "lbfgs_coarse_E": self.E}


def from_state(saved: dict) -> Jacobi:
    inv_diag = own(saved, "lbfgs_inv_diag", np.float64)
    if "lbfgs_coarse_E" in saved:
        return TwoLevel(inv_diag, np.asarray(saved["lbfgs_coarse_group"]), np.asarray(saved["lbfgs_coarse_E"]))
    return Jacobi(inv_diag)


def compact_groups(group_map: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The coarse column of each active feature (``ids``, compact order) from the dataset's
    group map (uint8 by feature id, NO_GROUP = none): the groups that occur, renumbered 0..G−1 in
    group order; -1 for a feature in none. Returns (group int16, the size of each of the G
    groups); the same on every rank."""
    raw = group_map[ids]
    counts = np.bincount(raw, minlength=NO_GROUP + 1)[:NO_GROUP]
    present = np.flatnonzero(counts)
    lookup = np.full(NO_GROUP + 1, -1, dtype=np.int16)
    lookup[present] = np.arange(present.size, dtype=np.int16)
    return lookup[raw], counts[present].astype(np.float64)


def coarse_matrix(comm: Communicator, table, group: np.ndarray, sizes: np.ndarray, theta: np.ndarray,
                  loss_id: int, l2: float, total_weight: float, threads: RowThreads = SERIAL) -> np.ndarray | None:
    """E = Sᵀ·∇²f(θ)·S over all ranks (one AllReduce of (G+1)²+1 numbers): each rank's sampled
    sum scaled up by its weight over the weight of the rows used, divided by W, plus λ·|group g|
    on the diagonal (the intercept unpenalized). ``table``: the rank's working table (bound);
    ``group``: compact, ``sizes``: of the groups; ``threads``: the rank's threads (the sampled
    sum is then one per row block, added in block order). None if a margin was not finite on
    some rank."""
    n_groups = sizes.shape[0]
    k = n_groups + 1
    local = np.zeros(k * k + 1)
    E = local[: k * k].reshape(k, k)
    problem = table.coarse_sums(theta, group, n_groups, loss_id, sample_stride(table.shard.n_rows, COARSE_SAMPLE_ROWS), E,
                              threads)
    local[-1] = 0.0 if problem is None else 1.0
    tot = comm.allreduce(local)
    if tot[-1] != 0.0:
        return None
    out = tot[: k * k].reshape(k, k) / total_weight
    out[np.arange(n_groups), np.arange(n_groups)] += l2 * sizes
    return out if np.isfinite(out).all() else None
