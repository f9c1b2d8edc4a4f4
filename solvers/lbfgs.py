"""The ``lbfgs`` solver and the L-BFGS phase of the hybrid (Algorithm 2 of the terascale paper).

Every rank runs the same optimizer on the same numbers: each function evaluation is one local
pass plus ONE AllReduce (:mod:`solvers.objective`), and everything after it (two-loop
recursion, line search, stopping tests) is deterministic arithmetic on bit-identical bytes,
so the ranks never drift.

One L-BFGS pass = one iteration: direction p = −H·∇f (two-loop recursion, memory m,
preconditioner M⁻¹ from the L-BFGS start: Jacobi D⁻¹, D = diag ∇²f floored at 1e-12·max D, plus
the field-level coarse correction S·E⁻¹·Sᵀ when the data come with a group map and
``lbfgs_coarse`` is on, see :mod:`solvers.preconditioner`), a strong-Wolfe line
search from α = 1 (from the 1-D Newton step while fewer than ``lbfgs_newton_steps`` curvature
pairs are held, see :meth:`LBFGSPhase._first_step`), then the stopping tests, in this order:

    ‖∇f(θ_k)‖₂ ≤ tol·‖∇f(θ_start)‖₂                      -> "converged_grad"
    f(θ_{k−1}) − f(θ_k) ≤ tol·max(|f(θ_{k−1})|, |f(θ_k)|)  -> "converged_objective"
    early stopping on held-out data                       -> "early_stop"
    the pass budget (``passes``, online passes included)  -> "max_passes"

With ``l1`` = λ₁ > 0 the phase is OWL-QN (:mod:`solvers.owlqn`): the same pass structure,
state, active set and preconditioner, with the pseudo-gradient ◇f in place of ∇f in the
direction and the stopping test, directions aligned with −◇f, and a backtracking line search
over points projected onto an orthant instead of the strong-Wolfe search.

A line search that finds no acceptable step is retried once along −M⁻¹·∇f with the memory
cleared; if that fails too the run stops with "line_search_failed" (the objective is then flat
to rounding along the directions tried); if no trial point even had a finite objective, that
is a divergence and raises.

The phase works on the active features only (:mod:`solvers.active`: those in some rank's data
or non-zero at the start, in id order); the others stay exactly 0. The set is agreed
right after the first collective (before the first evaluation when a pass came first). After
the hybrid's online phase it is the set that phase averaged, which also holds the features some
rank had a non-zero online state for (a warm start's weights outside every rank's data, which
the averaging set to 0): they stay 0 as well. The
tracker, checkpoints and the result get the weights over all features; a checkpoint also keeps
the set (``lbfgs_active``), and the pairs, gradient and preconditioner (``lbfgs_inv_diag``, and
``lbfgs_coarse_group`` / ``lbfgs_coarse_E`` for the coarse correction) in compact numbering.
The phase's first pass's history entry also has ``start_objective``, f(θ_start), with
``start_objective_s``, the seconds into that pass when it was known (:meth:`PassTracker.note`):
after the hybrid's online passes, the objective of their average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from terascale.solvers.active import ActiveFeatures
from terascale.solvers.catalogue import loss_by_id
from terascale.solvers.errors import DivergenceError, InvalidInputError
from terascale.solvers.kernels.vector import dot, norm2
from terascale.solvers.lbfgs_memory import LBFGSMemory
from terascale.solvers.linesearch import strong_wolfe
from terascale.solvers.local_table import LocalTable, working_table
from terascale.solvers.objective import DistributedObjective
from terascale.solvers.online import resumed_stop
from terascale.solvers.owlqn import backtracking, steepest, trial_point
from terascale.solvers.owlqn import direction as owlqn_direction
from terascale.solvers.preconditioner import (
    Jacobi,
    TwoLevel,
    coarse_matrix,
    compact_groups,
    from_state,
    jacobi_inverse,
)
from terascale.solvers.run import TrainResult, TrainRun
from terascale.solvers.state import own, take


@dataclass
class LBFGSPhase:
    run: TrainRun
    space: ActiveFeatures  # the phase works on the active features only (solvers.active)
    objective: DistributedObjective  # over this rank's shard in compact numbering
    theta: np.ndarray  # float64 [β over the active features, b]
    value: float
    grad: np.ndarray
    precond: Jacobi  # M⁻¹: Jacobi, or Jacobi + the field-level coarse correction (TwoLevel)
    memory: LBFGSMemory
    grad0_norm: float
    pending_evals: int = 0  # evaluations not yet attributed to a pass (the start)
    curvature_passes: int = 0  # curvature passes of the pass in progress (see _first_step)
    start_info: dict = field(default_factory=dict)  # for the first pass's history entry
    _full: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def full_theta(self) -> np.ndarray:
        """θ over all features (for the tracker, the checkpoint and the result), written once
        per iterate into one buffer kept for the phase (the inactive entries stay 0): ``theta``
        is replaced by a new array at every step, never written to. Valid until the next
        iterate; consumers copy what they keep (the tracker's best weights, the result)."""
        if self._full is None:
            self._full = (self.theta, self.space.expand(self.theta))
        elif self._full[0] is not self.theta:
            self.space.scatter(self.theta, self._full[1])
            self._full = (self.theta, self._full[1])
        return self._full[1]

    @classmethod
    def start(cls, run: TrainRun, theta0: np.ndarray, space: ActiveFeatures | None = None) -> LBFGSPhase:
        """``space``: the set the hybrid's online phase agreed on (a superset of the features
        in some rank's data or non-zero in ``theta0``), else it is agreed here."""
        train = run.inputs.train
        # a pass came first (hybrid), or a phase restored from a checkpoint already numbered the
        # rows (a path resumed at the end of a step: the rows may hold local numbers, and the run
        # it resumes took this branch here): agree on the set, evaluate compact
        if run.inputs.agreed or run.inputs.table is not None:
            table = working_table(run.inputs)
            if space is None:
                space = ActiveFeatures.agree(run.comm, table.ids, train.n_features, theta0)
            objective = run.objective.restricted(table.bind(space))
            theta = space.compact(theta0)
            ev = objective.evaluate(theta, with_hessian=True)
            ev.raise_if_not_finite("at the L-BFGS starting point")
            grad, hess = ev.grad, ev.hess_diag
            value = ev.value
        else:  # this evaluation is the first pass: the tree forms only after it
            ev = run.objective.evaluate(theta0, with_hessian=True)
            ev.raise_if_not_finite("at the L-BFGS starting point")
            table = working_table(run.inputs)
            space = ActiveFeatures.agree(run.comm, table.ids, train.n_features, theta0)
            objective = run.objective.restricted(table.bind(space))
            theta, grad, hess = space.compact(theta0), space.compact(ev.grad), space.compact(ev.hess_diag)
            # the penalty summed in compact order, as every later value (and a resumed run) has it
            value = ev.loss_term + objective.penalty(theta)
        # f(θ₀) with the time it is known: the online phase's average is scored here, not at its pass's end
        run.tracker.note("start_objective", value)
        precond = _preconditioner(run, space, objective.table, theta, jacobi_inverse(hess))
        coarse = precond.n_groups if isinstance(precond, TwoLevel) else 0
        g0 = steepest(theta, grad, run.params.l1) if run.params.l1 > 0.0 else grad
        return cls(run, space, objective, theta, value, grad, precond,
                   LBFGSMemory(run.params.lbfgs_memory, theta.shape[0]), norm2(g0), 1,
                   start_info={"active_features": space.size, "coarse_groups": coarse})

    @classmethod
    def restore(cls, run: TrainRun, saved: dict) -> LBFGSPhase:
        n = run.n_features
        if "lbfgs_active" in saved:
            space = ActiveFeatures(saved["lbfgs_active"], n)
        else:  # a version-1 state: every feature, in id order
            space = ActiveFeatures.everything(n)
        try:
            table = working_table(run.inputs).bind(space)
        except ValueError:
            problem = InvalidInputError(
                f"rank {run.comm.rank}: resume state: this rank's training rows hold features "
                "outside the state's active set (lbfgs_active): they differ from the rows of the "
                "run that wrote it"
            )
            if not run.inputs.agreed:  # every rank raises at the agreement, none is left waiting
                run.inputs.problem = problem
                run.inputs.agree(run.comm.inner)
            raise problem from None
        objective = run.objective.restricted(table)
        # the full-length weights (8 B x 2^bits) leave the state as soon as they are compacted
        theta = space.compact(np.append(np.asarray(take(saved, "weights"), dtype=np.float64), saved["intercept"]))
        return cls(run, space, objective, theta, float(saved["lbfgs_f"]),
                   own(saved, "lbfgs_grad", np.float64),
                   from_state(saved), LBFGSMemory.from_state(saved),
                   float(saved["lbfgs_grad0_norm"]))

    @property
    def l1(self) -> float:
        return self.run.params.l1

    def steepest(self) -> np.ndarray:
        """∇f, or with λ₁ > 0 the pseudo-gradient ◇f at the current iterate (:mod:`solvers.owlqn`)."""
        return steepest(self.theta, self.grad, self.l1) if self.l1 > 0.0 else self.grad

    def _search_direction(self) -> tuple[np.ndarray, float]:
        if self.l1 > 0.0:
            return owlqn_direction(self.memory, self.precond, self.steepest())
        p = self.memory.direction(self.grad, self.precond)
        slope = dot(self.grad, p)
        if not slope < 0.0:  # the memory lost positive-definiteness numerically: restart
            self.memory.clear()
            p = np.negative(self.precond.apply(self.grad))
            slope = dot(self.grad, p)
        return p, slope

    def _phi(self, p: np.ndarray):
        objective = self.objective

        def phi(alpha: float):
            point = p * alpha
            point += self.theta
            ev = objective.evaluate(point)
            return ev.value, dot(ev.grad, p), (point, ev), ev.finite

        return phi

    def _first_step(self, p: np.ndarray, slope: float) -> tuple[float, int]:
        """The line search's first trial step and the data passes it cost. With enough curvature
        pairs in memory (``lbfgs_newton_steps``), 1: the quasi-Newton step. With fewer (the
        first iterations, or after the memory was cleared) the direction's scale is not yet
        right, so step 1 may overshoot (extra evaluations) or undershoot (less decrease): the
        1-D Newton step −∇f·p / pᵀ∇²f·p, from one curvature pass.

        Not for a loss without curvature (the catalogue's ``curvature``; hinge): its second derivative is 0, so only the penalty would bend the
        line (and not along the unpenalized intercept), giving absurd steps. A step that is not
        a finite positive number (an overflowing curvature, a non-finite margin on some rank)
        falls back to 1; every rank takes the same branch (AllReduce results only)."""
        if self.memory.count >= self.run.params.lbfgs_newton_steps or not loss_by_id(self.run.loss_id).curvature:
            return 1.0, 0
        curv = self.objective.curvature(self.theta, p, self.run.params.lbfgs_curvature_rows)
        alpha = -slope / curv if curv is not None and math.isfinite(curv) and curv > 0.0 else 1.0
        return (alpha if 0.0 < alpha < math.inf else 1.0), 1

    def _owlqn_phi(self, p: np.ndarray):
        objective, theta, pg = self.objective, self.theta, self.steepest()

        def phi(alpha: float):
            point, change = trial_point(theta, p, pg, alpha)
            ev = objective.evaluate(point)
            return ev.value, change, (point, ev), ev.finite

        return phi

    def _search(self, p: np.ndarray, slope: float):
        alpha0, passes = self._first_step(p, slope)
        self.curvature_passes += passes
        if self.l1 > 0.0:
            return backtracking(self._owlqn_phi(p), self.value, alpha0)
        return strong_wolfe(self._phi(p), self.value, slope, alpha0)

    def iterate(self, pass_number: int) -> str | None:
        """One L-BFGS pass; returns the stop reason or None."""
        if self.grad0_norm == 0.0:
            return "converged_grad"
        p, slope = self._search_direction()
        if not slope < 0.0:
            return "converged_grad"  # the gradient is zero to rounding
        res = self._search(p, slope)
        evals = res.evaluations + self.pending_evals
        if not res.ok and self.memory.count > 0:  # retry once along −M⁻¹·∇f
            self.memory.clear()
            p, slope = self._search_direction()
            if slope < 0.0:
                res = self._search(p, slope)
                evals += res.evaluations
        self.pending_evals = 0
        if not res.ok:
            if not res.any_finite:
                raise DivergenceError(
                    f"L-BFGS pass {pass_number}: no trial step gave a finite objective "
                    f"({res.evaluations} tried)"
                )
            self._record(None, evals)
            return "line_search_failed"
        point, ev = res.trial.payload
        self.memory.push(point, self.theta, ev.grad, self.grad)
        previous = self.value
        self.theta, self.value, self.grad = point, ev.value, ev.grad
        grad_norm = self._record(res.trial.alpha, evals)
        if grad_norm <= self.run.params.tol * self.grad0_norm:
            return "converged_grad"
        if previous - self.value <= self.run.params.tol * max(abs(previous), abs(self.value)):
            return "converged_objective"
        return None

    def _record(self, step: float | None, evals: int) -> float:
        grad_norm = norm2(self.steepest())
        extra = {"curvature_passes": self.curvature_passes} if self.curvature_passes else {}
        extra.update(self.start_info)
        self.curvature_passes = 0
        self.start_info = {}
        self.run.tracker.finish_pass(
            "lbfgs", self.full_theta(), objective=self.value, grad_norm=grad_norm, step=step,
            evaluations=evals, **extra,
        )
        return grad_norm

    def checkpoint(self, stop_reason: str | None) -> None:
        arrays, scalars = self.memory.to_state()
        arrays.update(lbfgs_grad=self.grad, lbfgs_active=self.space.ids, **self.precond.to_state())
        scalars.update(lbfgs_f=self.value, lbfgs_grad0_norm=self.grad0_norm)
        self.run.checkpoint("lbfgs", self.full_theta(), stop_reason, arrays, scalars)

    def run_until(self, last_pass: int) -> TrainResult:
        """Iterate until a stop reason or pass ``last_pass``; then finish the run."""
        tracker = self.run.tracker
        stop = None
        while stop is None:
            if tracker.passes_done >= last_pass:
                stop = "max_passes"
                break
            stop = self.iterate(tracker.passes_done + 1)
            if stop is None and tracker.should_stop:
                stop = "early_stop"
            if stop is None and tracker.passes_done >= last_pass:
                stop = "max_passes"
            self.checkpoint(stop)
        self.memory.release()  # the last checkpoint has the pairs; the result needs none of them
        return self.run.finish(self.full_theta(), self.value, stop, self._value_of)

    def _value_of(self, theta: np.ndarray) -> float:
        """f at full-length weights (early stopping's best pass may have been an online one,
        whose objective was not computed). Through the working table when it renumbered the
        shard in place (the shard's indices are its local numbers then; every pass's weights
        are 0 outside the active set, so compacting them loses nothing), else over the shard."""
        if self.run.inputs.consume:
            return self.objective.value(self.space.compact(theta))
        return self.run.objective.value(theta)


def _preconditioner(run: TrainRun, space: ActiveFeatures, table: LocalTable, theta: np.ndarray,
                    inv_diag: np.ndarray) -> Jacobi:
    """Jacobi plus the field-level coarse correction when the run has a group map and
    ``lbfgs_coarse`` is on (not for a loss without curvature, hinge: its data curvature is 0, so E would be the
    penalty alone and singular along the intercept; nor for OWL-QN with λ₂ < λ₁, below); else Jacobi.

    OWL-QN: along a field shift v the data barely bend f, so E_vv ≈ λ₂·(the field's size), while the
    pseudo-gradient there holds the L1 term, |vᵀ◇f| up to λ₁·(the field's size): the coarse part
    of the initial matrix moves the field's weights by up to λ₁/λ₂, a step with no bound as λ₂ → 0
    (the line search then halves it 20 times, pass after pass). With λ₂ ≥ λ₁ that shift is at
    most 1, and the correction pays as without L1 (docs/pages/explanation/design-notes.md, "OWL-QN and the coarse
    correction")."""
    if run.groups is None or not run.params.lbfgs_coarse or not loss_by_id(run.loss_id).curvature:
        return Jacobi(inv_diag)
    if run.params.l1 > run.params.l2:
        return Jacobi(inv_diag)
    group, sizes = compact_groups(run.groups, space.ids)
    if sizes.size == 0:  # no active feature has a group: nothing to correct
        return Jacobi(inv_diag)
    E = coarse_matrix(run.comm, table, group, sizes, theta, run.loss_id, run.params.l2,
                      run.inputs.total_weight, run.threads)
    if E is None:
        raise DivergenceError("non-finite margin at the L-BFGS starting point (coarse matrix); see the rank's data")
    return TwoLevel(inv_diag, group, E)


def lbfgs_from(run: TrainRun, theta0: np.ndarray, space: ActiveFeatures | None = None) -> TrainResult:
    phase = LBFGSPhase.start(run, theta0, space)
    del theta0  # the phase keeps θ over the active features only: the full-length start goes
    return phase.run_until(run.params.passes)


def lbfgs_resume(run: TrainRun) -> TrainResult:
    """Continue from an L-BFGS checkpoint (or finish if it recorded a final stop)."""
    phase = LBFGSPhase.restore(run, run.resume)
    stop = resumed_stop(run)
    if stop:
        return run.finish(phase.full_theta(), phase.value, stop, phase._value_of)
    return phase.run_until(run.params.passes)


def train_lbfgs(run: TrainRun) -> TrainResult:
    if run.resume is not None:
        return lbfgs_resume(run)
    return lbfgs_from(run, run.initial_theta())
