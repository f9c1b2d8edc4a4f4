"""The hot block's Newton system ``H s = −g``: a Cholesky factor of the dense, symmetric positive
definite ``H`` (``|H|`` x ``|H|``, float64) and its solves, where the device arrays live.

With CuPy (a real device, the ``gpu-cuda12`` / ``gpu-cuda13`` extra): ``cupy.linalg.cholesky``
(cuSOLVER) and two triangular solves (``cupyx.scipy.linalg.solve_triangular``), nothing crosses
PCIe. Without it (numba.cuda's arrays: the CUDA simulator, or a device without CuPy): the matrix
comes to the host once a factorisation and is factored by LAPACK (scipy); each solve brings the
gradient down and the step up (``8 |H|`` bytes each way, counted by ``Device``).
"""

from __future__ import annotations

import numpy as np


class Cholesky:
    """``factor(h)`` then any number of ``solve(g, out)``: out = −H⁻¹ g."""

    def __init__(self, dev, n: int) -> None:
        self.dev, self.n = dev, int(n)
        self._lower = None
        self._host = None
        if dev.cp is None:
            self.h_g = dev.pinned(self.n, np.float64)
            self.h_s = dev.pinned(self.n, np.float64)

    def factor(self, h) -> None:
        """Factor ``h`` (a device array; it may be overwritten)."""
        if not self.n:
            return
        if self.dev.cp is not None:
            cp = self.dev.cp
            lower = cp.linalg.cholesky(h)
            if not bool(cp.isfinite(lower[-1, -1])):
                raise FloatingPointError("the hot block's Hessian is not positive definite (non-finite factor)")
            self._lower = lower
            return
        import scipy.linalg as sla

        host = np.empty((self.n, self.n))
        self.dev.download(h, host)
        self._host = sla.cho_factor(host, lower=True, check_finite=True)

    def solve(self, g, out) -> None:
        """out = −H⁻¹ g (device arrays of length n)."""
        if not self.n:
            return
        if self.dev.cp is not None:
            from cupyx.scipy.linalg import solve_triangular

            y = solve_triangular(self._lower, g, lower=True)
            out[...] = -solve_triangular(self._lower, y, lower=True, trans="T")
            return
        import scipy.linalg as sla

        self.dev.download(g, self.h_g)
        np.negative(sla.cho_solve(self._host, self.h_g), out=self.h_s)
        self.dev.upload(out, self.h_s)
