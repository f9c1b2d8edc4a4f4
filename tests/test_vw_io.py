"""The benchmarks' Vowpal Wabbit text writer (``tests/benchmarks/vw_io.py``) on every value
layout a dataset read from Parquet has (``solvers.kernels.values``): all ones (no value array),
exceptions only, dense. It once read a value per non-zero from an array that holds only the
exceptions, writing garbage (or crashing) for every shard read since compact shards."""

from __future__ import annotations

import numpy as np

from terascale.solvers.data import CSRData
from tests.benchmarks.vw_io import write_vw

INDPTR = np.array([0, 3, 3, 5], np.int64)
INDICES = np.array([7, 12, 1048575, 0, 3], np.int32)
LABELS = np.array([1, 0, 0], np.float32)


def _text(values, vpos, tmp_path) -> str:
    data = CSRData(INDPTR, INDICES, np.asarray(values, np.float32), LABELS, np.ones(3, np.float32), 1 << 20,
                   np.asarray(vpos, np.int64))
    path = tmp_path / "x.vw"
    write_vw(data, str(path))
    return path.read_text()


def test_every_value_layout_writes_the_same_lines(tmp_path):
    ones = "1 | 7 12 1048575\n-1 |\n-1 | 0 3\n"
    assert _text([], [], tmp_path) == ones
    assert _text([1, 1, 1, 1, 1], [], tmp_path) == ones
    counted = "1 | 7 12:2 1048575\n-1 |\n-1 | 0 3:3\n"
    assert _text([2, 3], [1, 4], tmp_path) == counted  # exceptions at positions 1 and 4
    assert _text([1, 2, 1, 1, 3], [], tmp_path) == counted  # the same, dense
