"""Vowpal Wabbit side of the benchmarks: CSR -> VW text, runs from a binary cache, its weights.

terascale's hashed indices are written as integer feature names in the default namespace,
which VW uses as the feature index itself (masked by -b), so both learners see exactly the same
features. VW runs in-process through the vowpalwabbit package's own command-line driver.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
from numba import njit

from terascale.pipeline.rowkernels import write_int


@njit(cache=True)
def _format(indptr, indices, values, labels, out):
    pos = 0
    for i in range(labels.shape[0]):
        if labels[i] > 0.5:
            out[pos] = 49  # "1"
            pos += 1
        else:
            out[pos] = 45  # "-1"
            out[pos + 1] = 49
            pos += 2
        out[pos] = 32
        out[pos + 1] = 124  # " |"
        pos += 2
        for k in range(indptr[i], indptr[i + 1]):
            out[pos] = 32
            pos += 1
            pos = write_int(np.int64(indices[k]), out, pos)
            if values[k] != 1.0:
                out[pos] = 58  # ":" then the value as an integer count (collisions)
                pos += 1
                out[pos] = 48 + int(values[k]) % 10
                pos += 1
        out[pos] = 10
        pos += 1
    return pos


def write_vw(csr, path: str) -> None:
    cap = int(csr.n_rows * 6 + csr.nnz * 11)
    out = np.empty(cap, np.uint8)
    # the values in full, one per non-zero (a shard read from Parquet keeps only those != 1)
    n = _format(csr.indptr, csr.indices, csr.full_values(), csr.labels, out)
    with open(path, "wb") as f:
        f.write(out[:n].tobytes())


def run_vw(args: str) -> float:
    """Run VW's driver with ``args``; returns the wall seconds."""
    import vowpalwabbit

    t0 = time.perf_counter()
    ws = vowpalwabbit.Workspace(args + " --quiet")
    ws.run_parser()
    ws.finish()
    return time.perf_counter() - t0


_LINE = re.compile(r"^(\d+):(\S+)")  # "index:weight [adaptive normalizer]"


def read_vw_weights(readable_model: str, n_features: int) -> np.ndarray:
    """Weights from a --readable_model file (index:weight lines after the header)."""
    w = np.zeros(n_features, np.float64)
    with open(readable_model) as f:
        for line in f:
            m = _LINE.match(line.strip())
            if m:
                w[int(m.group(1)) % n_features] = float(m.group(2))
    return w


CONSTANT_HASH = 11650396  # VW's hash of its constant (intercept) feature


def vw_predictions(preds_path: str) -> np.ndarray:
    """VW -p output with --link logistic: one probability per line."""
    with open(preds_path) as f:
        return np.array([float(x.split()[0]) for x in f if x.strip()], np.float64)


def cleanup(*paths: str) -> None:
    for p in paths:
        if os.path.exists(p):
            os.remove(p)
