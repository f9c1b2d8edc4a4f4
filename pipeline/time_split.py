"""The held-out split on time: the latest rows are held out (``train.holdout_latest``).

A table featurized with ``featurize.time_column`` keeps each row's time in the dataset's
``time`` column (int64): a timestamp as microseconds since the Unix epoch (UTC), a date as days
since the epoch, an integer column as it is (an hour number, a Unix time). The manifest's
``time`` entry records the column, that unit and :data:`POINTS` + 1 quantiles of the rows' times
(``q = 0, 1/POINTS, ..., 1``), merged on the driver from each task's order statistics, so the
driver finds the cut without reading a row.

Holding out a fraction ``f`` of the latest rows: the cut is the ``1 - f`` quantile, rounded up to
the next quantile point (:func:`cut_for_latest`); a row is held out when its time >= the cut
(:func:`held_out_by_time`): exactly the rows at or after the cut, whatever the number of workers
or where a row's shard lives. The held-out share is ``f`` to within ``1 / POINTS`` (and the
tasks' order statistics' spacing), more where many rows share the cut's time: ties stay
together, every row at the cut's time is held out. No pyspark here.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from terascale.pipeline.arrow_arrays import filled, valid_mask

#: quantile points of the manifest's time entry (POINTS + 1 values)
POINTS = 256
#: order statistics each task reports of its rows' times
TASK_POINTS = 1025
UNITS = ("us", "days", "value")


def unit_of(t: pa.DataType) -> str | None:
    """The unit a column of type ``t`` is kept in; None when it cannot be a time column."""
    if pa.types.is_dictionary(t):
        return unit_of(t.value_type)
    if pa.types.is_timestamp(t):
        return "us"
    if pa.types.is_date(t):
        return "days"
    if pa.types.is_integer(t):
        return "value"
    return None


def time_values(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(int64 times in the column's unit, validity) of a time column's batch."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_timestamp(t):
        arr = pc.cast(arr, pa.timestamp("us", tz=t.tz), safe=False).cast(pa.int64())
    elif pa.types.is_date(t):
        arr = pc.cast(arr, pa.date32()).cast(pa.int32()).cast(pa.int64())
    elif pa.types.is_integer(t):
        arr = pc.cast(arr, pa.int64())  # a uint64 past 2^63 raises: no silent wrap
    else:
        raise TypeError(f"a time column must be a timestamp, a date or an integer, not {t}")
    return filled(arr, 0).astype(np.int64, copy=False), valid_mask(arr)


def task_points(times: np.ndarray, k: int = TASK_POINTS) -> tuple[list[int], int]:
    """``k`` evenly spaced order statistics (ranks 0 .. n-1) of one task's times, and n."""
    pts, n = order_statistics(times, k)
    return [int(v) for v in pts], n


def order_statistics(x: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """``k`` evenly spaced order statistics of ``x`` (all of them when fewer) and its length: a
    summary :func:`weighted_quantiles` merges with others."""
    n = int(x.shape[0])
    if n == 0:
        return x[:0], 0
    x = np.sort(x)
    return x[np.round(np.linspace(0, n - 1, min(k, n))).astype(np.int64)], n


def weighted_quantiles(summaries, fractions: np.ndarray, dtype=np.int64) -> np.ndarray | None:
    """The values at ``fractions`` (in [0, 1]) of the union of several summaries' rows, each
    summary's points standing for its n / len(points) rows; None when there are none."""
    pts = [(np.asarray(p, dtype), n / len(p)) for p, n in summaries if n]
    if not pts:
        return None
    vals = np.concatenate([p for p, _ in pts])
    wts = np.concatenate([np.full(p.shape[0], w) for p, w in pts])
    order = np.argsort(vals, kind="mergesort")
    vals, cum = vals[order], np.cumsum(wts[order])
    at = np.minimum(np.searchsorted(cum, np.asarray(fractions) * cum[-1], side="left"), vals.shape[0] - 1)
    return vals[at]


def merge_points(summaries: list[tuple[list[int], int]], points: int = POINTS) -> list[int]:
    """The ``points + 1`` quantiles (q = i / points) of the union of the tasks' rows, from their
    order statistics, the extremes exact."""
    out = weighted_quantiles(summaries, np.arange(points + 1) / points)
    if out is None:
        return []
    out[0] = min(min(p) for p, n in summaries if n)
    out[-1] = max(max(p) for p, n in summaries if n)
    return [int(v) for v in out]


def merge_summaries(summaries: list[tuple[list[int], int]], k: int = TASK_POINTS) -> tuple[list[int], int]:
    """One summary of ``k`` points (quantiles at i / (k - 1)) and the count for several (a task's
    batches': a task keeps a few thousand numbers whatever its rows)."""
    n = sum(c for _, c in summaries)
    if n == 0:
        return [], 0
    if len(summaries) == 1:
        return list(summaries[0][0]), n
    return merge_points(summaries, k - 1), n


def cut_for_latest(quantiles: list[int], fraction: float) -> int:
    """The time at and after which rows are held out, for a held-out ``fraction`` in (0, 1):
    the quantile point at or just above ``1 - fraction``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-out fraction must be in (0, 1), not {fraction}")
    if not quantiles:
        raise ValueError("the dataset's time entry has no quantiles (no rows)")
    points = len(quantiles) - 1
    return int(quantiles[min(math.ceil((1.0 - fraction) * points - 1e-9), points)])


def held_out_by_time(times: np.ndarray, cut: int) -> np.ndarray:
    """Whether each row is held out: its time >= ``cut``."""
    return np.asarray(times, np.int64) >= np.int64(cut)
