"""The train job's memory preflight: a rank's peak memory, estimated on the driver before Spark.

Pure arithmetic over the manifest, the planned shards and the configuration (no Spark, no
data read), through the accounting the ranks use too (:mod:`jobs.memory_accounting`: its
docstring has every term, in the categories process baseline, shard, model state, L-BFGS memory
and buffers) fed the largest shard plan_shards made, D = 2^bits, a bound on the active features
(:func:`active_bound`, every feature with a warm start) and :data:`BASELINE_BYTES` for the process.

needed = baseline + CSR + max(read, gather, each solver phase's state + buffers), where with
``train.data_cache = disk`` the CSR term is the blocks a pass holds (the budget, once the driver
has chosen it). These are upper bounds of what the solvers allocate; the measured peak RSS of every rank is in the model's
``per_rank[i]["memory"]`` (its peak, baseline, per-phase peaks and the same accounting over its
real sizes) beside the estimate (``metadata["memory_estimate"]``).

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
from terascale.jobs.memory_accounting import CSR_TERM, Plan, Sizes, account
from terascale.jobs.memory_accounting import fmt_bytes as _fmt

MIB = 1 << 20
BASELINE_BYTES = 400 * MIB  # one Spark Python worker with its kernels loaded (measured: docs/pages/explanation/design-notes.md)
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


@dataclass
class Estimate:
    terms: dict[str, int]  # the terms at the peak, bytes
    phase: str  # which phase peaks: read, split, online passes, L-BFGS, CoCoA rounds
    needed: int
    available: int | None = None
    source: str = "unknown"
    shard: dict = field(default_factory=dict)
    categories: dict[str, int] = field(default_factory=dict)  # jobs.memory_accounting.CATEGORIES at the peak
    phase_totals: dict[str, int] = field(default_factory=dict)  # every phase's total

    def fits(self) -> bool:
        return self.available is None or self.needed <= self.available

    def to_json(self) -> dict:
        return {"needed_bytes": self.needed, "available_bytes": self.available, "available_from": self.source,
                "peak_phase": self.phase, "terms": dict(self.terms), "shard": dict(self.shard),
                "categories": dict(self.categories), "phase_totals": dict(self.phase_totals)}

    def summary(self, top: int = 4) -> str:
        biggest = sorted(self.terms.items(), key=lambda kv: -kv[1])[:top]
        return ", ".join(f"{k} {_fmt(v)}" for k, v in biggest)


def active_bound(manifest: dict, n_features: int) -> int:
    """At most this many features occur in the dataset: the manifest's ``distinct_features``
    (the buckets its group map marks, bits <= 26), else min(2^bits, its non-zeros)."""
    distinct = manifest.get("distinct_features")
    return int(distinct) if distinct is not None else min(n_features, int(manifest["nnz"]))


def estimate(t, n_features: int, shard: ShardSize, active: int, workers: int, chunk_bytes: int,
             warm_start: bool = False, cache_budget: int = 0) -> Estimate:
    """A rank's peak memory (module docstring). ``t``: the train section (or any object with
    its solver, lbfgs_memory, holdout_period, threads, partition); ``active``: a bound on the
    features in the data (:func:`active_bound`); ``cache_budget``: with train.data_cache = disk,
    the bytes of its shard a rank holds at once (the CSR term is then at most that)."""
    D = n_features
    d = D if warm_start else min(D, active)
    acc = account(Plan.of(t, t.holdout_period > 0 or t.holdout_latest > 0, workers, chunk_bytes, cache_budget),
                  Sizes(D, shard.rows, shard.nnz, shard.nnz_values, d, features=min(D, shard.nnz, active)),
                  BASELINE_BYTES)
    return Estimate(acc.terms, acc.peak_phase, acc.total,
                    shard={"rows": shard.rows, "nnz": shard.nnz, "active_features_bound": d, "n_features": D},
                    categories=acc.categories(), phase_totals=acc.phase_totals())


#: the Spark settings :func:`available` and the train job read (what a Spark Connect client asks
#: the server for: it cannot list them all)
CONF_KEYS = ("spark.executor.cores", "spark.executor.pyspark.memory", "spark.executor.memoryOverhead",
             "spark.executor.memory", "spark.executor.memoryOverheadFactor", "spark.driver.memory",
             "spark.local.dir", "spark.task.cpus")


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
    fixes = [f"more workers (train.workers={workers}: the shard shrinks)" if est.terms.get(CSR_TERM, 0) > est.needed // 4 else None,
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
