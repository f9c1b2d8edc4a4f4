"""Stochastic coordinate descent solvers with CoCoA aggregation (CPU, numba).

Problems (mean form, lambda = ``l2`` > 0, c_i importance weights, N = sum_i c_i)::

    P(beta) = (1/N) sum_i c_i phi(y_i, x_i . beta) + (lambda/2) ||beta||^2

* ridge regression (``loss="squared"``): dual SCD by example, or primal SCD by feature;
* logistic regression and the hinge- and squared-hinge-loss SVMs: dual SCD (SDCA), closed-form
  steps for squared, hinge and squared hinge, bracketed Newton for logistic.

Pieces, bottom up: ``losses`` (scalar formulas), ``dual_kernels`` / ``primal_kernels`` (numba
epochs, sequential and Snap-ML-style threaded), ``local_solver`` (H epochs on a CoCoA
subproblem), ``line_search`` (gamma: avg / add / adaptive), ``partition`` (columns over all rows
for the primal), ``dual_problem`` / ``primal_problem`` (one rank's side of a round),
``rounds`` (the loop: one allreduce per round, history, checkpoints), ``api``
(:func:`train_cocoa`). On a GPU (optional): ``gpu_kernels`` / ``gpu_reduce_kernels`` /
``gpu_shuffle`` (numba.cuda), ``gpu_device`` (detection, counted transfers), ``gpu_local_solver``
(TPA-SCD local solvers), ``gpu_problem`` (device-resident local variables), ``gpu``
(``train_cocoa_gpu``).
"""

from terascale.solvers.scd.api import train_cocoa
from terascale.solvers.scd.params import CocoaParams, CocoaResult, CocoaState

__all__ = ["CocoaParams", "CocoaResult", "CocoaState", "train_cocoa"]
