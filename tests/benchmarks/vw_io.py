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


def _text(csr) -> bytes:
    cap = int(csr.n_rows * 6 + csr.nnz * 11)
    out = np.empty(cap, np.uint8)
    # the values in full, one per non-zero (a shard read from Parquet keeps only those != 1)
    n = _format(csr.indptr, csr.indices, csr.full_values(), csr.labels, out)
    return out[:n].tobytes()


def write_vw(csr, path: str) -> None:
    with open(path, "wb") as f:
        f.write(_text(csr))


def write_vw_dataset(dataset_dir: str, path: str) -> np.ndarray:
    """A featurized dataset as VW text, one row group at a time (memory: one row group), in the
    order :func:`pipeline.dataset.read_dataset` reads it; returns its labels (float64, 8 B a row)."""
    from terascale.pipeline.dataset import plan_shards, read_csr, read_manifest

    m = read_manifest(dataset_dir)
    n_features = 1 << int(m["spec"]["bits"])
    labels = []
    with open(path, "wb") as f:
        for part in plan_shards(dataset_dir, 1, m)[0]:
            csr = read_csr([part], n_features)
            f.write(_text(csr))
            labels.append(csr.labels.astype(np.float64))
    return np.concatenate(labels) if labels else np.zeros(0)


def _logloss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-15, 1 - 1e-15)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def vw_plain_runs(train_dir: str, test_dir: str, bits: int, work: str, l2_sum: float) -> dict:
    """Vowpal Wabbit as a user runs it without tuning, on a featurized train and test set (the same
    hashed features): the text, its cache, then

    * ``one_pass``: one online pass, VW's defaults (adaptive, normalized, invariant);
    * ``bfgs``: that model warm-started into ``--bfgs --passes 20`` with VW's default holdout
      (every 10th example, early termination);
    * ``bfgs_l2``: the same with ``--l2 l2_sum`` (VW's sum form: n·λ) and ``--holdout_off``.

    Returns {run: {"test_logloss", "seconds"}} plus "best" (the run with the lowest test logloss)
    and "cache_seconds" (text -> cache, VW's own first pass). Leaves its files in ``work``."""
    from terascale.pipeline.dataset import read_manifest

    txt, test_txt, cache = f"{work}/train.vw", f"{work}/test.vw", f"{work}/train.cache"
    write_vw_dataset(train_dir, txt)
    y = write_vw_dataset(test_dir, test_txt)
    out: dict = {"cache_seconds": run_vw(f"-d {txt} --cache_file {cache} -b {bits} --loss_function logistic --passes 1 -k")}
    os.remove(txt)
    common = f"--cache_file {cache} -b {bits} --loss_function logistic"
    runs = {
        "one_pass": f"{common} --passes 1 -f {work}/one_pass.model --predict_only_model",
        "bfgs": f"{common} -i {work}/one_pass.model --predict_only_model --bfgs --passes 20 -f {work}/bfgs.model",
        "bfgs_l2": f"{common} -i {work}/one_pass.model --predict_only_model --bfgs --passes 20 --l2 {l2_sum} "
                   f"--holdout_off -f {work}/bfgs_l2.model",
    }
    if y.shape[0] != read_manifest(test_dir)["rows"]:
        raise RuntimeError(f"{test_dir}: {y.shape[0]} rows read, the manifest says {read_manifest(test_dir)['rows']}")
    for name, args in runs.items():
        secs = run_vw(args)
        run_vw(f"-d {test_txt} -t -i {work}/{name}.model --predict_only_model -p {work}/{name}.preds --link logistic")
        out[name] = {"test_logloss": _logloss(y, vw_predictions(f"{work}/{name}.preds")), "seconds": secs}
        os.remove(f"{work}/{name}.preds")
    out["best"] = min(runs, key=lambda k: out[k]["test_logloss"])
    return out
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
