"""One rank's memory in named categories: the one accounting of the driver's preflight and the ranks.

Pure arithmetic (no Spark, no numba, no data): the driver's preflight (:mod:`jobs.preflight`)
feeds it the planned largest shard and a bound on the active features; every rank of the train
job (:mod:`jobs.train_task`) feeds it its own shard's real sizes, its measured process baseline
and the active features its solver agreed on, and records the result beside its measured peak.

Sizes, with D = 2^bits features, n rows and z non-zeros in the rank's shard, d ≤ min(D, the
dataset's non-zeros) active features (every feature with a warm start), f ≤ min(D, z, d)
features of the shard, m = ``lbfgs_memory``. Each term belongs to one category:

- ``process_baseline``: Python, numpy, pyarrow, numba's compiled kernels, the Spark worker: a
  constant on the driver (``jobs.preflight.BASELINE_BYTES``), measured on a rank.
- ``shard``: the CSR: indptr int64, indices int32, labels and weights float32, and the values
  other than 1 with their positions (12 bytes each, at most 4 per non-zero: the layouts of
  ``solvers.kernels.values``): 8·(n+1) + 4·z + 8·n + min(12·z_v, 4·z), z_v the non-zeros of
  rows with explicit values (a bound; a rank counts its arrays' bytes, ``CSRData.nbytes``).
  While reading, one record batch of ``pipeline.dataset.BATCH_ROWS`` rows (its Arrow arrays and
  the held-out split's mask and copies): about 13 bytes per non-zero and 24 per row of the
  batch; the held-out rows are split off as the batches arrive, so there is no second CSR.
  With ``train.data_cache = disk`` (``pipeline.shard_cache``) the CSR streams from the local
  shard cache and a pass holds one block of rows per thread: the CSR term is then the budget B,
  min(CSR, B) (``Plan.cache_budget``); not for CoCoA, whose random order maps the whole shard.
  CoCoA: its renumbered copy of the indices 4·z and its dense values 4·z, and
  ``partition=redeal``'s gathered rows (workers × the CSR, twice while gathering).
- ``model_state``: online (and the hybrid's first passes): the w, G, s table, 3 float32 per
  feature, 12·(D+1); the weights as float64 (start, current and best) 24·(D+1); the active
  features' position map int32 4·D and presence marks 1·D, their ids 8·d; the averaging vector
  and its sum 16·(d+1); with L1 the shared normalizers (``solvers.online``: the ids and values
  kept, 12·d, and the AllReduce's vector and sum while they are agreed, 16·d, plus a gather 4·d)
  32·d; the returned float32 weights 4·D; with T > 1 threads the hot-feature
  replicas and relabel maps (:func:`hot_bytes`, under ``buffers``). L-BFGS: full-length
  float64 weights (current, and the best under early stopping; the start is dropped once
  compacted) 16·(D+1); feature maps (active position, local slot) 8·D; the local table
  (3 float64 + an int64 id per own feature) 32·(f+1); the returned float32 weights 4·D;
  with a regularization path (``train.l2 = auto``) the best step's float32 weights and the next
  step's float64 start 12·(D+1). Nothing per non-zero: the job hands its shard over, so the
  local table renumbers the indices in place (in the cache's file on disk), once for the whole
  path (its steps share the table, ``solvers.local_table.working_table``), as a fixed λ does.
  CoCoA: w, its update, u over all features and the round's AllReduce vector and sum 40·(D+1);
  dual variables, updates and messages 48·n; per thread replicas 16·threads·(f+1) and the local
  vectors 24·(f+1); feature counts 4·D; the returned weights 8·D.
- ``lbfgs_memory``: the pairs, 2·m float32 per active feature, 8·m·(d+1), and about ten float64
  vectors over the active features (iterate, gradient, preconditioner, direction, trial point
  and its gradient, two-loop work) 80·(d+1).
- ``buffers``: the AllReduce chunk buffers 3·``allreduce.chunk_bytes`` and L-BFGS's gradient +
  Hessian AllReduce buffer and its sum 32·(d+1); with T = ``threads`` > 1, L-BFGS's per-thread
  accumulators: each thread but the first sums into its own copy of the local table,
  24·(T−1)·(f+1), or, in the lbfgs solver's first evaluation (before the table exists), into its
  own full-length gradient and Hessian, 16·(T−1)·(D+1): the larger of the two.

A rank peaks in one phase: reading, gathering (``partition=redeal``), or one of its solver's
phases (the hybrid has two); total = baseline + CSR + max(read, gather, each solver phase's
state + buffers). These are
upper bounds of what the solvers allocate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from terascale.solvers.catalogue import solver_spec
from terascale.solvers.hot import ALIGN, MAX_HOT, ROW_BYTES, ROWS_PER_ALIGN
from terascale.solvers.regpath import auto_penalty

PROCESS_BASELINE, SHARD, MODEL_STATE, LBFGS_MEMORY, BUFFERS = (
    "process_baseline", "shard", "model_state", "lbfgs_memory", "buffers")
CATEGORIES = (PROCESS_BASELINE, SHARD, MODEL_STATE, LBFGS_MEMORY, BUFFERS)
#: the phases a rank goes through, as the preflight names them; a rank measures "read" (its read
#: and split) and "solver" (every solver phase) separately
READ, SPLIT = "read", "split"
SOLVER_PHASES = {"online": "online passes", "lbfgs": "L-BFGS", "cocoa": "CoCoA rounds"}
CSR_TERM = "shard CSR"
STREAMED_TERM = "shard blocks in memory (train.data_cache = disk)"
BASELINE_TERM = "process baseline"


def fmt_bytes(b: float) -> str:
    """Bytes for people: '1.2 GiB', '448.0 MiB', '12 B'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= size:
            return f"{b / size:.1f} {unit}"
    return f"{int(b)} B"


def memory_line(meta: dict) -> str:
    """One line of a trained model's memory (``terascale train``'s summary): each rank's measured
    peak RSS, and the driver's estimate."""
    ranks = sorted(meta.get("per_rank", []), key=lambda r: r["rank"])
    peaks = ", ".join(f"{fmt_bytes(r['peak_rss_bytes'])} (rank {r['rank']})" for r in ranks)
    est = meta.get("memory_estimate") or {}
    line = f"peak RSS {peaks or 'n/a'}"
    if est.get("needed_bytes"):
        line += f"; estimate {fmt_bytes(est['needed_bytes'])} at the {est.get('peak_phase', '?')} peak"
    return line


def csr_bytes(rows: int, nnz: int, nnz_values: int | None = None) -> int:
    """The CSR of ``rows`` rows and ``nnz`` non-zeros of which ``nnz_values`` (default all) are
    in rows with explicit values (the preflight's bound, module docstring)."""
    z_v = nnz if nnz_values is None else nnz_values
    return 8 * (rows + 1) + 4 * nnz + min(12 * z_v, 4 * nnz) + 8 * rows


def hot_bytes(n_features: int, threads: int) -> int:
    """The online phase's hot-feature replicas with T > 1 (:mod:`solvers.hot`): T blocks of at most
    MAX_HOT + 1 rows of 16 B each rounded up to ALIGN bytes, the rows and bytes that align them, and
    while relabelling a slot map (2 B), a bitmap (1 bit) and the features' marks (1 B) per feature."""
    blocks = (threads * (MAX_HOT + ROWS_PER_ALIGN) + ROWS_PER_ALIGN) * ROW_BYTES + ALIGN
    return blocks + 3 * n_features + (n_features + 7) // 8


def batch_bytes(rows: int, nnz: int) -> int:
    """One record batch of the read in flight (module docstring)."""
    from terascale.pipeline.dataset import BATCH_ROWS

    batch = min(rows, BATCH_ROWS)
    per_row = nnz / rows if rows else 0.0
    return int(batch * (13 * per_row + 24))


@dataclass(frozen=True)
class Plan:
    """What the run does, as far as memory goes (from ``TrainConf`` or ``SolverParams``)."""

    solver: str
    lbfgs_memory: int
    threads: int
    partition: str
    holdout: bool  # the held-out rows are split off (while reading: no second CSR)
    workers: int
    chunk_bytes: int
    path: bool = False  # train.l2 or train.l1 = auto: a regularization path (solvers.regpath)
    l1: bool = False  # train.l1 > 0 or auto: the online phase shares its normalizers
    #: train.data_cache = disk: the bytes of its shard a rank holds at once (the budget); 0: in memory
    cache_budget: int = 0

    @classmethod
    def of(cls, p, holdout: bool, workers: int, chunk_bytes: int, cache_budget: int = 0) -> Plan:
        """From any object with the solver's parameters (a ``TrainConf``, ``SolverParams``);
        ``cache_budget``: see the field."""
        l1 = getattr(p, "l1", 0.0)
        return cls(p.solver, p.lbfgs_memory, p.threads, p.partition, holdout, workers, chunk_bytes,
                   auto_penalty(p) is not None, l1 == "auto" or (isinstance(l1, (int, float)) and l1 > 0),
                   cache_budget)


@dataclass(frozen=True)
class Sizes:
    """One rank's shard and features."""

    n_features: int  # D = 2^bits
    rows: int
    nnz: int
    nnz_values: int  # non-zeros that carry explicit values (0 for a binary shard)
    active: int  # d: the active features (their bound on the driver; every feature with a warm start)
    csr: int | None = None  # bytes of the shard's CSR as held; None: csr_bytes(rows, nnz)
    features: int | None = None  # f: (a bound on) the shard's own features; None: min(D, z, d)


@dataclass
class Accounting:
    """A rank's memory by phase. ``terms[name] = (category, bytes)``."""

    base: dict[str, tuple[str, int]]  # held throughout: the process and its shard
    phases: dict[str, dict[str, tuple[str, int]]]  # phase -> its terms on top of the base
    peak_phase: str = field(init=False)

    def __post_init__(self) -> None:
        self.peak_phase = max(self.phases, key=lambda k: sum(b for _, b in self.phases[k].values()))

    def terms_at(self, phase: str | None = None) -> dict[str, int]:
        """The terms of ``phase`` (default: the peak), bytes."""
        return {k: b for k, (_, b) in {**self.base, **self.phases[phase or self.peak_phase]}.items()}

    @property
    def terms(self) -> dict[str, int]:
        """The terms at the peak, bytes (the preflight's ``terms``)."""
        return self.terms_at()

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def breakdown(self, phase: str | None = None) -> dict[str, dict[str, int]]:
        """{category: {term: bytes}} in ``phase`` (default: the peak), every category present."""
        out: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        for name, (cat, b) in {**self.base, **self.phases[phase or self.peak_phase]}.items():
            out[cat][name] = b
        return out

    def categories(self, phase: str | None = None) -> dict[str, int]:
        """{category: bytes} in ``phase`` (default: the peak); at the peak they sum to :attr:`total`."""
        return {c: sum(t.values()) for c, t in self.breakdown(phase).items()}

    def phase_totals(self) -> dict[str, int]:
        """Each phase's total (base + its terms), bytes."""
        base = sum(b for _, b in self.base.values())
        return {k: base + sum(b for _, b in v.values()) for k, v in self.phases.items()}


def account(plan: Plan, s: Sizes, baseline: int) -> Accounting:
    """A rank's memory (module docstring) with the process baseline ``baseline`` bytes."""
    D, n, z, d = s.n_features, s.rows, s.nnz, s.active
    f = min(D, z, d) if s.features is None else s.features
    spec = solver_spec(plan.solver)
    redeal = "cocoa" in spec.phases and plan.partition == "redeal"
    csr = csr_bytes(n, z, s.nnz_values) if s.csr is None else s.csr
    if redeal:
        csr *= plan.workers  # every rank gathers all rows
    if plan.cache_budget > 0 and "cocoa" not in spec.phases:  # streamed: a block per thread at once
        shard = {STREAMED_TERM: (SHARD, min(csr, plan.cache_budget))}
    else:
        shard = {CSR_TERM: (SHARD, csr)}
    base = {BASELINE_TERM: (PROCESS_BASELINE, baseline), **shard}
    read = {"one record batch in flight while reading": (SHARD, batch_bytes(n, z))}
    split = {"rows in flight while gathering": (SHARD, csr)} if redeal else {}
    online = {
        "online table w, G, s (12 B x 2^bits)": (MODEL_STATE, 12 * (D + 1)),
        "float64 weights, start, current and best (24 B x 2^bits)": (MODEL_STATE, 24 * (D + 1)),
        "feature maps and marks (5 B x 2^bits)": (MODEL_STATE, 5 * D),
        "averaging vectors (24 B x active features)": (MODEL_STATE, 24 * (d + 1)),
        **({"L1: shared normalizers, kept and in flight (32 B x active features)": (MODEL_STATE, 32 * d)}
           if plan.l1 else {}),
        "returned float32 weights": (MODEL_STATE, 4 * D),
        **({f"hot-feature replicas and relabel maps ({plan.threads} threads)": (BUFFERS, hot_bytes(D, plan.threads))}
           if plan.threads > 1 else {}),
    }
    lbfgs = {
        f"L-BFGS pairs (2 x {plan.lbfgs_memory} float32 x active features)": (LBFGS_MEMORY, 8 * plan.lbfgs_memory * (d + 1)),
        "L-BFGS vectors (10 float64 x active features)": (LBFGS_MEMORY, 80 * (d + 1)),
        "gradient/Hessian AllReduce (32 B x active features)": (BUFFERS, 32 * (d + 1)),
        "float64 weights, current and best (16 B x 2^bits)": (MODEL_STATE, 16 * (D + 1)),
        "feature maps (8 B x 2^bits)": (MODEL_STATE, 8 * D),
        "local table (32 B x shard features)": (MODEL_STATE, 32 * (f + 1)),
        **({f"per-thread accumulators ({plan.threads - 1} more threads)": (BUFFERS, (plan.threads - 1) * max(24 * (f + 1), 0 if "online" in spec.phases else 16 * (D + 1)))} if plan.threads > 1 else {}),
        "returned float32 weights": (MODEL_STATE, 4 * D),
        **({"regularization path: best model and warm start (12 B x 2^bits)": (MODEL_STATE, 12 * (D + 1))}
           if plan.path else {}),
    }
    cocoa = {
        "CoCoA shared vectors (40 B x 2^bits)": (MODEL_STATE, 40 * (D + 1)),
        "renumbered indices (4 B x shard non-zeros)": (SHARD, 4 * z),
        "dense values for the SCD kernels (4 B x shard non-zeros)": (SHARD, 4 * z),
        "dual variables and messages (48 B x shard rows)": (MODEL_STATE, 48 * n),
        f"thread replicas ({plan.threads} x 16 B x shard features)": (MODEL_STATE, 16 * plan.threads * (f + 1)),
        "local vectors (24 B x shard features)": (MODEL_STATE, 24 * (f + 1)),
        "feature counts (4 B x 2^bits)": (MODEL_STATE, 4 * D),
        "returned weights (8 B x 2^bits)": (MODEL_STATE, 8 * D),
    }
    states = {"online": online, "lbfgs": lbfgs, "cocoa": cocoa}
    phases = {READ: read, **({SPLIT: split} if split else {})}
    for p in spec.phases:
        phases[SOLVER_PHASES[p]] = {**states[p], "AllReduce chunk buffers": (BUFFERS, 3 * plan.chunk_bytes)}
    return Accounting(base, phases)
