"""Working spaces of the features that occur: the L-BFGS phase's (the features in some rank's
data or non-zero at the start, in id order, :meth:`agree`) and the dual CoCoA local solver's
(one shard's own features by frequency in it, :meth:`of_indices`, no collective).

A coordinate j that no row touches has ∂f/∂β_j = λ·β_j. Started at 0 it stays exactly 0 in
every L-BFGS iterate: the direction is a linear combination of gradients and past steps, all 0
there. So the phase runs on the active coordinates only. With hashed click features most of the
2^bits buckets are empty (about 1.4M of 4.2M at 2M rows, bits 22), so its vectors, curvature
pairs and AllReduce shrink by that factor. Each rank's CSR pass runs on a table of its own
features laid out for the cache (:mod:`solvers.local_table`); the compact order itself only
serves the vector arithmetic.

The set is agreed with one float32 AllReduce of per-feature marks (1 where a rank holds the
feature): a sum of ones is never 0, and AllReduce returns the same bytes everywhere.
"""

from __future__ import annotations

import numpy as np

from allreduce.communicator import Communicator
from solvers.kernels.features import count_features, renumber, scatter_ids


class ActiveFeatures:
    """``ids[c]`` is the feature behind compact coordinate c; the intercept stays last."""

    def __init__(self, ids: np.ndarray, n_features: int):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.n_features = int(n_features)
        self.position = np.full(self.n_features, -1, dtype=np.int32)
        self.position[self.ids] = np.arange(self.ids.shape[0], dtype=np.int32)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def agree(cls, comm: Communicator, local_ids: np.ndarray, n_features: int,
              theta0: np.ndarray) -> ActiveFeatures:
        """The set over all ranks, in id order (one AllReduce of float32 marks): the features
        in ``local_ids`` (this rank's) of some rank, or non-zero in ``theta0`` (the same on
        every rank)."""
        marks = np.zeros(n_features, dtype=np.float32)
        marks[local_ids] = 1.0
        total = comm.allreduce(marks)
        return cls(np.flatnonzero((total > 0.0) | (theta0[:-1] != 0.0)), n_features)

    @classmethod
    def of_indices(cls, indices: np.ndarray, n_features: int) -> ActiveFeatures:
        """The features of one shard alone (no collective), by count in it, then id."""
        counts = np.zeros(n_features, dtype=np.uint32)
        count_features(indices, counts)
        ids = np.flatnonzero(counts)
        return cls(ids[np.argsort(-counts[ids].astype(np.int64), kind="stable")], n_features)

    @classmethod
    def everything(cls, n_features: int) -> ActiveFeatures:
        """Every feature in id order (a checkpoint written before the phase was compacted)."""
        return cls(np.arange(n_features, dtype=np.int64), n_features)

    def compact(self, theta: np.ndarray) -> np.ndarray:
        """[β, b] over all features -> [β over the active ones, b]."""
        return np.append(theta[self.ids], theta[-1])

    def expand(self, theta: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`compact`; inactive features get 0."""
        out = np.zeros(self.n_features + 1, dtype=np.float64)
        self.scatter(theta, out)
        return out

    def scatter(self, theta: np.ndarray, out: np.ndarray) -> None:
        """out[ids] = θ[:-1] and out[-1] = θ[-1]; the other entries of ``out`` are kept."""
        scatter_ids(theta, self.ids, out)

    def renumbered(self, indices: np.ndarray) -> np.ndarray:
        """Feature indices (int32) in compact numbering, as a new array."""
        out = np.empty(indices.shape, dtype=np.int32)
        if renumber(indices, self.position, out) < 0:
            raise ValueError("the shard holds a feature outside the agreed active set")
        return out
