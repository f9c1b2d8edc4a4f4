"""Per-thread replicas of the hot features for the Hogwild online pass (:mod:`solvers.hot`).

With T threads on one shared state table, every row updates the intercept and, in click data,
several very frequent features (on the 2M-row benchmark 2048 features hold 78% of the
non-zeros): the threads write the same cache lines all the time and the pass runs at about one
thread's speed. Giving each thread its own rows for those features removes the contention; the
rest of the table stays shared, lock-free (Hogwild).

Layout. The state table is extended below the canonical rows 0..n (n features, the intercept at
row n): thread i's block starts at row ``first`` + i·stride (``first`` ≥ n + 1; where the blocks
start and how far apart they lie is :mod:`solvers.hot`'s choice) and holds the replicas of hot
features q = 0..H−1 and, at q = H, of the intercept. The shard's indices are relabelled in place:
an entry of hot feature ``hot_ids[q]`` becomes n + 1 + q (:func:`relabel`; :func:`unlabel` undoes
it exactly); the online kernel adds the thread's offset ``first`` − (n + 1) + i·stride to every
index above n and reads the intercept from the thread's row ``first`` + i·stride + H.

Merge, after each pass, for each hot feature and the intercept (canonical row c with w₀, G₀,
s₀; replica i with wᵢ, Gᵢ, sᵢ, seeded from row c before the pass, :func:`seed_replicas`):

    s = max(s₀, maxᵢ sᵢ);  ΔGᵢ = Gᵢ − G₀;  G = G₀ + Σᵢ ΔGᵢ   (what one sequential pass accumulates)
    w = Σᵢ ΔGᵢ·wᵢ·(sᵢ/s) / Σᵢ ΔGᵢ   (w₀·s₀/s when no replica moved)

the per-coordinate weighted average of the terascale paper's rank averaging, weighted by the
squared gradient each thread added (wᵢ·sᵢ/s puts a replica whose normalizer grew less on the
merged scale; when one replica moved, w is its weight exactly, so one thread gives the
sequential pass's bits), and the L1 shrink clock (column 3) the latest of the replicas'. Arithmetic in
float64, stored float32.
"""

from __future__ import annotations

import numpy as np
from numba import njit

W = 0
G = 1
S = 2
CLOCK = 3


@njit(cache=True, nogil=True)
def relabel(indices, lo, hi, hot_bits, hot_slot, n, marks):
    """indices[k] = n + 1 + hot_slot[j] for the entries k in lo..hi-1 whose feature j has its
    bit set in ``hot_bits`` (bit j % 8 of byte j // 8); marks[j] = 1 for every entry's feature j
    (the features the data hold, which the online learner agrees on with the other ranks: one
    walk of the entries for both). Threads relabelling other ranges may share ``marks``: they only
    ever store 1, so the marks are those of one sequential walk."""
    for k in range(lo, hi):
        j = indices[k]
        if marks[j] == 0:  # read first: stores to the hot features' lines would bounce between threads
            marks[j] = 1
        if hot_bits[j >> 3] & (1 << (j & 7)):
            indices[k] = n + 1 + hot_slot[j]


@njit(cache=True, nogil=True)
def unlabel(indices, lo, hi, hot_ids, n):
    """Undo :func:`relabel`: indices[k] = hot_ids[indices[k] − n − 1] where indices[k] > n."""
    for k in range(lo, hi):
        j = indices[k]
        if j > n:
            indices[k] = hot_ids[j - n - 1]


@njit(cache=True, nogil=True)
def seed_replicas(state, hot_ids, n, first, stride, threads):
    """Copy every hot feature's canonical row, and the intercept's (row n), into each thread's
    block (module docstring)."""
    h = hot_ids.shape[0]
    for i in range(threads):
        base = first + i * stride
        for q in range(h + 1):
            c = hot_ids[q] if q < h else n
            for col in range(state.shape[1]):
                state[base + q, col] = state[c, col]


@njit(cache=True, nogil=True)
def merge_replicas(state, hot_ids, n, first, stride, threads):
    """Merge the threads' replicas into the canonical rows (module docstring)."""
    h = hot_ids.shape[0]
    for q in range(h + 1):
        c = hot_ids[q] if q < h else n
        w0 = float(state[c, W])
        g0 = float(state[c, G])
        s0 = float(state[c, S])
        s = s0
        clock = state[c, CLOCK]
        for i in range(threads):
            r = first + i * stride + q
            s = max(s, float(state[r, S]))
            clock = max(clock, state[r, CLOCK])
        num = 0.0
        den = 0.0
        moved = 0
        last = 0.0
        for i in range(threads):
            r = first + i * stride + q
            dg = float(state[r, G]) - g0
            if dg > 0.0:
                si = float(state[r, S])
                wi = float(state[r, W])
                if si > 0.0 and si < s:
                    wi *= si / s
                num += dg * wi
                den += dg
                moved += 1
                last = wi
        if moved == 1:  # that replica's weight itself (one thread: the sequential pass's bits)
            state[c, W] = np.float32(last)
        elif den > 0.0:
            state[c, W] = np.float32(num / den)
        elif s0 > 0.0 and s0 < s:
            state[c, W] = np.float32(w0 * s0 / s)
        state[c, G] = np.float32(g0 + den)
        state[c, S] = np.float32(s)
        state[c, CLOCK] = clock
