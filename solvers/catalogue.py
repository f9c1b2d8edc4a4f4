"""The catalogue: every loss and every solver, declared once.

Config validation, label checks, scoring's link, the L-BFGS curvature switch, the train job's
solver dispatch, the docs' tables and the tests' parametrisation read these tables; nothing
else lists losses or solvers.

**Losses.** A :class:`LossSpec` per loss. Its ``id`` is the one integer every kernel branches
on (the primal CPU kernels, the SDCA kernels and the GPU kernels alike); an id that is not in
:data:`LOSSES` is an error everywhere, never a silent fall-through.

**The objective.** Every solver minimises, over the rows of all ranks,

    f(β, b) = (1/Σᵢwᵢ)·Σᵢ wᵢ·ℓ(yᵢ, xᵢ·β + b) + λ₁·‖β‖₁ + (λ₂/2)·‖β‖²,
    λ₁ = ``train.l1`` (default 0), λ₂ = ``train.l2``, b unpenalized,

(the elastic net when both are positive; with λ₁ > 0 the L-BFGS phase is OWL-QN,
:mod:`terascale.solvers.owlqn`, and online passes shrink towards 0, :mod:`terascale.solvers.kernels.online`)
or its :class:`SolverSpec` says exactly how it differs (``objective_note``): CoCoA augments
every row with a constant feature of value s = ``train.intercept_scale`` whose coefficient is
penalized like the others, so it minimises f(β, b) + (λ₂/2)·(b/s)², which tends to f as s grows
(liblinear's bias term). The train job reports f itself for every model.

**Solvers.** A :class:`SolverSpec` per solver: its entry function (``"module:function"``,
imported when the solver runs), the parameters it reads, the losses and devices it supports,
whether it uses the held-out split, what state a rank keeps, and its cross-checks. Each
parameter is declared once in :data:`PARAMS` (default, help, constraint); ``train.*`` keys and
:class:`~terascale.solvers.params.SolverParams` are derived from these declarations.
A plugin registers a spec of its own with :func:`register_solver`.

No numba and no pyspark here: the driver reads this module before anything starts.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from terascale.solvers.constraints import (
    AutoOr,
    ConfigError,
    Interval,
    OneOf,
    OneOfLive,
    error,
    param,
)

# ---------------------------------------------------------------------------------------------
# Losses. The ids are module constants so numba kernels can branch on them as literals.

LOGISTIC = 0
SQUARED = 1
HINGE = 2
SQUARED_HINGE = 3


@dataclass(frozen=True)
class LossSpec:
    """One loss ℓ(y, m) of the margin m = x·β + b.

    ``labels``: "binary" (0/1 in the data, s = 2y − 1 ∈ {−1, +1} inside) or "real".
    ``link``: how a margin becomes a prediction: "sigmoid" (a probability) or "identity" (a
    score). ``curvature``: ℓ'' is informative (L-BFGS's Newton step and coarse preconditioner
    use it; a piecewise-linear loss has ℓ'' = 0). ``dual``: the SDCA step exists in closed form
    or by a safeguarded Newton step (CoCoA's dual formulation)."""

    name: str
    id: int
    labels: str
    link: str
    curvature: bool
    dual: bool
    formula: str

    def check_labels(self, labels: Any) -> int:
        """Index of the first label outside this loss's domain, or −1 (labels: a numpy array)."""
        if self.labels == "real":
            return -1
        bad = (labels != 0) & (labels != 1)
        return int(bad.argmax()) if bad.any() else -1


LOSSES: dict[str, LossSpec] = {s.name: s for s in (
    LossSpec("logistic", LOGISTIC, "binary", "sigmoid", True, True, "log(1 + exp(−s·m))"),
    LossSpec("squared", SQUARED, "real", "identity", True, True, "(m − y)² / 2"),
    LossSpec("hinge", HINGE, "binary", "identity", False, True, "max(0, 1 − s·m)"),
    LossSpec("squared_hinge", SQUARED_HINGE, "binary", "identity", True, True, "max(0, 1 − s·m)²"),
)}
LOSS_BY_ID: dict[int, LossSpec] = {s.id: s for s in LOSSES.values()}
LOSS_IDS: dict[str, int] = {s.name: s.id for s in LOSSES.values()}
assert len(LOSS_BY_ID) == len(LOSSES) and sorted(LOSS_BY_ID) == list(range(len(LOSSES)))


def loss_spec(name: str) -> LossSpec:
    """The spec of loss ``name``; ConfigError naming the known losses otherwise."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise error("train.loss", name, "one of " + ", ".join(repr(n) for n in LOSSES)) from None


def loss_by_id(loss_id: int) -> LossSpec:
    """The spec of loss id ``loss_id``; ValueError for an unknown id."""
    try:
        return LOSS_BY_ID[int(loss_id)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"loss id {loss_id!r}: not one of {sorted(LOSS_BY_ID)} "
                         f"({', '.join(f'{i} = {s.name}' for i, s in LOSS_BY_ID.items())})") from None


# ---------------------------------------------------------------------------------------------
# Solver parameters: each declared once; ``train.<name>`` is its configuration key.


def _registered() -> tuple[str, ...]:
    return tuple(SOLVERS)


@dataclass(frozen=True)
class _Declarations:
    """Every solver parameter (see :mod:`terascale.solvers.params` for the longer notes)."""

    solver: str = param("hybrid", "hybrid (online pass + weighted average, then L-BFGS), online, lbfgs, "
                        "cocoa (SCD local solver, CoCoA aggregation), or a solver a plugin registered",
                        OneOfLive(_registered, "registered solvers"))
    loss: str = param("logistic", "logistic (labels 0/1), squared (real labels), hinge and squared_hinge "
                      "(labels 0/1 as -1/+1)", OneOf(tuple(LOSSES)))
    l2: float = param("auto", "lambda of the mean-form objective (1/sum w) sum w*loss + lambda/2 |beta|^2; auto = "
                      "fit a decreasing path of 8 values from 100/N to 0.01/N in one run (N: the dataset's rows; 1e-4 to "
                      "1e-8 where N is not known), each warm-started from the one before, and keep the one with the best "
                      "held-out loss; when 100/N beats the next value, the path turns and tries up to 4 larger values "
                      "(370/N ...) while each wins (solvers.regpath; needs held-out rows and "
                      "a solver with a path: hybrid or lbfgs)", AutoOr(Interval(0, None)))
    l1: float = param(0.0, "lambda_1 of the L1 penalty lambda_1 |beta|_1 added to the objective (elastic net with l2; "
                      "b unpenalized): > 0 makes the L-BFGS phase OWL-QN and the online passes shrink weights to 0 "
                      "(truncated gradient), so the model is sparse; not with cocoa; auto = fit a decreasing path of 8 "
                      "values from 1e-4 to 1e-8 in one run (sparse to dense, each warm-started from the one before) "
                      "and keep the one with the best held-out loss, turning up from 1e-4 when it wins, as l2 = auto "
                      "does (then l2 must be a number)",
                      AutoOr(Interval(0, None)))
    passes: int = param(20, "maximum passes over the data, online passes included", Interval(1, 100000, integer=True))
    online_passes: int = param(1, "hybrid: online passes before L-BFGS starts", Interval(0, 100000, integer=True))
    learning_rate: float = param(0.5, "online learning rate (Vowpal Wabbit's -l)", Interval(0, None, lo_open=True))
    lbfgs_memory: int = param(15, "L-BFGS correction pairs kept", Interval(1, 1000, integer=True))
    lbfgs_newton_steps: int = param(2, "while L-BFGS holds fewer curvature pairs than this, its line search "
                                    "starts at the 1-D Newton step along the direction (one curvature pass each) "
                                    "instead of step 1; 0 = always step 1", Interval(0, 1000, integer=True))
    lbfgs_curvature_rows: int = param(1 << 16, "the curvature pass of a Newton step samples about this many rows "
                                      "per rank (runs of 512, scaled to the rank's weight); 0 = every row",
                                      Interval(0, 1_000_000_000, integer=True))
    lbfgs_coarse: bool = param(True, "L-BFGS: add the field-level coarse correction (one column per field of the "
                               "dataset's group map, and the intercept) to the Jacobi preconditioner (with l1 > 0 only "
                               "while l2 >= l1)")
    tol: float = param(1e-7, "relative tolerance on the gradient norm and the objective change (cocoa: the "
                       "relative duality gap)", Interval(0, 1))
    early_stop_passes: int = param(3, "stop after this many passes without a better held-out loss (0: off; not "
                                   "inside the steps of a regularization path, l2/l1 = auto, which run to train.tol)",
                                   Interval(0, 100000, integer=True))
    local_epochs: int = param(1, "cocoa: local SCD epochs per round (H)", Interval(1, 1000000, integer=True))
    aggregation: str = param("adaptive", "cocoa: adaptive (optimal step gamma), avg (1/K) or add (CoCoA+)",
                             OneOf(("adaptive", "avg", "add")))
    threads: int = param(1, "threads per worker (rank): the online pass runs this many lock-free (Hogwild) threads "
                         "on the shared weights; the gradient, curvature and scoring passes split the rows into "
                         "fixed blocks, one per thread, summed in a fixed order (the same bits on every run for a "
                         "given value); cocoa: its local solver's threads. The train job's barrier tasks ask Spark "
                         "for this many cpus each (spark.task.cpus)", Interval(1, 1024, integer=True))
    formulation: str = param("dual", "cocoa: dual, or primal (squared loss only)", OneOf(("dual", "primal")))
    partition: str = param("fixed", "cocoa: fixed shards, or redeal (dual, CPU): every worker gathers all rows "
                           "once (workers x the memory) and the rows are dealt afresh every round",
                           OneOf(("fixed", "redeal")))
    device: str = param("cpu", "cocoa: local solver on cpu, gpu (TPA-SCD; one GPU per task via Spark's "
                        "spark.task.resource.gpu.amount), or auto (the GPU if the task has one, else the CPU)",
                        OneOf(("cpu", "gpu", "auto")))
    gpu_blocks: int = param(0, "cocoa on a GPU: thread blocks of an epoch, each taking one coordinate (a row of the "
                            "dual, a column of the primal) at a time; 0 = one block per coordinate, as many at once as "
                            "the device holds. Fewer blocks put fewer rows in flight: each dual step needs less damping "
                            "(fewer epochs on data with frequent features, e.g. click logs), at the price of a less busy "
                            "device (docs/pages/how-to/gpu.md)", Interval(0, 2**31 - 1, integer=True))
    intercept_scale: float = param(1.0, "cocoa: value s of the constant feature that carries the intercept; its "
                                   "coefficient is penalized, so cocoa minimises the objective + lambda/2 (b/s)^2, "
                                   "which tends to the other solvers' objective as s grows (liblinear's bias)",
                                   Interval(0, 1e6, lo_open=True))
    seed: int = param(0, "seed of any shuffling (online passes, CoCoA epochs) and of the held-out split (train.holdout_period)",
                      Interval(0, 2**32 - 1, integer=True))
    shuffle: bool = param(False, "shuffle the rows of each online pass (off: stored order, like VW)")
    invariant: bool = param(True, "importance-invariant online updates")


PARAMS: tuple[dataclasses.Field, ...] = dataclasses.fields(_Declarations)
PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in PARAMS)

#: the parameters every solver reads
COMMON = ("solver", "loss", "l2", "l1", "passes", "tol", "seed", "threads")
ONLINE = ("learning_rate", "shuffle", "invariant", "early_stop_passes")
LBFGS = ("lbfgs_memory", "lbfgs_newton_steps", "lbfgs_curvature_rows", "lbfgs_coarse", "early_stop_passes")
COCOA = ("local_epochs", "aggregation", "formulation", "partition", "device", "gpu_blocks", "intercept_scale")


# ---------------------------------------------------------------------------------------------
# Solvers.


@dataclass(frozen=True)
class SolverSpec:
    """One solver.

    ``entry``: ``"module:function"`` (imported when the solver runs) or the function itself,
    ``fn(run: TrainRun) -> TrainResult`` (:mod:`terascale.solvers.run`). ``params``: the parameter names it reads (:data:`PARAMS`).
    ``losses`` and ``devices`` it supports. ``holdout``: it scores the held-out split after
    every pass (early stopping). ``phases``: the phases it runs, each with its per-rank state
    ("online": the AdaGrad table and averaging vectors; "lbfgs": the L-BFGS pairs, vectors and
    local table; "cocoa": the shared and dual vectors), which the memory preflight accounts.
    ``checkpoint``: "replicated" (the same state on every rank, one checkpoint) or "per_rank"
    (each rank its own dual variables). ``path``: it can fit a regularization path
    (``train.l2 = auto``, :mod:`terascale.solvers.regpath`): it warm-starts from ``init``, applies
    the penalty in every step and scores the held-out split.
    ``check(params)``: cross-checks between keys, raising ConfigError (run on the driver before
    Spark starts). ``check_resume(state, params, n_features)``: replaces the default check of a
    resume state. ``objective_note``: how its objective differs from the catalogue's one, or ''.
    """

    name: str
    entry: str | Callable[[Any], Any]
    summary: str
    params: tuple[str, ...]
    losses: tuple[str, ...]
    devices: tuple[str, ...] = ("cpu",)
    holdout: bool = True
    phases: tuple[str, ...] = ()
    checkpoint: str = "replicated"
    check: Callable[[Any], None] | None = None
    check_resume: Callable[..., None] | None = None
    objective_note: str = ""
    path: bool = False

    def function(self) -> Callable[[Any], Any]:
        if callable(self.entry):
            return self.entry
        module, _, name = self.entry.partition(":")
        return getattr(importlib.import_module(module), name)


def _check_hybrid(p: Any) -> None:
    if p.online_passes > p.passes:
        raise error("train.online_passes", p.online_passes, f"<= train.passes ({p.passes})")


def _check_cocoa(p: Any) -> None:
    if p.l1 == "auto" or p.l1 > 0:
        raise error("train.l1", p.l1, "0 with train.solver = 'cocoa' (its dual has no L1 term); use hybrid, lbfgs "
                    "or online for an L1 or elastic-net model")
    if p.l2 != "auto" and p.l2 <= 0:
        raise error("train.l2", p.l2, "> 0 with train.solver = 'cocoa' (its dual needs a positive penalty)")
    if p.formulation == "primal" and p.loss != "squared":
        raise ConfigError(f"train.formulation = 'primal': needs train.loss = 'squared' (got {p.loss!r}); "
                          "use train.formulation=dual")
    if p.partition == "redeal" and p.formulation != "dual":
        raise ConfigError(f"train.partition = 'redeal': needs train.formulation = 'dual' (got {p.formulation!r}); "
                          "re-dealing moves examples, the primal solver owns features")
    if p.partition == "redeal" and p.device == "gpu":
        raise ConfigError("train.partition = 'redeal' runs on the CPU only: set train.device to 'cpu' or 'auto', "
                          "or train.partition=fixed for the GPU solver")


_PRIMAL_LOSSES = tuple(LOSSES)
_DUAL_LOSSES = tuple(n for n, s in LOSSES.items() if s.dual)

SOLVERS: dict[str, SolverSpec] = {}
#: the penalties whose parameter accepts ``auto``: a regularization path (solvers.regpath.PATHS)
AUTO_PENALTIES = ("l2", "l1")


def register_solver(spec: SolverSpec, *, replace: bool = False) -> SolverSpec:
    """Add ``spec`` to :data:`SOLVERS` (a second registration of a name needs ``replace``)."""
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError(f"solver name must be a non-empty string, got {spec.name!r}")
    if spec.name in SOLVERS and SOLVERS[spec.name] != spec and not replace:
        raise ValueError(f"solver {spec.name!r} is already registered ({SOLVERS[spec.name].entry!r})")
    unknown = [n for n in spec.params if n not in PARAM_NAMES] + [n for n in spec.losses if n not in LOSSES]
    if unknown:
        raise ValueError(f"solver {spec.name!r}: unknown parameters or losses {unknown}")
    SOLVERS[spec.name] = spec
    return spec


def solver_spec(name: str) -> SolverSpec:
    """The spec of solver ``name``; ConfigError naming the registered solvers otherwise."""
    try:
        return SOLVERS[name]
    except (KeyError, TypeError):
        raise error("train.solver", name, "one of the registered solvers " + ", ".join(repr(n) for n in SOLVERS)) from None


def check_solver_params(p: Any) -> None:
    """The cross-checks of ``p`` (SolverParams): the solver exists, supports the loss and the
    device, its own checks pass, and a penalty at `auto` (at most one) has a solver that fits a path. One error format (:mod:`terascale.solvers.constraints`)."""
    spec = solver_spec(p.solver)
    if p.loss not in spec.losses:
        raise error("train.loss", p.loss, f"one of {', '.join(repr(n) for n in spec.losses)} with "
                    f"train.solver = {spec.name!r}")
    if spec.check is not None:
        spec.check(p)
    autos = [n for n in AUTO_PENALTIES if getattr(p, n) == "auto"]
    if len(autos) > 1:
        raise ConfigError(" and ".join(f"train.{n} = 'auto'" for n in autos) + ": a run fits one regularization "
                          "path, over one penalty; set the other to a number (train.l2 is auto by default: for an "
                          "L1 path set e.g. train.l2=1e-8, or train.l2=0 for a pure L1 model)")
    for name in autos:
        if not spec.path:
            raise error("train." + name, "auto", f"a number with train.solver = {spec.name!r}: 'auto' fits a "
                        "regularization path, which needs a solver that can ("
                        + ", ".join(repr(n) for n, s in SOLVERS.items() if s.path) + ")")


register_solver(SolverSpec(
    "hybrid", "terascale.solvers.hybrid:train_hybrid",
    "online AdaGrad pass(es) on every rank, per-coordinate weighted average, then L-BFGS (OWL-QN when l1 > 0) "
    "warm-started from it",
    COMMON + ("online_passes",) + ONLINE + LBFGS, _PRIMAL_LOSSES, phases=("online", "lbfgs"), check=_check_hybrid,
    path=True))
register_solver(SolverSpec(
    "online", "terascale.solvers.online:train_online",
    "online AdaGrad passes with a per-coordinate weighted average across ranks after each",
    COMMON + ONLINE, _PRIMAL_LOSSES, phases=("online",)))
register_solver(SolverSpec(
    "lbfgs", "terascale.solvers.lbfgs:train_lbfgs",
    "distributed L-BFGS from zero with a Jacobi (+ field-level coarse) preconditioner (OWL-QN when l1 > 0)",
    COMMON + LBFGS, _PRIMAL_LOSSES, phases=("lbfgs",), path=True))
register_solver(SolverSpec(
    "cocoa", "terascale.solvers.cocoa_solver:solve_cocoa",
    "stochastic (dual) coordinate descent on every rank, CoCoA aggregation of the updates",
    COMMON + COCOA, _DUAL_LOSSES, devices=("cpu", "gpu"), holdout=False, phases=("cocoa",),
    checkpoint="per_rank",
    check=_check_cocoa,
    check_resume=lambda *a: importlib.import_module("terascale.solvers.cocoa_solver").check_cocoa_resume(*a),
    objective_note="intercept = a constant feature of value train.intercept_scale, penalized: "
                   "minimises f + (l2/2)(b/s)^2"))


def markdown_tables() -> str:
    """The loss and solver tables of ``docs/pages/explanation/architecture.md`` (a test keeps them equal)."""
    rows = ["| loss | id | ℓ(y, m) | labels | link | curvature | dual (SDCA) |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.id} | {s.formula} | {s.labels} | {s.link} | {'yes' if s.curvature else 'no'} | "
             f"{'yes' if s.dual else 'no'} |" for s in LOSSES.values()]
    rows += ["", "| solver | what it does | losses | devices | held-out split | phases | checkpoint | objective |",
             "|---|---|---|---|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.summary} | {', '.join(s.losses)} | {', '.join(s.devices)} | "
             f"{'yes' if s.holdout else 'no'} | {', '.join(s.phases)} | {s.checkpoint} | {s.objective_note or 'f(β, b)'} |"
             for s in SOLVERS.values()]
    return "\n".join(rows) + "\n"
