"""The local solvers: H epochs of SCD on a worker's CoCoA subproblem, sequential or threaded.

``threads == 1`` is the reference: one random order of the coordinates per epoch (a permutation
of buckets of ``bucket_size`` consecutive coordinates, see ``_Schedule``).
``threads > 1`` is the Snap ML scheme (buckets of consecutive coordinates, reshuffled and dealt
to the partitions every epoch, thread-local shared-vector replicas merged by adding, i.e.
sigma_part = sigma' * threads); see ``dual_kernels`` / ``primal_kernels``. The permutations come
from ``numpy.random.default_rng((seed, rank, round, epoch))``, so a run is reproducible and a
resumed run repeats the uninterrupted one exactly; the threaded result does not depend on
thread timing either.

Partitions are numba ``prange`` iterations; numba runs them on
``min(threads, NUMBA_NUM_THREADS)`` OS threads (``numba.set_num_threads``, restored after).
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np

from terascale.solvers.active import ActiveFeatures
from terascale.solvers.data import CSRData
from terascale.solvers.scd.dual_kernels import (
    dual_epoch,
    dual_epoch_buckets,
    dual_epoch_with_gap,
    row_sq_norms,
)
from terascale.solvers.scd.partition import FeatureBlock
from terascale.solvers.scd.primal_kernels import col_sq_norms, primal_epoch, primal_epoch_buckets


@contextlib.contextmanager
def numba_threads(n: int):
    """Run numba parallel kernels on up to ``n`` threads inside the block (thread-local)."""
    prev = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(prev)


def epoch_rng(seed: int, rank: int, round_index: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng((seed, rank, round_index, epoch))


class _Schedule:
    """Coordinate order of each epoch: a random permutation of buckets of ``bucket_size``
    consecutive coordinates (``bucket_size = 1``: a plain permutation).

    The threaded kernels take the bucket permutation itself. The sequential kernel takes it
    expanded to coordinates: bucket by bucket, each bucket's coordinates in storage order. That
    order reads the data in runs of consecutive rows (columns) instead of one cache miss per
    coordinate, and with small buckets the gap per epoch stays that of the plain permutation
    (larger buckets slow it: SDCA at small lambda N is sensitive to repeating the same
    neighbours every epoch). Measurements: docs/pages/explanation/design-notes.md.
    """

    def __init__(self, n_coords: int, threads: int, bucket_size: int) -> None:
        self.n = n_coords
        self.threads = threads
        self.bucket_size = bucket_size
        self.n_buckets = -(-n_coords // bucket_size)

    def order(self, rng: np.random.Generator, dealt: np.ndarray | None = None) -> np.ndarray:
        """This epoch's order: all buckets, or only the ``dealt`` ones, in a random order."""
        buckets = rng.permutation(self.n_buckets if dealt is None else dealt)
        if self.threads > 1 or self.bucket_size == 1:
            return buckets
        order = (buckets[:, None] * self.bucket_size + np.arange(self.bucket_size)).ravel()
        return order if self.n % self.bucket_size == 0 else order[order < self.n]

    def deal(self, seed: int, round_index: int, rank: int, size: int) -> np.ndarray:
        """The buckets rank ``rank`` of ``size`` works on in round ``round_index``: one random
        permutation of all buckets per round (the same on every rank), dealt round-robin. The
        ranks' shares are disjoint and cover every bucket."""
        rng = np.random.default_rng((seed, round_index, size))
        return np.sort(rng.permutation(self.n_buckets)[rank::size])


class DualLocalSolver:
    """SDCA epochs on one example shard: updates a copy of alpha and a replica u of the shared
    vector w; ``scale = sigma / (lam N)``. Callers pass w and get u with n_features + 1 entries.

    The epochs run on the shard's own features only, renumbered by frequency in the shard
    (:meth:`solvers.active.ActiveFeatures.of_indices`): the hot features share a few cache
    lines, and u, the replicas and the gap's (w, u) pairs shrink to the features that occur.
    Renaming changes no sum (each row keeps its order of non-zeros), so alpha and u are the same
    bits as over all features; features the shard lacks keep u = w.
    """

    def __init__(self, data: CSRData, loss: int, lam: float, n_weight: float, bias_scale: float,
                 threads: int = 1, bucket_size: int = 8) -> None:
        self.d = data
        self.space = ActiveFeatures.of_indices(data.indices, data.n_features)
        self.indices = self.space.renumbered(data.indices)
        dim = self.space.size + 1
        self.loss = loss
        self.lam_n = lam * n_weight
        self.bias_scale = float(bias_scale)
        self.bias_index = self.space.size
        self.sqn = row_sq_norms(data.indptr, data.values, self.bias_scale)
        self.schedule = _Schedule(data.n_rows, threads, bucket_size)
        self.alpha = np.zeros(data.n_rows)
        self.u = np.zeros(dim)
        self.u_full = np.zeros(data.n_features + 1)  # u over all features, what callers get
        # thread-local replicas (column 1) beside a copy of u (column 0), see dual_epoch_buckets
        self.replicas = np.zeros((threads, dim, 2)) if threads > 1 else None
        self.wu: np.ndarray | None = None  # (dim, 2) of solve_with_gap, made on first use
        self.dealt: np.ndarray | None = None  # this round's buckets (None: all of them)
        # True: callers pass w and get u in this solver's compact numbering ([active, bias])
        self.compact_io = False

    def _result(self, w: np.ndarray) -> np.ndarray:
        """u over all features: w where the shard has no feature (``compact_io``: u itself)."""
        if self.compact_io:
            return self.u
        np.copyto(self.u_full, w)
        self.space.scatter(self.u, self.u_full)
        return self.u_full

    def solve_with_gap(self, alpha: np.ndarray, w: np.ndarray, sigma: float, epochs: int,
                       seed: int, rank: int, round_index: int
                       ) -> tuple[np.ndarray, np.ndarray, tuple[float, float]]:
        """``solve`` plus the gap sums of the starting point (alpha, w), taken during the first
        epoch (``dual_epoch_with_gap``, or ``dual_epoch_buckets`` with ``with_gap``) instead of
        by a separate pass. The same orders and steps as ``solve``: the same alpha and u."""
        np.copyto(self.alpha, alpha)
        d, s = self.d, self.schedule
        w_local = w if self.compact_io else self.space.compact(w)
        if self.replicas is not None:
            np.copyto(self.u, w_local)
            sums = self._threaded_epoch(sigma, s.order(epoch_rng(seed, rank, round_index, 0), self.dealt), True)
        else:
            if self.wu is None:
                self.wu = np.empty((self.u.shape[0], 2))
            self.wu[:, 0] = w_local
            self.wu[:, 1] = w_local
            sums = dual_epoch_with_gap(d.indptr, self.indices, d.values, d.labels, d.weights,
                                       self.sqn, self.alpha, self.wu,
                                       s.order(epoch_rng(seed, rank, round_index, 0), self.dealt), self.loss,
                                       sigma / self.lam_n, self.bias_scale, self.bias_index)
            np.copyto(self.u, self.wu[:, 1])  # later epochs use the contiguous u
        self._epochs(sigma, range(1, epochs), seed, rank, round_index)
        return self.alpha, self._result(w), sums

    def solve(self, alpha: np.ndarray, w: np.ndarray, sigma: float, epochs: int,
              seed: int, rank: int, round_index: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (alpha after the epochs, u = w + sigma dw_local); both are this solver's buffers."""
        np.copyto(self.alpha, alpha)
        np.copyto(self.u, w if self.compact_io else self.space.compact(w))
        self._epochs(sigma, range(epochs), seed, rank, round_index)
        return self.alpha, self._result(w)

    def _epochs(self, sigma: float, epochs: range, seed: int, rank: int, round_index: int) -> None:
        d, s = self.d, self.schedule
        for e in epochs:
            order = s.order(epoch_rng(seed, rank, round_index, e), self.dealt)
            if self.replicas is None:
                dual_epoch(d.indptr, self.indices, d.values, d.labels, d.weights, self.sqn, self.alpha,
                           self.u, order, self.loss, sigma / self.lam_n, self.bias_scale,
                           self.bias_index)
            else:
                self._threaded_epoch(sigma, order, False)

    def _threaded_epoch(self, sigma: float, bucket_order: np.ndarray,
                        with_gap: bool) -> tuple[float, float]:
        d, s = self.d, self.schedule
        with numba_threads(s.threads):
            return dual_epoch_buckets(d.indptr, self.indices, d.values, d.labels, d.weights,
                                      self.sqn, self.alpha, self.u, bucket_order, s.bucket_size,
                                      self.replicas, self.loss, sigma * s.threads / self.lam_n,
                                      self.bias_scale, self.bias_index, with_gap)


class PrimalLocalSolver:
    """Ridge SCD epochs on a block of columns: updates a copy of beta (the block) and a replica
    u of the margins z (all rows)."""

    def __init__(self, block: FeatureBlock, lam: float, n_weight: float, threads: int = 1,
                 bucket_size: int = 8) -> None:
        self.b = block
        self.lam_n = lam * n_weight
        self.csq = col_sq_norms(block.colptr, block.rows, block.vals, block.weights)
        m = block.colptr.shape[0] - 1
        n = block.labels.shape[0]
        self.schedule = _Schedule(m, threads, bucket_size)
        self.beta = np.zeros(m)
        self.u = np.zeros(n)
        self.replicas = np.zeros((threads, n)) if threads > 1 else None

    def solve(self, beta: np.ndarray, z: np.ndarray, sigma: float, epochs: int,
              seed: int, rank: int, round_index: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (beta after the epochs, u = z + sigma dz_local); both are this solver's buffers."""
        np.copyto(self.beta, beta)
        np.copyto(self.u, z)
        b, s = self.b, self.schedule
        for e in range(epochs):
            order = s.order(epoch_rng(seed, rank, round_index, e))
            if self.replicas is None:
                primal_epoch(b.colptr, b.rows, b.vals, b.labels, b.weights, self.csq, self.beta,
                             self.u, order, self.lam_n, sigma)
            else:
                with numba_threads(s.threads):
                    primal_epoch_buckets(b.colptr, b.rows, b.vals, b.labels, b.weights, self.csq,
                                         self.beta, self.u, order, s.bucket_size, self.replicas,
                                         self.lam_n, sigma * s.threads)
        return self.beta, self.u
