"""Planning a featurize run: how many output files, and which input bytes each task reads.

Pure functions over file sizes, so they are tested without Spark or data. Plain files larger
than a task's share are cut into nominal byte ranges (aligned to line starts later, on the
executors); gzip files cannot be split and go whole to one task. Pieces are assigned to tasks
by longest-processing-time-first, so tasks are balanced by bytes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from terascale.pipeline.fsutil import InputFile

GZIP_EXPANSION = 4.0  # estimated decompressed / compressed size of click logs
OUTPUT_RATIO = {"criteo": 0.65, "libsvm": 0.8}  # estimated Parquet bytes / text bytes
MIN_TASK_BYTES = 8 << 20  # below this, more tasks only add overhead
CUT_SLACK = 1.25  # a file up to this many shares long is not cut (cutting costs an extra pass)


@dataclass(frozen=True)
class Range:
    uri: str
    start: int  # nominal; the executor moves it to the next line start
    end: int
    gzip: bool
    cut_index: int  # position of this range among the ranges of its file
    cuts: int  # number of ranges of its file


def output_files(files: list[InputFile], fmt: str, partitions: int, target_mb: int, parallelism: int) -> int:
    """Number of output files: ``partitions`` if set, else about ``target_mb`` each.

    When sizing automatically, the count is raised to use every core (files no smaller than
    MIN_TASK_BYTES of input each) and rounded up to a multiple of the parallelism, so the last
    wave of tasks is not half idle.
    """
    if partitions > 0:
        return partitions
    text = sum(f.size * (GZIP_EXPANSION if f.gzip else 1.0) for f in files)
    est = text * OUTPUT_RATIO[fmt]
    n = max(1, math.ceil(est / (target_mb << 20)))
    n = max(n, min(parallelism, math.ceil(text / MIN_TASK_BYTES)))
    if n > parallelism > 1:
        n = math.ceil(n / parallelism) * parallelism
    return max(1, n)


def plan_ranges(files: list[InputFile], n_tasks: int) -> list[Range]:
    """Cut plain files into ranges of at most total/n_tasks bytes; gzip files stay whole."""
    total = sum(f.size for f in files)
    share = max(1, math.ceil(total / max(1, n_tasks)))
    out: list[Range] = []
    for f in files:
        if f.gzip or f.size <= share * CUT_SLACK:
            out.append(Range(f.uri, 0, f.size, f.gzip, 0, 1))
            continue
        k = round(f.size / share)
        bounds = [f.size * i // k for i in range(k + 1)]
        out.extend(Range(f.uri, bounds[i], bounds[i + 1], False, i, k) for i in range(k))
    return out


def assign(ranges: list[Range], n_tasks: int) -> list[list[Range]]:
    """Longest-processing-time-first assignment; each task's ranges in file order."""
    tasks: list[list[Range]] = [[] for _ in range(n_tasks)]
    heap = [(0.0, i) for i in range(n_tasks)]
    weight = lambda r: (r.end - r.start) * (GZIP_EXPANSION if r.gzip else 1.0)  # noqa: E731
    for r in sorted(ranges, key=lambda r: (-weight(r), r.uri, r.start)):
        load, i = heapq.heappop(heap)
        tasks[i].append(r)
        heapq.heappush(heap, (load + weight(r), i))
    for t in tasks:
        t.sort(key=lambda r: (r.uri, r.start))
    return tasks
