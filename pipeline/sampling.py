"""Negative downsampling at featurize: keep every positive, keep each negative with probability r.

The decision for a row is a pure function of (input file, line number, seed):

    key  = murmur3_32(uri_utf8, seed)                   the file's identity (its normalized URI)
    h    = mix64(mix64(key · 2^32 + seed) ⊕ line)       mix64: the splitmix64 finalizer
    u    = (h >> 11) · 2^-53                            uniform on [0, 1)
    keep = label = 1  or  u < r

``line`` is the 1-based line number of the row in its file (the number quarantine messages
name), which does not depend on how the file is cut into byte ranges or tasks, so retried,
speculative and differently split runs keep exactly the same rows. The file's identity is its
URI as featurize lists it: the same file read under another path (copied to another store)
draws another sample.

Kept negatives get weight 1/r (float32), positives weight 1. Σ weights over a file then
estimates the file's row count and the weighted log-loss estimates the loss on all rows
(importance weighting), so a model trained on the weighted rows estimates the population's
log-odds and needs no correction: its σ(margin) is calibrated to the unsampled data.

The probabilities of the *sampled* population (what a model fitted to the kept rows without
weights would give): among kept rows the odds of a click are the population odds divided by r,
so  logit_sampled = logit_population − ln r  (:func:`sampled_logit_shift`).
"""

from __future__ import annotations

import math

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (multiplication wraps modulo 2^64)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def file_key(uri: str, seed: int) -> int:
    """murmur3_32 of the file's URI (UTF-8) with ``seed``: the file's part of the decision."""
    from terascale.pipeline.hashing import (
        hash_tokens,  # numba: imported only where rows are sampled
    )
    return int(hash_tokens([uri.encode("utf-8")], int(seed))[0])


def uniforms(key: int, seed: int, lines: np.ndarray) -> np.ndarray:
    """u ∈ [0, 1) of each line number in ``lines`` (any integer array) of the file ``key``."""
    base = _mix64(np.array([(int(key) << 32) | (int(seed) & 0xFFFFFFFF)], dtype=np.uint64))
    h = _mix64(base ^ np.asarray(lines, dtype=np.int64).astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def keep_mask(key: int, seed: int, lines: np.ndarray, labels: np.ndarray, rate: float) -> np.ndarray:
    """True for rows kept: every positive (label ≠ 0) and the negatives with u < rate."""
    if rate >= 1.0:
        return np.ones(labels.shape[0], dtype=np.bool_)
    return (labels != 0) | (uniforms(key, seed, lines) < rate)


def negative_weight(rate: float) -> np.float32:
    """The weight of a kept negative: 1/r rounded to float32 (the weight column's type)."""
    return np.float32(1.0 / rate)


def row_weights(labels: np.ndarray, rate: float) -> np.ndarray:
    """float32 weights of kept rows: 1 for positives, 1/r for negatives."""
    w = np.ones(labels.shape[0], dtype=np.float32)
    if rate < 1.0:
        w[labels == 0] = negative_weight(rate)
    return w


def take_rows(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, mask: np.ndarray):
    """The CSR rows where ``mask`` is True: (indptr, indices, values), new arrays."""
    lens = np.diff(indptr)
    entry = np.repeat(mask, lens)
    new_ptr = np.zeros(int(mask.sum()) + 1, dtype=indptr.dtype)
    np.cumsum(lens[mask], out=new_ptr[1:])
    return new_ptr, indices[entry], values[entry]


def sampled_logit_shift(rate: float) -> float:
    """Add to a weighted model's margin to get the sampled population's logit: −ln r (≥ 0)."""
    return -math.log(rate) if rate < 1.0 else 0.0


#: ``predict.calibration``, for a model with slope a and shift c fitted on its held-out rows
#: (``solvers.recalibration``; a = 1, c = 0 for a model without) trained on negatives kept at rate
#: r: population = σ(a·m + c); sampled = σ(a·m + c − ln r), the click rate among the kept rows;
#: raw = σ(m), the model's own margins, for teams that calibrate them themselves
CALIBRATIONS = ("population", "sampled", "raw")


def logit_shift(rate: float, calibration: str) -> float:
    """What scoring adds to the margin of a model trained on negatives kept at ``rate``:
    0 (population, raw) or −ln r (sampled)."""
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration {calibration!r}: must be one of {list(CALIBRATIONS)} (predict.calibration)")
    return sampled_logit_shift(rate) if calibration == "sampled" else 0.0


def model_recalibration(meta: dict) -> tuple[float, float]:
    """(slope a, shift c) the model's probabilities σ(a·m + c) use: the held-out fit recorded in
    its metadata (``recalibration``, when applied), else (1, 0)."""
    r = meta.get("recalibration") or {}
    if not r.get("applied"):
        return 1.0, 0.0
    return float(r["slope"]), float(r["shift"])


def score_transform(meta: dict, calibration: str) -> tuple[float, float]:
    """(slope, shift) such that a model's score for margin m under ``predict.calibration`` is
    σ(slope·m + shift) (see :data:`CALIBRATIONS`)."""
    shift = logit_shift(model_negative_rate(meta), calibration)
    if calibration == "raw":
        return 1.0, 0.0
    a, c = model_recalibration(meta)
    return a, c + shift


def model_negative_rate(meta: dict) -> float:
    """featurize.negative_rate of the data a model was trained on (its metadata; 1 for older models)."""
    return float(meta.get("data", {}).get("negative_rate", 1.0))


def dataset_negative_rate(manifest: dict) -> float:
    """featurize.negative_rate of a dataset (its manifest; 1 when it was not downsampled)."""
    return float((manifest.get("sampling") or {}).get("negative_rate", 1.0))


def population_rows(manifest: dict) -> int:
    """The rows a dataset stands for: with negatives kept at rate r and weighted 1/r, the rows
    before downsampling (every row and every dropped negative), else its rows. The
    regularization path's N (``solvers.regpath``): the training objective averages the weighted
    loss, an estimate of the average over those rows, so λN counts rows of that population; the
    kept rows alone (r = 0.1 at 3% clicks: 1 in 8) put the path 8x too high in λ."""
    before = ((manifest.get("sampling") or {}).get("before") or {}).get("rows")
    return int(before) if before else int(manifest["rows"])
