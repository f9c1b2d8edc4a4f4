"""Invariant 10, the driver's side: its memory does not grow with the rows (issue 32, "Tests").

The whole pipeline runs through the CLI in this process (the driver) on N and on 2N rows of
generated logs (the doubled set in twice the files, as a day's logs grow), and every stage's
peak of the driver's Python allocations is measured: tracemalloc (every Python object, numpy's
buffers included) plus the rise of pyarrow's default pool's high-water mark (Arrow buffers),
after a tiny run that pays the imports and first-use caches. A driver that collected one float64
per row would add 8 B × N = 400 KB between the two; one that collected Row objects, megabytes.
The margin allowed, 256 KiB, is what per-file records (the manifest, the shard plan, the file
listing: 10 more files) and the collected results' framing may add (a stage's peak moved by up
to 113 KB between two sizes here). Both measures are deterministic: what a stage allocates on the
driver depends on the data, not on timing.
"""

from __future__ import annotations

import tracemalloc

import pyarrow as pa
import pytest

from terascale.jobs.cli import main
from terascale.pipeline.generate import generate_clicklogs

pytestmark = [pytest.mark.spark, pytest.mark.slow]

N = 50_000
MARGIN = 256 * 1024
SETS = ["spark.master=local[2]", "featurize.bits=18", "train.passes=3", "train.l2=auto"]


def _stage_peaks(root, rows: int, files: int) -> dict[str, int]:
    raw = root / "raw"
    generate_clicklogs(raw, rows, files=files, seed=7)
    sets = [a for s in SETS for a in ("--set", s)]
    stages = {
        "featurize": ["featurize", "--input", str(raw), "--output", str(root / "data")],
        "train": ["train", "--input", str(root / "data"), "--model", str(root / "model")],
        "evaluate": ["evaluate", "--input", str(root / "data"), "--model", str(root / "model")],
        "predict": ["predict", "--input", str(root / "data"), "--model", str(root / "model"),
                    "--output", str(root / "pred")],
    }
    pool = pa.default_memory_pool()
    peaks = {}
    for name, argv in stages.items():
        tracemalloc.start()
        try:
            arrow0 = pool.max_memory() or 0
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            assert main([*argv, *sets]) == 0, name
            _, peak = tracemalloc.get_traced_memory()
            peaks[name] = peak - before + max((pool.max_memory() or 0) - arrow0, 0)
        finally:
            tracemalloc.stop()
    return peaks


def test_the_drivers_memory_does_not_grow_with_the_rows(spark, tmp_path):
    _stage_peaks(tmp_path / "warm", 2_000, 2)  # imports, compiled kernels, first-use caches
    small = _stage_peaks(tmp_path / "n", N, 10)
    large = _stage_peaks(tmp_path / "2n", 2 * N, 20)
    for name in small:
        assert large[name] <= small[name] + MARGIN, (name, small[name], large[name])
