"""solvers.holdout: which rows are held out, as a function of (file name, row index, seed).

Checked against a slow, obvious reference of SplitMix64 and against SplitMix64's published
outputs; the held-out fraction is binomial around 1/period; the decision for a row does not
depend on the run of rows it is computed in."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import scipy.sparse as sp

from terascale.solvers.data import CSRData
from terascale.solvers.holdout import GOLDEN, held_out, mix64, row_hashes, threshold

M64 = (1 << 64) - 1


def _mix_ref(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _hash_ref(name: str, row: int, seed: int) -> int:
    key = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    state = key ^ _mix_ref(seed & M64)
    return _mix_ref((state + (row + 1) * GOLDEN) & M64)


def test_mix64_gives_splitmix64s_published_outputs():
    # SplitMix64 seeded with 0: its first four outputs (e.g. Vigna's splitmix64.c, seed 0)
    z = np.arange(1, 5, dtype=np.uint64) * np.uint64(GOLDEN)
    assert [int(x) for x in mix64(z)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F,
                                          0xF88BB8A8724C81EC]


@pytest.mark.parametrize(("name", "first", "seed"), [
    ("part-00000.parquet", 0, 0), ("part-00001.parquet", 12345, 7), ("dt=2024-01-01/part-00003.parquet", 0, 2**32 - 1),
    ("données/é.parquet", 2**40, 123456789), ("", 0, 0),
])
def test_vectorised_hash_equals_the_reference(name, first, seed):
    got = row_hashes(name, first, 50, seed)
    assert got.dtype == np.uint64
    assert [int(h) for h in got] == [_hash_ref(name, first + i, seed) for i in range(50)]
    want = [_hash_ref(name, first + i, seed) < (1 << 64) // 7 for i in range(50)]
    assert held_out(name, first, 50, 7, seed).tolist() == want


def test_a_row_is_decided_alone_whatever_run_of_rows_it_is_read_in():
    whole = held_out("part-00002.parquet", 0, 10_000, 10, 3)
    cuts = [0, 1, 333, 334, 2000, 2999, 7777, 10_000]
    pieces = [held_out("part-00002.parquet", a, b - a, 10, 3) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert np.array_equal(np.concatenate(pieces), whole)


@pytest.mark.parametrize("period", [2, 3, 10, 37, 1000])
def test_the_held_out_fraction_is_binomial_around_one_over_period(period):
    n_per_file, files = 50_000, 4
    held = np.concatenate([held_out(f"part-{i:05d}.parquet", 0, n_per_file, period, 0) for i in range(files)])
    n, p = held.size, 1.0 / period
    assert abs(int(held.sum()) - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1
    # no periodic pattern in a file: every residue of the row index mod 10 gets its share
    per_residue = held[:n_per_file].reshape(-1, 10).sum(axis=0)
    m = n_per_file / 10
    assert np.all(np.abs(per_residue - m * p) <= 5 * np.sqrt(m * p * (1 - p)) + 1)


def test_period_zero_holds_out_nothing_one_everything_and_the_threshold_is_exact():
    assert not held_out("a.parquet", 0, 100, 0, 0).any()
    assert held_out("a.parquet", 0, 100, 1, 0).all()
    assert held_out("a.parquet", 5, 0, 10, 0).shape == (0,)
    assert threshold(2) == 1 << 63 and threshold(10) == (1 << 64) // 10


def test_the_seed_and_the_file_name_draw_other_splits():
    a = held_out("part-00000.parquet", 0, 20_000, 10, 0)
    for other in (held_out("part-00000.parquet", 0, 20_000, 10, 1), held_out("part-00001.parquet", 0, 20_000, 10, 0)):
        assert abs(int(other.sum()) - 2000) < 5 * 42  # binomial(20000, 0.1): sd 42
        assert abs(int((a & other).sum()) - 200) < 5 * 14  # independent of a: n / period^2 in common


def test_split_held_out_keeps_order_and_checks_the_mask():
    rng = np.random.default_rng(5)
    x = sp.random(40, 12, density=0.3, random_state=5, format="csr", dtype=np.float32)
    data = CSRData.from_scipy(x, (rng.random(40) < 0.5).astype(np.float32))
    mask = held_out("x.parquet", 0, 40, 3, 0)
    train, hold = data.split_held_out(mask)
    assert (train.n_rows, hold.n_rows) == (int((~mask).sum()), int(mask.sum()))
    assert (hold.to_scipy() != x[np.flatnonzero(mask)]).nnz == 0
    assert (train.to_scipy() != x[np.flatnonzero(~mask)]).nnz == 0
    assert np.array_equal(hold.labels, data.labels[mask])
    with pytest.raises(ValueError, match="held-out mask"):
        data.split_held_out(mask[:-1])
