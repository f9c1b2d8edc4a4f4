"""Row samples of a shard for estimates that need not see every row (the coarse matrix of
:mod:`solvers.preconditioner`, the curvature of L-BFGS's first steps): every ``stride``-th run of
SAMPLE_RUN consecutive rows, counted from row 0, so a chunked pass picks the same rows as one
call. Runs rather than single rows: consecutive rows share their features' cache lines, rows far
apart would each miss on most of them."""

from __future__ import annotations

from numba import njit

#: Rows are sampled in runs of this many consecutive rows.
SAMPLE_RUN = 512


def sample_stride(n_rows: int, sample_rows: int) -> int:
    """The stride (in runs) that samples about ``sample_rows`` of ``n_rows`` rows (at least
    that many); 1, every row, when the shard is not larger or ``sample_rows`` is 0."""
    if sample_rows <= 0:
        return 1
    return max(1, n_rows // sample_rows)


@njit(cache=True, nogil=True)
def next_sampled(r, stride):
    """The first row >= r in a sampled run."""
    run = r // SAMPLE_RUN
    if run % stride == 0:
        return r
    return (run + stride - run % stride) * SAMPLE_RUN
