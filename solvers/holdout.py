"""Which rows are held out for early stopping: a pure function of each row's identity.

A row's identity is (its file's name relative to the dataset root, as the manifest records it;
its index within that file, counted from 0 over all the file's row groups). Whether it is held
out depends on nothing else: not on the shard it lands in, its position there, the number of
workers or where the dataset lives, so every ``train.workers`` trains on the same rows.

The hash (64-bit, defined here and nowhere else; ``tests/solvers/test_holdout_rows.py`` checks
it against a slow reference and SplitMix64's published outputs):

- file key: the first 8 bytes, big-endian, of SHA-256 over the UTF-8 name (``part-00003.parquet``,
  or ``dt=2024-01-01/part-00003.parquet`` for a file in a subdirectory);
- stream state: ``file key XOR mix64(seed)`` (``seed``: ``train.seed``; changing it draws
  another split; ``mix64(0) = 0``);
- row ``r``'s hash: ``mix64(state + (r + 1) * 0x9E3779B97F4A7C15 mod 2^64)``, i.e. output ``r``
  (from 0) of SplitMix64 (Steele, Lea & Flood 2014; ``java.util.SplittableRandom``) seeded with
  the state, where ``mix64`` is SplitMix64's finalizer (Stafford's variant 13:
  ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``).

A row is held out when its hash < ``floor(2^64 / period)``: a fraction 1/period of the hash
range. Period 0 holds out nothing; period 1 holds out every row (nothing is left to train on,
as with Vowpal Wabbit's ``--holdout_period 1``). SplitMix64 passes BigCrush and its finalizer is
a bijection, so the rows of one file are held out independently with probability 1/period to
within 2^-64; the held-out count of n rows is binomial(n, 1/period).

Vectorised in numpy (uint64 arithmetic wraps mod 2^64); no Python loop over rows.
"""

from __future__ import annotations

import hashlib

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / golden ratio, odd
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of a uint64 array, in place (returns it)."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def file_key(name: str) -> int:
    """The 64-bit key of a file's name relative to the dataset root (first 8 bytes of SHA-256)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


def stream_state(name: str, seed: int) -> int:
    """The SplitMix64 state of one file's rows: its key XOR ``mix64(seed)``."""
    seed_mix = int(mix64(np.array([int(seed) & _MASK], np.uint64))[0])
    return file_key(name) ^ seed_mix


def row_hashes(name: str, first_row: int, n: int, seed: int) -> np.ndarray:
    """The hashes (uint64) of rows ``first_row .. first_row + n - 1`` of file ``name``."""
    state = np.uint64(stream_state(name, seed))
    z = np.arange(first_row + 1, first_row + n + 1, dtype=np.uint64)
    z *= np.uint64(GOLDEN)
    z += state
    return mix64(z)


def threshold(period: int) -> int:
    """Hashes below this are held out: floor(2^64 / period) (period >= 1)."""
    return (1 << 64) // int(period)


def held_out(name: str, first_row: int, n: int, period: int, seed: int) -> np.ndarray:
    """Whether each of rows ``first_row .. first_row + n - 1`` of file ``name`` is held out (bool)."""
    if period <= 0 or n <= 0:
        return np.zeros(max(n, 0), dtype=bool)
    if period == 1:
        return np.ones(n, dtype=bool)
    return row_hashes(name, first_row, n, seed) < np.uint64(threshold(period))
