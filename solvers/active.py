"""Working spaces of the features that occur: the L-BFGS phase's (the features in some rank's
data or non-zero at the start, in id order, :meth:`agree`; after the hybrid's online phase, the
set it averaged, see :mod:`solvers.averaging`) and the dual CoCoA local solver's (one shard's
own features by frequency in it, :meth:`of_indices`, no collective).

A coordinate j that no row touches has ∂f/∂β_j = λ·β_j. Started at 0 it stays exactly 0 in
every L-BFGS iterate: the direction is a linear combination of gradients and past steps, all 0
there. So the phase runs on the active coordinates only. With hashed click features most of the
2^bits buckets are empty, so its vectors, curvature pairs and AllReduce shrink by that
factor. Each rank's CSR pass runs on a table of its own features laid out for the cache
(:mod:`solvers.local_table`); the compact order itself only serves the vector arithmetic.

The set is agreed with one AllReduce of per-feature presence marks (:func:`agree_marks`): each
rank marks its features with 1, and with K ranks a feature's sum over ranks is a count in
0..K, one digit in base K+1. A float32 word holds m such digits exactly as long as
(K+1)^m ≤ 2²⁴ (every partial sum of the AllReduce is then an integer below 2²⁴, so the sum is
exact in any order): 15 features per word at K = 2, 24 at K = 1, 5 at K = 16, instead of one
float32 per feature (1.1 MB instead of 16.8 MB at bits 22, K = 2).
"""

from __future__ import annotations

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.kernels.features import (
    count_features,
    pack_marks,
    renumber,
    scatter_ids,
    unpack_marks,
)


def _word_layout(n_ranks: int) -> tuple[int, int, type]:
    """(base, digits per word, float dtype) for counts 0..n_ranks: float32 words when at least
    one digit fits in 24 bits, else float64 (53 bits)."""
    base = n_ranks + 1
    for dtype, bits in ((np.float32, 24), (np.float64, 53)):
        digits, top = 0, 1
        while top * base <= 1 << bits:
            top *= base
            digits += 1
        if digits:
            return base, digits, dtype
    raise ValueError(f"{n_ranks} ranks: too many to count presence marks exactly")


def agree_marks(comm: Communicator, marks: np.ndarray) -> np.ndarray:
    """The features some rank marked (``marks``: uint8 0/1 per feature, this rank's), in id
    order, from one AllReduce of the marks packed as base-(K+1) digits (module docstring)."""
    base, digits, dtype = _word_layout(comm.size)
    words = np.empty(-(-marks.shape[0] // digits), dtype=dtype)
    pack_marks(marks, base, digits, words)
    total = comm.allreduce(words)
    present = np.empty(marks.shape[0], dtype=np.uint8)
    unpack_marks(total, base, digits, present)
    return np.flatnonzero(present)


class ActiveFeatures:
    """``ids[c]`` is the feature behind compact coordinate c; the intercept stays last."""

    def __init__(self, ids: np.ndarray, n_features: int):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.n_features = int(n_features)

    @property
    def position(self) -> np.ndarray:
        """int32 over all features: the compact coordinate of each active feature, −1 for the
        others. 4 bytes × 2^bits (64 MiB at 2^24), used once per table (:meth:`LocalTable.bind`,
        :meth:`renumbered`): built on each use, not kept for the phase."""
        out = np.full(self.n_features, -1, dtype=np.int32)
        out[self.ids] = np.arange(self.ids.shape[0], dtype=np.int32)
        return out

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def agree(cls, comm: Communicator, local_ids: np.ndarray, n_features: int,
              theta0: np.ndarray) -> ActiveFeatures:
        """The set over all ranks, in id order (one AllReduce, :func:`agree_marks`): the
        features in ``local_ids`` (this rank's) of some rank, or non-zero in ``theta0`` (the
        same on every rank)."""
        marks = (theta0[:-1] != 0.0).view(np.uint8)
        marks[local_ids] = 1
        return cls(agree_marks(comm, marks), n_features)

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
