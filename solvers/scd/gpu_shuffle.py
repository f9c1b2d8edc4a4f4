"""Epoch permutations made on the device: a keyed Feistel bijection with cycle walking.

The CPU solvers draw each epoch's order from ``numpy.random.default_rng((seed, rank, round,
epoch))`` (a permutation of buckets of consecutive coordinates, for cache locality; the GPU has
no such need, one thread block per coordinate); uploading an order would put ``8 n`` bytes on the
PCIe bus every epoch, more than the shared vector when a shard has many coordinates. Instead the GPU solver
fills its order buffer on the device with

    order[t] = first value < n of  F(t), F(F(t)), ...       t = 0 .. n - 1

where ``F`` is a 4-round balanced Feistel network on ``b``-bit integers (``2^b >= n``, ``b``
even, so ``2^b < 4n`` and the walk takes fewer than 4 steps on average). A Feistel network is a
bijection of ``[0, 2^b)`` whatever its round function, and cycle walking restricts a bijection
to ``[0, n)``, so ``order`` is a permutation. The four 32-bit round keys come from
``numpy.random.SeedSequence((seed, rank, round, epoch, _TAG))``: deterministic per (seed, rank,
round, epoch), and only four scalars (kernel arguments) cross the bus. The round function is an
integer hash (xorshift-multiply, odd multipliers below 2^31, so every product of a 32-bit value
stays below 2^63 in int64 arithmetic, on the device, in the simulator and in numpy alike).

``host_permutation`` is the numpy twin (tests, and a CPU replay of a GPU run's orders).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

import terascale.solvers.scd.numba_compat  # noqa: F401 - np.row_stack before the first kernel compiles

_TAG = 0x5CD6  # separates these keys from the CPU solvers' generators on the same entropy
_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x2C1B3C6D


def domain_bits(n: int) -> tuple[int, int]:
    """(half_bits, half_mask) of the Feistel domain for a permutation of ``n`` items."""
    b = max(2, (max(n, 1) - 1).bit_length())
    b += b & 1
    half = b // 2
    return half, (1 << half) - 1


def epoch_keys(seed: int, rank: int, round_index: int, epoch: int) -> tuple[int, int, int, int]:
    """The four round keys of one epoch (32-bit, as Python ints)."""
    state = np.random.SeedSequence((seed, rank, round_index, epoch, _TAG)).generate_state(4, np.uint32)
    return int(state[0]), int(state[1]), int(state[2]), int(state[3])


# -- device ----------------------------------------------------------------------------------


@cuda.jit(device=True)
def _mix(h):
    h = h & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h ^= h >> 16
    return h


@cuda.jit(device=True)
def _feistel(v, half, mask, k0, k1, k2, k3):
    left = v >> half
    right = v & mask
    left, right = right, left ^ (_mix(right ^ k0) & mask)
    left, right = right, left ^ (_mix(right ^ k1) & mask)
    left, right = right, left ^ (_mix(right ^ k2) & mask)
    left, right = right, left ^ (_mix(right ^ k3) & mask)
    return (left << half) | right


@cuda.jit
def permutation_kernel(order, n, half, mask, k0, k1, k2, k3):
    """order[t] = the cycle-walked Feistel image of t, for t < n (grid-stride)."""
    for t in range(cuda.grid(1), n, cuda.gridsize(1)):
        v = _feistel(t, half, mask, k0, k1, k2, k3)
        while v >= n:
            v = _feistel(v, half, mask, k0, k1, k2, k3)
        order[t] = v


# -- host twin -------------------------------------------------------------------------------


def _mix_np(h: np.ndarray) -> np.ndarray:
    h = h & _MASK32
    h ^= h >> 16
    h = (h * _M1) & _MASK32
    h ^= h >> 15
    h = (h * _M2) & _MASK32
    h ^= h >> 16
    return h


def _feistel_np(v: np.ndarray, half: int, mask: int, keys) -> np.ndarray:
    left, right = v >> half, v & mask
    for k in keys:
        left, right = right, left ^ (_mix_np(right ^ k) & mask)
    return (left << half) | right


def host_permutation(n: int, keys) -> np.ndarray:
    """The permutation ``permutation_kernel`` writes for these keys (int64, numpy)."""
    half, mask = domain_bits(n)
    v = _feistel_np(np.arange(n, dtype=np.int64), half, mask, keys)
    out = v >= n
    while out.any():
        v[out] = _feistel_np(v[out], half, mask, keys)
        out = v >= n
    return v
