"""Errors the solvers raise. Every message names what was wrong and where (rank, pass, row).

Collective agreement: a problem found on one rank is shared through the next collective, so
every rank raises (the rank that saw it with the details, the others naming that rank) and no
rank is left waiting in a collective.
"""

from __future__ import annotations


class SolverError(RuntimeError):
    """Base class of the solvers' errors."""


class InvalidInputError(SolverError, ValueError):
    """Training or held-out data violate the data contract (shapes, indices, label domain)."""


class NonFiniteInputError(InvalidInputError):
    """A value, label or importance weight is NaN or infinite."""


class DivergenceError(SolverError, FloatingPointError):
    """Training produced a non-finite margin, loss, gradient or weight; no model is returned."""
