"""A realistic synthetic Criteo click-log generator with a planted ground-truth model.

``generate_clicklogs(out_dir, rows, ...)`` writes Criteo TSV files (Kaggle/Terabyte layout):
each line is ``label \\t I1..I13 \\t C1..C26`` (40 tab-separated fields, ``\\n`` line ends, an
empty field is a missing value, categorical values are 8 lowercase hex digits), in files
``part-00000.tsv`` (``.tsv.gz`` with gzip), rows split evenly across the files.

The data
    Integer fields are heavy-tailed counts (Lomax / Pareto II), a few fields with small
    negative values (-1, -2, -3) as in Criteo, about 20% missing on average. Categorical fields
    have a fixed vocabulary of V values (10 to 10^6, table below) drawn from a truncated power
    law over ranks (Zipf-like, exponent s; s = 1 is log-uniform). The text of the value of rank
    r of field Ck is ``fmix32((r + salt_k) mod 2^32)`` as 8 hex digits (murmur3's finalizer, a
    bijection, so distinct ranks give distinct values).

The planted model (the same for every seed, so a train and a test set generated with two seeds
come from one distribution)
    margin = intercept + sum of the weights of exactly the tokens ``pipeline.spec`` builds for
    the line with ``log_squared`` bucketing and conjunctions ``PLANTED_CONJUNCTIONS``:
    one weight per integer (field, bucket), per categorical (field, value) and per planted
    conjunction (value pair); each is ``sigma * g(hash)`` with g a bell-shaped unit-variance
    number of a 32-bit hash of the token's key (:func:`token_weight` is the slow, obvious
    reference). The label is Bernoulli(sigmoid(margin)). The intercept is set by bisection on
    a fixed calibration sample so that the positive rate is ``positive_rate`` (default
    ``TARGET_POSITIVE_RATE`` = 0.25, the rate of Criteo's public sample, which Criteo had itself
    downsampled; raw click logs hold 30 to 300 negatives per click, rates 0.3% to 3%: pass one
    of those to study negative downsampling). At 0.25 the
    Bayes-optimal logloss is about 0.447, against 0.562 for the base rate; most of the signal
    sits in frequent values and so is learnable by a hashed linear model without conjunctions,
    and ``PLANTED_CONJUNCTIONS`` add what such a model cannot learn without them.

Determinism
    File i draws from ``SeedSequence(seed, spawn_key=(i, 0))`` (rows, 40 random 64-bit words
    per row) and ``(i, 1)`` (which lines are malformed, and how), so the bytes depend on
    (seed, rows, files, malformed_rate, compress) only, never on the number of processes. Rows are made
    in chunks of ``CHUNK_ROWS`` (bounded memory) by two numba kernels (``pipeline.gen_kernels``).
    Every file is written under a temporary name and renamed when complete. Worker processes
    are spawned, so a script calling this with more than one process needs the usual
    ``if __name__ == "__main__":`` guard.

Speed: generating rows is CPU-cheap; with gzip, zlib bounds the rate (hence the fast
``GZIP_LEVEL``). Measured rates: ``docs/pages/explanation/design-notes.md``.

Tables (categorical fields: vocabulary size V, power-law exponent s = 1 + 1/k for an integer k
or s = 1, missing rate, weight sigma before ``WEIGHT_SCALE``; integer fields: missing rate,
Lomax scale and shape alpha = 4/q for an integer q, rate of negative values, weight sigma;
these forms let the kernel sample without pow()):

====  =========  ====  =====  =====     ====  =====  =====  =====  =====  =====
cat   V          s     miss   sigma     int   miss   scale  alpha  neg    sigma
====  =========  ====  =====  =====     ====  =====  =====  =====  =====  =====
C1    1,460      1.10  0.00   0.30      I1    0.45   1.5    4/3    0      0.35
C2    580        1.00  0.00   0.35      I2    0.00   10     1      0.08   0.30
C3    1,000,000  1.05  0.03   0.15      I3    0.21   5      1      0      0.25
C4    400,000    1.05  0.03   0.15      I4    0.22   4      2      0      0.25
C5    300        1.20  0.00   0.35      I5    0.03   500    0.8    0      0.30
C6    24         0.80  0.12   0.40      I6    0.22   20     1      0      0.25
C7    12,500     1.10  0.00   0.25      I7    0.04   3      1      0      0.30
C8    630        1.20  0.00   0.30      I8    0.00   8      4/3    0      0.20
C9    10         0.75  0.00   0.40      I9    0.04   40     1      0      0.25
C10   90,000     1.10  0.00   0.20      I10   0.45   0.5    2      0      0.35
C11   5,700      1.10  0.00   0.25      I11   0.04   2      4/3    0      0.30
C12   800,000    1.05  0.03   0.15      I12   0.76   0.8    4/3    0      0.20
C13   3,200      1.10  0.00   0.25      I13   0.22   4      4/3    0.01   0.25
C14   27         0.90  0.00   0.40
C15   15,000     1.10  0.00   0.20
C16   600,000    1.05  0.03   0.15
C17   10         0.80  0.00   0.35
C18   5,600      1.10  0.00   0.25
C19   2,200      1.20  0.44   0.30
C20   12         0.90  0.44   0.35
C21   700,000    1.05  0.03   0.15
C22   18         1.00  0.76   0.35
C23   15         0.90  0.00   0.35
C24   280,000    1.10  0.03   0.15
C25   105        1.20  0.44   0.30
C26   140,000    1.10  0.44   0.15
====  =========  ====  =====  =====     ====  =====  =====  =====  =====  =====
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import multiprocessing
import os
import re
import time
from pathlib import Path

import numpy as np

from terascale.pipeline import gen_kernels as K
from terascale.pipeline.spec import bucket

GENERATOR_VERSION = 1
INT_FIELDS = tuple(f"I{k}" for k in range(1, 14))
CAT_FIELDS = tuple(f"C{k}" for k in range(1, 27))
FIELDS = INT_FIELDS + CAT_FIELDS

#: Reason codes of malformed lines, shared with the featurizer's quarantine.
MALFORMED_KINDS = (
    "wrong_field_count",
    "bad_integer",
    "bad_label",
    "invalid_utf8",
    "empty_line",
    "line_too_long",
)

# name: (vocabulary size, power-law exponent s = 1 + 1/k for an integer k (or s = 1),
#        missing rate, weight sigma)
CAT_TABLE = {
    "C1": (1_460, 1.10, 0.00, 0.30),
    "C2": (580, 1.00, 0.00, 0.35),
    "C3": (1_000_000, 1.05, 0.03, 0.15),
    "C4": (400_000, 1.05, 0.03, 0.15),
    "C5": (300, 1.20, 0.00, 0.35),
    "C6": (24, 0.80, 0.12, 0.40),
    "C7": (12_500, 1.10, 0.00, 0.25),
    "C8": (630, 1.20, 0.00, 0.30),
    "C9": (10, 0.75, 0.00, 0.40),
    "C10": (90_000, 1.10, 0.00, 0.20),
    "C11": (5_700, 1.10, 0.00, 0.25),
    "C12": (800_000, 1.05, 0.03, 0.15),
    "C13": (3_200, 1.10, 0.00, 0.25),
    "C14": (27, 0.90, 0.00, 0.40),
    "C15": (15_000, 1.10, 0.00, 0.20),
    "C16": (600_000, 1.05, 0.03, 0.15),
    "C17": (10, 0.80, 0.00, 0.35),
    "C18": (5_600, 1.10, 0.00, 0.25),
    "C19": (2_200, 1.20, 0.44, 0.30),
    "C20": (12, 0.90, 0.44, 0.35),
    "C21": (700_000, 1.05, 0.03, 0.15),
    "C22": (18, 1.00, 0.76, 0.35),
    "C23": (15, 0.90, 0.00, 0.35),
    "C24": (280_000, 1.10, 0.03, 0.15),
    "C25": (105, 1.20, 0.44, 0.30),
    "C26": (140_000, 1.10, 0.44, 0.15),
}
# name: (missing rate, Lomax scale, Lomax shape alpha = 4/q for an integer q,
#        rate of negative values, weight sigma)
INT_TABLE = {
    "I1": (0.45, 1.5, 4 / 3, 0.0, 0.35),
    "I2": (0.00, 10.0, 1.0, 0.08, 0.30),
    "I3": (0.21, 5.0, 1.0, 0.0, 0.25),
    "I4": (0.22, 4.0, 2.0, 0.0, 0.25),
    "I5": (0.03, 500.0, 0.8, 0.0, 0.30),
    "I6": (0.22, 20.0, 1.0, 0.0, 0.25),
    "I7": (0.04, 3.0, 1.0, 0.0, 0.30),
    "I8": (0.00, 8.0, 4 / 3, 0.0, 0.20),
    "I9": (0.04, 40.0, 1.0, 0.0, 0.25),
    "I10": (0.45, 0.5, 2.0, 0.0, 0.35),
    "I11": (0.04, 2.0, 4 / 3, 0.0, 0.30),
    "I12": (0.76, 0.8, 4 / 3, 0.0, 0.20),
    "I13": (0.22, 4.0, 4 / 3, 0.01, 0.25),
}
VOCAB_SIZES = {name: row[0] for name, row in CAT_TABLE.items()}
CAT_MISSING_RATES = {name: row[2] for name, row in CAT_TABLE.items()}
INT_MISSING_RATES = {name: row[0] for name, row in INT_TABLE.items()}
INT_CAP = 2**31 - 1  # integer values are clipped to int32

#: Field pairs with a planted interaction: set ``featurize.conjunctions`` to these to learn it.
PLANTED_CONJUNCTIONS = (("C6", "C9"), ("C14", "C23"), ("C17", "C20"), ("C2", "C5"))
CONJUNCTION_SIGMA = 0.45
WEIGHT_SCALE = 0.8  # multiplies every sigma; sets the Bayes logloss (about 0.447)
TARGET_POSITIVE_RATE = 0.25
MODEL_SALT = 0x7E4A5CA1  # the planted model's hash salt (fixed: the model is seed-independent)
CALIBRATION_SEED = 20240611
CALIBRATION_ROWS = 200_000
CHUNK_ROWS = 100_000  # rows per generated chunk (fixed: part of the determinism contract)
BUFFER_BYTES = 64 << 20  # bound of the line buffer (malformed_rate near 1 makes long lines)
GZIP_LEVEL = 1  # fast; generation is otherwise CPU-cheap and gzip would dominate
MAX_FILES = 100_000  # file names have 5 digits

_PART_RE = re.compile(r"^part-(\d{5})\.(tsv|tsv\.gz|prob\.npy)$")
_M32 = K.MASK32


# ---------------------------------------------------------------------------------------------
# The planted model: hashes, salts, and the pure-Python reference.


def _fmix32(h: int) -> int:
    """murmur3's 32-bit finalizer (pure Python twin of ``gen_kernels.fmix32``)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return h


def _gauss32(h: int) -> float:
    """Pure Python twin of ``gen_kernels.gauss32``."""
    s = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + ((h >> 24) & 255) + 2
    return (s / 256.0 - 2.0) * math.sqrt(3.0)


def _code_salt(j: int) -> int:
    """Salt of categorical field C{j+1}'s value codes."""
    return _fmix32((0x9E3779B9 * (j + 1)) & _M32)


def _weight_salt(f: int) -> int:
    """Salt of the weights of field id f (0..12: I1..I13, 13..38: C1..C26)."""
    return _fmix32((MODEL_SALT + 0x632BE5AB * (f + 1)) & _M32)


def _conj_salt(p: int) -> int:
    """Salt of the weights of planted conjunction p."""
    return _fmix32(((MODEL_SALT ^ 0x5BD1E995) + 0x27D4EB2F * (p + 1)) & _M32)


def _sigma(field: str) -> float:
    row = INT_TABLE[field] if field in INT_TABLE else CAT_TABLE[field]
    return WEIGHT_SCALE * row[-1]


_FIELD_ID = {name: f for f, name in enumerate(FIELDS)}
_CONJ_ID = {pair: p for p, pair in enumerate(PLANTED_CONJUNCTIONS)}


def value_text(field: str, rank: int) -> str:
    """The text of the value of rank ``rank`` (0 = most frequent) of categorical ``field``."""
    return f"{_fmix32((rank + _code_salt(CAT_FIELDS.index(field))) & _M32):08x}"


def _field_key(token: str) -> tuple[str, int]:
    name, _, value = token.partition("=")
    if name in INT_TABLE:
        return name, int(value) & _M32  # the token value is the bucket
    return name, int(value, 16) & _M32


def token_weight(token: str) -> float:
    """Planted weight of one featurizer token: ``I3=5``, ``C7=3f1a9b2c`` or ``A=x^B=y``.

    This is the slow, obvious reference of the model in ``gen_kernels.sample_chunk``. Integer
    tokens must carry the log_squared bucket (as ``pipeline.spec`` builds them). A conjunction
    of a pair that is not in ``PLANTED_CONJUNCTIONS`` weighs 0.
    """
    if "^" in token:
        left, right = token.split("^")
        (fa, ka), (fb, kb) = _field_key(left), _field_key(right)
        p = _CONJ_ID.get((fa, fb))
        if p is None:
            return 0.0
        h = _fmix32(kb ^ _fmix32(ka ^ _conj_salt(p)))
        return WEIGHT_SCALE * CONJUNCTION_SIGMA * _gauss32(h)
    name, key = _field_key(token)
    return _sigma(name) * _gauss32(_fmix32(key ^ _weight_salt(_FIELD_ID[name])))


def planted_margin(tokens, positive_rate: float = TARGET_POSITIVE_RATE) -> float:
    """The planted margin of a line from its tokens (built with ``PLANTED_CONJUNCTIONS``)."""
    return planted_intercept(positive_rate) + sum(token_weight(t) for t in tokens)


def _quarters(alpha: float) -> int:
    """q with alpha = 4 / q (the kernel raises 1/u to q/4 with square roots only)."""
    q = round(4.0 / alpha)
    if q < 1 or abs(4.0 / q - alpha) > 1e-9:
        raise ValueError(f"Lomax alpha {alpha} is not 4/q for an integer q >= 1")
    return q


def _pow_k(s: float) -> int:
    """k with s = 1 + 1/k (0 for s = 1): the kernel's power law uses integer powers only."""
    if abs(s - 1.0) < 1e-12:
        return 0
    k = round(1.0 / (s - 1.0))
    if k == 0 or abs(1.0 + 1.0 / k - s) > 1e-9:
        raise ValueError(f"power-law exponent {s} is not 1 + 1/k for an integer k")
    return k


BUCKET_TABLE_SIZE = 1 << 16


@functools.lru_cache(maxsize=1)
def _model_arrays() -> dict:
    """The kernel's view of the tables and salts, as typed numpy arrays."""
    two32 = 2.0**32
    ints = [INT_TABLE[f] for f in INT_FIELDS]
    cats = [CAT_TABLE[f] for f in CAT_FIELDS]
    vocab = np.array([c[0] for c in cats], dtype=np.int64)
    k = np.array([_pow_k(c[1]) for c in cats], dtype=np.int64)
    kk = np.where(k == 0, 1, k).astype(np.float64)
    return {
        "int_miss_thr": np.array([round(r[0] * two32) for r in ints], dtype=np.int64),
        "int_neg_thr": np.array([round(r[3] * two32) for r in ints], dtype=np.int64),
        "int_scale": np.array([r[1] for r in ints], dtype=np.float64),
        "int_quarters": np.array([_quarters(r[2]) for r in ints], dtype=np.int64),
        "int_cap": float(INT_CAP),
        "bucket_table": np.array([bucket(v) for v in range(BUCKET_TABLE_SIZE)], dtype=np.int32),
        "cat_miss_thr": np.array([round(c[2] * two32) for c in cats], dtype=np.int64),
        "cat_vocab": vocab,
        "cat_log_v1": np.log(vocab + 1.0),
        "cat_pow_a": np.where(k == 0, 0.0, (vocab + 1.0) ** (-1.0 / kk) - 1.0),
        "cat_pow_k": k,
        "cat_code_salt": np.array([_code_salt(j) for j in range(len(CAT_FIELDS))], dtype=np.int64),
        "w_salt": np.array([_weight_salt(f) for f in range(len(FIELDS))], dtype=np.int64),
        "w_sigma": np.array([_sigma(f) for f in FIELDS], dtype=np.float64),
        "conj_a": np.array([_FIELD_ID[a] for a, _ in PLANTED_CONJUNCTIONS], dtype=np.int64),
        "conj_b": np.array([_FIELD_ID[b] for _, b in PLANTED_CONJUNCTIONS], dtype=np.int64),
        "conj_salt": np.array([_conj_salt(p) for p in range(len(PLANTED_CONJUNCTIONS))], dtype=np.int64),
        "conj_sigma": np.full(len(PLANTED_CONJUNCTIONS), WEIGHT_SCALE * CONJUNCTION_SIGMA),
    }


def _sample(bitgen: np.random.BitGenerator, n: int, intercept: float) -> dict:
    """Draw n rows (40 words each from ``bitgen``) with the planted model; arrays by name."""
    m = _model_arrays()
    raw = bitgen.random_raw(n * K.WORDS_PER_ROW).view(np.int64)
    out = {
        "ints": np.empty((n, K.N_INT), dtype=np.int64),
        "codes": np.empty((n, K.N_CAT), dtype=np.int64),
        "margin": np.empty(n, dtype=np.float64),
        "prob": np.empty(n, dtype=np.float64),
        "label": np.empty(n, dtype=np.int64),
    }
    K.sample_chunk(
        raw, m["int_miss_thr"], m["int_neg_thr"], m["int_scale"], m["int_quarters"], m["int_cap"],
        m["bucket_table"], m["cat_miss_thr"], m["cat_vocab"], m["cat_log_v1"], m["cat_pow_a"],
        m["cat_pow_k"], m["cat_code_salt"],
        m["w_salt"], m["w_sigma"], m["conj_a"], m["conj_b"], m["conj_salt"], m["conj_sigma"],
        float(intercept), out["ints"], out["codes"], out["margin"], out["prob"], out["label"],
    )  # fmt: skip
    return out


@functools.lru_cache(maxsize=8)
def planted_intercept(positive_rate: float = TARGET_POSITIVE_RATE) -> float:
    """The intercept giving a ``positive_rate`` positive rate (fixed calibration sample).

    Bisection on the mean click probability of ``CALIBRATION_ROWS`` rows drawn with a fixed
    seed; rounded to 6 decimals so that last-bit libm differences between machines vanish.
    """
    bitgen = np.random.PCG64(np.random.SeedSequence(CALIBRATION_SEED))
    margin = _sample(bitgen, CALIBRATION_ROWS, 0.0)["margin"]
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        rate = np.mean(1.0 / (1.0 + np.exp(-(margin + mid))))
        lo, hi = (mid, hi) if rate < positive_rate else (lo, mid)
    return round(0.5 * (lo + hi), 6)


def base_rate_entropy(p: float) -> float:
    """Logloss (nats) of always predicting the base rate p."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


# ---------------------------------------------------------------------------------------------
# Writing one file (runs in a worker process, or inline with one process).


def _part_name(i: int, compress: str | None) -> str:
    return f"part-{i:05d}.tsv" + (".gz" if compress == "gzip" else "")


def _split_even(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` sizes differing by at most one, larger ones first."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def _malformed_plan(sizes: list[int], rate: float) -> list[tuple[int, int]]:
    """(malformed lines, global ordinal of its first one) per file.

    ``round(rate * rows)`` malformed lines in all, split in proportion to the file sizes. The
    k-th malformed line overall has kind ``MALFORMED_KINDS[k % 6]``, so kinds are spread evenly
    (counts differ by at most one) whatever the number of files.
    """
    rows = sum(sizes)
    total = min(rows, int(math.floor(rate * rows + 0.5)))
    plan, cum = [], 0
    for n in sizes:
        first = total * cum // rows if rows else 0
        last = total * (cum + n) // rows if rows else 0
        plan.append((last - first, first))
        cum += n
    return plan


def _plan_chunk(rng: np.random.Generator, nc: int, rows_left: int, bad_left: int, ordinal: int):
    """Kinds (-1 = valid) and variant numbers of one chunk's rows, and its malformed count."""
    kinds = np.full(nc, -1, dtype=np.int8)
    subs = np.zeros(nc, dtype=np.int64)
    if bad_left == 0:
        return kinds, subs, 0
    if nc >= rows_left:
        mc = bad_left
    elif rows_left < 10**9:
        mc = int(rng.hypergeometric(nc, rows_left - nc, bad_left))
    else:  # numpy's hypergeometric needs fewer than 1e9 items
        mc = int(rng.binomial(bad_left, nc / rows_left))
    mc = min(nc, bad_left, max(mc, bad_left - (rows_left - nc)))
    k = ((ordinal + np.arange(mc)) % len(MALFORMED_KINDS)).astype(np.int8)
    rng.shuffle(k)
    where = rng.choice(nc, size=mc, replace=False)
    kinds[where] = k
    subs[where] = rng.integers(0, 2**32, size=mc, dtype=np.int64)
    return kinds, subs, mc


def _slices(kinds: np.ndarray):
    """(start, stop, buffer bytes) of slices of a chunk whose lines fit in about BUFFER_BYTES.

    A chunk is one slice unless it holds many ``line_too_long`` lines (70 kB each).
    """
    room = np.where(kinds == K.K_LINE_TOO_LONG, K.LONG_FIELD_CHARS, 0) + K.MAX_VALID_LINE
    cum = np.cumsum(room)
    total = int(cum[-1]) if cum.size else 0
    cuts = np.searchsorted(cum, np.arange(1, total // BUFFER_BYTES + 1) * BUFFER_BYTES)
    bounds = np.unique(np.r_[0, cuts, kinds.size])
    slack = 2 * (K.LONG_FIELD_CHARS + K.MAX_VALID_LINE)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        yield int(a), int(b), int(cum[b - 1] - (cum[a - 1] if a else 0)) + slack


def _write_rows(job: dict, fh, pfh) -> dict:
    """Generate file ``job['index']`` chunk by chunk into ``fh`` (and ``pfh``); its stats."""
    i, n = job["index"], job["rows"]
    bitgen = np.random.PCG64(np.random.SeedSequence(job["seed"], spawn_key=(i, 0)))
    rng_bad = np.random.Generator(np.random.PCG64(np.random.SeedSequence(job["seed"], spawn_key=(i, 1))))
    bad_left, ordinal = job["malformed"], job["kind_start"]
    positives, logloss = 0, 0.0
    by_kind = np.zeros(len(MALFORMED_KINDS), dtype=np.int64)
    buf = np.empty(0, dtype=np.uint8)
    for start in range(0, n, CHUNK_ROWS):
        nc = min(CHUNK_ROWS, n - start)
        rows = _sample(bitgen, nc, job["intercept"])
        kinds, subs, mc = _plan_chunk(rng_bad, nc, n - start, bad_left, ordinal)
        bad_left, ordinal = bad_left - mc, ordinal + mc
        for a, b, need in _slices(kinds):
            if buf.size < need:
                buf = np.empty(need, dtype=np.uint8)
            end = K.format_chunk(
                rows["label"][a:b], rows["ints"][a:b], rows["codes"][a:b], kinds[a:b], subs[a:b], buf
            )
            fh.write(memoryview(buf[:end]))
        valid = kinds < 0
        by_kind += np.bincount(kinds[~valid], minlength=len(MALFORMED_KINDS))
        y = rows["label"][valid]
        positives += int(y.sum())
        if pfh is not None:
            p = rows["prob"].astype("<f4")
            p[~valid] = np.nan
            pfh.write(p.tobytes())
            pv = np.clip(rows["prob"][valid], 1e-15, 1.0 - 1e-15)
            logloss -= float(np.sum(np.where(y == 1, np.log(pv), np.log1p(-pv))))
    return {"positives": positives, "logloss_sum": logloss, "by_kind": by_kind.tolist()}


def _write_part(job: dict) -> dict:
    """Write one part file (and its prob sidecar) under temporary names, then rename them."""
    t0 = time.perf_counter()
    out_dir, i = Path(job["out_dir"]), job["index"]
    name = _part_name(i, job["compress"])
    prob_name = f"part-{i:05d}.prob.npy" if job["with_prob"] else None
    tag = f".inprogress-{os.getpid()}"
    tmp = out_dir / f".{name}{tag}"
    ptmp = out_dir / f".{prob_name}{tag}" if prob_name else None
    try:
        with open(tmp, "wb") as raw, open(ptmp, "wb") if ptmp else _nothing() as pfh:
            if pfh is not None:
                header = {"descr": "<f4", "fortran_order": False, "shape": (job["rows"],)}
                np.lib.format.write_array_header_1_0(pfh, header)
            if job["compress"] == "gzip":  # mtime=0 and no name: identical bytes for a seed
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=GZIP_LEVEL, mtime=0) as gz:
                    stats = _write_rows(job, gz, pfh)
            else:
                stats = _write_rows(job, raw, pfh)
        os.replace(tmp, out_dir / name)
        if ptmp:
            os.replace(ptmp, out_dir / prob_name)
    except BaseException:
        for p in (tmp, ptmp):
            if p is not None and p.exists():
                p.unlink()
        raise
    return {
        "name": name,
        "lines": job["rows"],
        "bytes": (out_dir / name).stat().st_size,
        "malformed": int(sum(stats["by_kind"])),
        "prob": prob_name,
        "seconds": round(time.perf_counter() - t0, 3),
        **stats,
    }


class _nothing:
    """A context manager giving None (no sidecar file)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _warm_kernels() -> None:
    """Compile (or load from the numba cache) both kernels in this process."""
    rows = _sample(np.random.PCG64(0), 1, 0.0)
    kinds, subs = np.full(1, -1, dtype=np.int8), np.zeros(1, dtype=np.int64)
    K.format_chunk(rows["label"], rows["ints"], rows["codes"], kinds, subs, np.empty(4096, np.uint8))


# ---------------------------------------------------------------------------------------------
# The public entry point.


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def _check_args(out_dir, rows, files, seed, malformed_rate, with_prob, compress, processes, positive_rate):
    if not isinstance(out_dir, (str, os.PathLike)) or str(out_dir) == "":
        raise TypeError(f"out_dir must be a non-empty path, got {out_dir!r}")
    rows = _check_int("rows", rows, 0)
    files = _check_int("files", files, 1, MAX_FILES)
    seed = _check_int("seed", seed, 0)
    if isinstance(malformed_rate, bool) or not isinstance(malformed_rate, (int, float, np.floating, np.integer)):
        raise TypeError(f"malformed_rate must be a number in [0, 1], got {malformed_rate!r}")
    if not 0.0 <= float(malformed_rate) <= 1.0:  # also rejects NaN
        raise ValueError(f"malformed_rate must be a number in [0, 1], got {malformed_rate!r}")
    if not isinstance(with_prob, (bool, np.bool_)):
        raise TypeError(f"with_prob must be True or False, got {with_prob!r}")
    if compress not in (None, "gzip"):
        raise ValueError(f"compress must be None or 'gzip', got {compress!r}")
    if processes is not None:
        processes = _check_int("processes", processes, 1)
    if isinstance(positive_rate, bool) or not isinstance(positive_rate, (int, float, np.floating, np.integer)):
        raise TypeError(f"positive_rate must be a number in [0.001, 0.999], got {positive_rate!r}")
    if not 0.001 <= float(positive_rate) <= 0.999:  # also rejects NaN
        raise ValueError(f"positive_rate must be a number in [0.001, 0.999], got {positive_rate!r}")
    return rows, files, seed, float(malformed_rate), bool(with_prob), processes, float(positive_rate)


def generate_clicklogs(
    out_dir,
    rows: int,
    files: int = 1,
    seed: int = 0,
    malformed_rate: float = 0.0,
    with_prob: bool = False,
    compress: str | None = None,
    processes: int | None = None,
    positive_rate: float = TARGET_POSITIVE_RATE,
) -> dict:
    """Write ``rows`` synthetic Criteo TSV lines into ``files`` part files under ``out_dir``.

    Parameters
    ----------
    out_dir : directory (created if missing). Part files of an earlier run that this run does
        not rewrite (``part-NNNNN.tsv[.gz]`` / ``.prob.npy``) are removed, so the directory
        holds exactly one data set.
    rows : total number of lines, split evenly across the files.
    files : number of part files, ``part-00000.tsv`` ... (``.tsv.gz`` with gzip).
    seed : the data's seed; the output bytes depend on (seed, rows, files, malformed_rate,
        compress) only.
    malformed_rate : fraction of lines replaced by malformed lines, of every kind in
        ``MALFORMED_KINDS`` in turn.
    with_prob : also write each line's true click probability to ``part-NNNNN.prob.npy``
        (float32, one entry per line, NaN for malformed lines).
    compress : None or ``'gzip'``.
    processes : worker processes (spawned); default ``min(files, cpu count)``.
    positive_rate : the planted model's positive rate, in [0.001, 0.999] (its intercept; the
        token weights are the same for every rate, so two rates differ only in the base rate).

    Returns a summary: ``rows`` (lines written), ``valid_rows``, ``malformed`` (count per
    kind), ``malformed_total``, ``positives``, ``positive_rate`` (over valid rows), ``files``
    (name, lines, bytes, malformed, positives per file), ``bytes``, ``seconds``,
    ``rows_per_second``, and with ``with_prob`` the ``bayes_logloss`` over valid rows. The same
    facts plus the planted model's description go to ``out_dir/_truth.json``.
    """
    rows, files, seed, malformed_rate, with_prob, processes, positive_rate = _check_args(
        out_dir, rows, files, seed, malformed_rate, with_prob, compress, processes, positive_rate
    )
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    intercept = planted_intercept(positive_rate)
    sizes = _split_even(rows, files)
    plan = _malformed_plan(sizes, malformed_rate)
    jobs = [
        {"out_dir": str(out), "index": i, "rows": n, "malformed": bad, "kind_start": first,
         "seed": seed, "compress": compress, "with_prob": with_prob, "intercept": intercept}
        for i, (n, (bad, first)) in enumerate(zip(sizes, plan, strict=True))
    ]  # fmt: skip
    procs = min(files, processes if processes is not None else (os.cpu_count() or 1))
    if procs <= 1:
        parts = [_write_part(job) for job in jobs]
    else:
        _warm_kernels()  # compile once here; the spawned workers load the numba cache
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=procs, mp_context=ctx) as pool:
            parts = list(pool.map(_write_part, jobs))
    removed = _remove_stale(out, {p["name"] for p in parts} | {p["prob"] for p in parts})
    summary = _summary(parts, rows, seed, procs, compress, with_prob, time.perf_counter() - t0)
    summary["out_dir"] = str(out)
    summary["removed_stale"] = removed
    _write_truth(out, summary, malformed_rate, intercept, positive_rate)
    return summary


def _remove_stale(out: Path, keep: set) -> list[str]:
    removed = []
    for p in sorted(out.iterdir()):
        if _PART_RE.match(p.name) and p.name not in keep:
            p.unlink()
            removed.append(p.name)
    return removed


def _summary(parts: list, rows: int, seed: int, procs: int, compress, with_prob: bool, seconds: float) -> dict:
    by_kind = np.sum([p["by_kind"] for p in parts], axis=0, dtype=np.int64)
    bad = int(by_kind.sum())
    valid = rows - bad
    positives = sum(p["positives"] for p in parts)
    s = {
        "rows": rows,
        "valid_rows": valid,
        "malformed": {k: int(c) for k, c in zip(MALFORMED_KINDS, by_kind, strict=True)},
        "malformed_total": bad,
        "positives": positives,
        "positive_rate": positives / valid if valid else None,
        "files": [
            {k: p[k] for k in ("name", "lines", "bytes", "malformed", "positives", "prob", "seconds")}
            for p in parts
        ],
        "bytes": sum(p["bytes"] for p in parts),
        "seconds": round(seconds, 3),
        "rows_per_second": round(rows / seconds) if seconds > 0 else None,
        "seed": seed,
        "processes": procs,
        "compress": compress,
        "with_prob": with_prob,
    }
    if with_prob:
        s["bayes_logloss"] = sum(p["logloss_sum"] for p in parts) / valid if valid else None
    return s


def _write_truth(out: Path, summary: dict, malformed_rate: float, intercept: float,
                 positive_rate: float) -> None:
    """``_truth.json``: the run and the planted model's description (no weight tables)."""
    rate = summary["positive_rate"]
    truth = {
        "generator_version": GENERATOR_VERSION,
        "seed": summary["seed"],
        "rows": summary["rows"],
        "valid_rows": summary["valid_rows"],
        "files": [p["name"] for p in summary["files"]],
        "compress": summary["compress"],
        "malformed_rate": malformed_rate,
        "malformed": summary["malformed"],
        "positives": summary["positives"],
        "positive_rate": rate,
        "target_positive_rate": positive_rate,
        "base_rate_entropy": base_rate_entropy(rate) if summary["valid_rows"] else None,
        "intercept": intercept,
        "weight_scale": WEIGHT_SCALE,
        "vocab_sizes": VOCAB_SIZES,
        "zipf_exponents": {f: CAT_TABLE[f][1] for f in CAT_FIELDS},
        "cat_missing_rates": CAT_MISSING_RATES,
        "int_missing_rates": INT_MISSING_RATES,
        "int_negative_rates": {f: INT_TABLE[f][3] for f in INT_FIELDS},
        "weight_sigmas": {f: _sigma(f) for f in FIELDS},
        "planted_conjunctions": [list(p) for p in PLANTED_CONJUNCTIONS],
        "conjunction_sigma": WEIGHT_SCALE * CONJUNCTION_SIGMA,
        "int_bucketing": "log_squared",
        "model": "label ~ Bernoulli(sigmoid(intercept + sum of token_weight(token))) over the "
        "pipeline.spec tokens with PLANTED_CONJUNCTIONS; see pipeline.generate.token_weight",
    }
    if summary["with_prob"]:
        truth["bayes_logloss"] = summary["bayes_logloss"]
    tmp = out / f"._truth.json.inprogress-{os.getpid()}"
    tmp.write_text(json.dumps(truth, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, out / "_truth.json")
