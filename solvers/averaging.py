"""Per-coordinate weighted averaging of the ranks' online states (terascale paper, Eq. 2).

After an online pass rank k holds weights w_k and accumulated squared gradients G_k (intercept
included as the last coordinate). ONE AllReduce of the float32 vector ``[G_k⊙w_k | G_k | bad_k]``
gives every rank

    w̄_j = Σ_k G_kj·w_kj / Σ_k G_kj     (w̄_j = 0 where Σ_k G_kj = 0: no rank learned anything there)
    Ḡ_j = (1/K)·Σ_k G_kj               (the mean, carried into the next pass)

so a rank that saw more (and larger) gradients of a feature has more say in its weight.

The vector covers only the features in ``ids``: those some rank holds in its data or has a
non-zero w or G for, agreed once, at the first averaging (:meth:`OnlineLearner.agree_features
<solvers.online.OnlineLearner.agree_features>`). Every other feature has w = G = 0 on every rank,
where the formulas give 0 as well, so its row is left as it is: the same bits as averaging every
row, with 2·(|ids| + 1) floats instead of 2·(2^bits + 1).

Why the mean for Ḡ: each next pass again runs over one shard, and with the mean a rank
continues with the per-coordinate step sizes of a learner that has seen one shard's worth of
gradients, the same scale it had during its own pass (K = 1 reduces exactly to a
single-machine multi-pass run); the sum would shrink every step size by up to √K.

Why float32: the state and the weights are float32, and the AllReduce adds in a binary tree,
so the rounding error of the sums grows with the tree depth log₂K (≲ 10·2⁻²⁴ relative to
Σ_k |G_kj·w_kj| at K = 1000), below the float32 rounding of the result; float64 would double
the bytes of the online phase's only large collective.
"""

from __future__ import annotations

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.kernels.online import pack_for_average, unpack_average


def average_online_state(comm: Communicator, state: np.ndarray, ids: np.ndarray, local_bad: bool) -> int:
    """Replace ``state[:, W]`` and ``state[:, G]`` of the rows ``ids`` and the intercept's by
    the averages over all ranks, in place.

    Returns the number of ranks that reported a problem (``local_bad``); if non-zero the state
    is left as it was and the caller raises.
    """
    n = ids.shape[0] + 1
    buf = np.empty(2 * n + 1, dtype=np.float32)
    pack_for_average(state, ids, buf)
    buf[-1] = 1.0 if local_bad else 0.0
    tot = comm.allreduce(buf)
    n_bad = int(tot[-1])
    if n_bad:
        return n_bad
    unpack_average(tot, state, ids, comm.size)
    return 0
