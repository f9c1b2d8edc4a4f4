"""The train job's memory preflight: a rank's peak memory, estimated on the driver before Spark.

Pure arithmetic over the manifest, the planned shards and the configuration (no Spark, no
data read). Sizes, with D = 2^bits features, n rows and z non-zeros in the rank's shard (the
largest shard plan_shards made), d ≤ min(D, the dataset's non-zeros) active features (every
feature with a warm start), f ≤ min(D, z) features of the shard, m = ``lbfgs_memory``:

- shard CSR (README "Memory": about 8 bytes per non-zero and 16 per row): indptr int64, indices
  int32, values float32, labels and weights float32: 8·(n+1) + 8·z + 8·n.
- while reading: the Arrow tables beside the CSR: indices 4·z, values 4·z_v (z_v: the
  non-zeros of rows with explicit values, from the manifest's ``rows_with_values``), offsets,
  labels, weights 16·n; while splitting off the held-out rows: a second CSR.
- online (and the hybrid's first passes): the w, G, s table, 3 float32 per feature, 12·(D+1);
  the weights as float64 (start, current and best) 24·(D+1); the active features' position map int32
  4·D and presence marks 1·D, their ids 8·d; the averaging vector and its sum 16·(d+1); the
  returned float32 weights 4·D.
- L-BFGS: the pairs, 2·m float32 per active feature, 8·m·(d+1); about ten float64 vectors
  over the active features (iterate, gradient, preconditioner, direction, trial point and its
  gradient, two-loop work) 80·(d+1); the gradient + Hessian AllReduce buffer and its sum
  32·(d+1); full-length float64 weights (start, current, best) 24·(D+1); feature maps (active
  position, local slot) 8·D; the local table (3 float64 + an int64 id per own feature)
  32·(f+1); the returned float32 weights 4·D. The hybrid peaks in one of its two phases.
- CoCoA: w, its update, u over all features and the round's AllReduce vector and sum
  40·(D+1); a renumbered copy of the indices 4·z; dual variables, updates and messages 48·n;
  per thread replicas 16·threads·(f+1) and the local vectors 24·(f+1); feature counts 4·D;
  the returned weights 8·D;
  ``partition=redeal`` gathers every rank's rows (workers × the CSR, twice while gathering).
- AllReduce chunk buffers 3·``allreduce.chunk_bytes``, and the process itself
  (:data:`BASELINE_BYTES`: Python, numpy, pyarrow, numba's compiled kernels, the Spark worker).

needed = baseline + CSR + max(read, split, each solver phase's state + buffers). These are upper bounds
of what the solvers allocate; the measured peak RSS of every rank is in the model's
``per_rank`` beside the estimate (``metadata["memory_estimate"]``).

The memory one rank may use: ``train.rank_memory_mb`` when set; else
``spark.executor.pyspark.memory`` divided by the executor's cores (as Spark splits it between
its Python workers); else on YARN and Kubernetes ``spark.executor.memoryOverhead`` (default
max(384 MiB, ``memoryOverheadFactor`` × ``spark.executor.memory``)) per core, since the
Python workers' memory counts against it; in local mode the machine's memory less the driver's
JVM, divided by workers + spares. Elsewhere (standalone) it is unknown and the estimate is only
logged.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from terascale.jobs.config import ConfigError
from terascale.solvers.catalogue import solver_spec

MIB = 1 << 20
BASELINE_BYTES = 448 * MIB  # one Python worker's RSS before its shard (see module docstring)
_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


class PreflightError(ConfigError):
    """The run does not fit the memory of one rank; the message has the numbers and the fixes."""


def parse_size(text: str, default_unit: str = "m") -> int:
    """Bytes of a Spark size setting: '4g', '512m', '1024' (in ``default_unit``), '1.5g'."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([bkmgtp]?)(?:i?b)?\s*", str(text).lower())
    if m is None:
        raise ConfigError(f"{text!r}: not a size like 4g or 512m")
    return int(float(m.group(1)) * _UNITS[m.group(2) or default_unit])


@dataclass(frozen=True)
class ShardSize:
    rows: int
    nnz: int
    nnz_values: int  # non-zeros of the rows that carry explicit values


def shard_sizes(shards, manifest: dict) -> list[ShardSize]:
    """Rows and non-zeros per planned shard (``pipeline.dataset.plan_shards``)."""
    share = {}
    for f in manifest["files"]:
        rows = f["rows"] or 1
        share[f["path"]] = f.get("rows_with_values", f["rows"]) / rows
    out = []
    for s in shards:
        rows = sum(p.rows for p in s)
        nnz = sum(p.nnz_estimate for p in s)
        nv = sum(round(p.nnz_estimate * share.get(p.path.rsplit("/", 1)[-1], 1.0)) for p in s)
        out.append(ShardSize(rows, nnz, nv))
    return out


def _fmt(b: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= size:
            return f"{b / size:.1f} {unit}"
    return f"{int(b)} B"


@dataclass
class Estimate:
    terms: dict[str, int]  # the terms at the peak, bytes
    phase: str  # which phase peaks: read, split, online passes, L-BFGS, CoCoA rounds
    needed: int
    available: int | None = None
    source: str = "unknown"
    shard: dict = field(default_factory=dict)

    def fits(self) -> bool:
        return self.available is None or self.needed <= self.available

    def to_json(self) -> dict:
        return {"needed_bytes": self.needed, "available_bytes": self.available, "available_from": self.source,
                "peak_phase": self.phase, "terms": dict(self.terms), "shard": dict(self.shard)}

    def summary(self, top: int = 4) -> str:
        biggest = sorted(self.terms.items(), key=lambda kv: -kv[1])[:top]
        return ", ".join(f"{k} {_fmt(v)}" for k, v in biggest)


def active_bound(manifest: dict, n_features: int) -> int:
    """At most this many features occur in the dataset: the manifest's ``distinct_features``
    (the buckets its group map marks, bits <= 26), else min(2^bits, its non-zeros)."""
    distinct = manifest.get("distinct_features")
    return int(distinct) if distinct is not None else min(n_features, int(manifest["nnz"]))


def estimate(t, n_features: int, shard: ShardSize, active: int, workers: int, chunk_bytes: int,
             warm_start: bool = False) -> Estimate:
    """A rank's peak memory (module docstring). ``t``: the train section (or any object with
    its solver, lbfgs_memory, holdout_period, threads, partition); ``active``: a bound on the
    features in the data (:func:`active_bound`)."""
    D = n_features
    n, z = shard.rows, shard.nnz
    d = D if warm_start else min(D, active)
    f = min(D, z, active)
    spec = solver_spec(t.solver)
    redeal = "cocoa" in spec.phases and t.partition == "redeal"
    csr = 8 * (n + 1) + 8 * z + 8 * n
    if redeal:
        csr *= workers  # every rank gathers all rows
    base = {"process baseline": BASELINE_BYTES, "shard CSR": csr}
    read = {"Arrow tables while reading": 4 * z + 4 * shard.nnz_values + 16 * n}
    split = {"held-out split copy": csr} if t.holdout_period > 0 and spec.holdout else {}
    if redeal:
        split = {"rows in flight while gathering": csr}
    online = {
        "online table w, G, s (12 B x 2^bits)": 12 * (D + 1),
        "float64 weights, start, current and best (24 B x 2^bits)": 24 * (D + 1),
        "feature maps and marks (5 B x 2^bits)": 5 * D,
        "averaging vectors (24 B x active features)": 24 * (d + 1),
        "returned float32 weights": 4 * D,
    }
    lbfgs = {
        f"L-BFGS pairs (2 x {t.lbfgs_memory} float32 x active features)": 8 * t.lbfgs_memory * (d + 1),
        "L-BFGS vectors (10 float64 x active features)": 80 * (d + 1),
        "gradient/Hessian AllReduce (32 B x active features)": 32 * (d + 1),
        "float64 weights, start, current and best (24 B x 2^bits)": 24 * (D + 1),
        "feature maps (8 B x 2^bits)": 8 * D,
        "local table (32 B x shard features)": 32 * (f + 1),
        "returned float32 weights": 4 * D,
    }
    cocoa = {
        "CoCoA shared vectors (40 B x 2^bits)": 40 * (D + 1),
        "renumbered indices (4 B x shard non-zeros)": 4 * z,
        "dual variables and messages (48 B x shard rows)": 48 * n,
        f"thread replicas ({t.threads} x 16 B x shard features)": 16 * t.threads * (f + 1),
        "local vectors (24 B x shard features)": 24 * (f + 1),
        "feature counts (4 B x 2^bits)": 4 * D,
        "returned weights (8 B x 2^bits)": 8 * D,
    }
    by_phase = {"online": ("online passes", online), "lbfgs": ("L-BFGS", lbfgs), "cocoa": ("CoCoA rounds", cocoa)}
    states = dict(by_phase[p] for p in spec.phases)
    phases = {"read": read, "split": split}
    phases.update({k: {**v, "AllReduce chunk buffers": 3 * chunk_bytes} for k, v in states.items()})
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    terms = {**base, **phases[phase]}
    return Estimate(terms, phase, sum(terms.values()),
                    shard={"rows": n, "nnz": z, "active_features_bound": d, "n_features": D})


def available(conf: dict[str, str], master: str, ranks: int, rank_memory_mb: int = 0,
              machine_bytes: int | None = None) -> tuple[int | None, str]:
    """(bytes one rank may use, where that came from) from the Spark settings ``conf``
    (module docstring); (None, why) when it cannot be known."""
    if rank_memory_mb:
        return rank_memory_mb * MIB, "train.rank_memory_mb"
    cores = int(conf.get("spark.executor.cores", "1") or 1)
    py = conf.get("spark.executor.pyspark.memory")
    if py:
        return parse_size(py) // cores, f"spark.executor.pyspark.memory={py} / {cores} executor cores"
    if master.startswith(("yarn", "k8s")):
        overhead = conf.get("spark.executor.memoryOverhead")
        if overhead:
            total, why = parse_size(overhead), f"spark.executor.memoryOverhead={overhead}"
        else:
            heap = conf.get("spark.executor.memory", "1g")
            factor = float(conf.get("spark.executor.memoryOverheadFactor", "0.1"))
            total = max(384 * MIB, int(factor * parse_size(heap)))
            why = f"max(384m, {factor:g} x spark.executor.memory={heap}) overhead"
        return total // cores, f"{why} / {cores} executor cores"
    if re.fullmatch(r"local(\[[^\]]*\])?", master):
        if machine_bytes is None:
            try:
                machine_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                return None, "local mode, the machine's memory is unknown"
        driver = parse_size(conf.get("spark.driver.memory", "1g"))
        return max(machine_bytes - driver, 0) // max(ranks, 1), \
            f"local mode: (machine {_fmt(machine_bytes)} - driver {_fmt(driver)}) / {ranks} ranks"
    return None, f"master {master}: no per-task memory limit is known (set spark.executor.pyspark.memory or train.rank_memory_mb)"


def check(est: Estimate, mode: str, workers: int, bits: int) -> str | None:
    """Raise PreflightError (mode 'fail') or return a warning (mode 'warn') when the estimate
    does not fit; None when it fits or nothing is known."""
    if mode == "off" or est.fits():
        return None
    fixes = [f"more workers (train.workers={workers}: the shard shrinks)" if est.terms.get("shard CSR", 0) > est.needed // 4 else None,
             f"fewer feature bits (featurize.bits={bits}; every bit less halves the 2^bits terms)" if bits > 16 else None,
             "more memory per task (spark.executor.pyspark.memory, spark.executor.memoryOverhead, "
             "fewer cores per executor, or train.rank_memory_mb if the limit above is wrong)",
             "train.preflight=warn to run anyway"]
    msg = (f"memory preflight: one rank needs about {_fmt(est.needed)} at its {est.phase} peak but may use "
           f"{_fmt(est.available)} ({est.source}); biggest terms: {est.summary()}. "
           f"Try: {'; '.join(x for x in fixes if x)}")
    if mode == "fail":
        raise PreflightError(msg)
    return msg
