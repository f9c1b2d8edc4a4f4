"""The scale benchmark's disk: what a run will need, checked against ``df`` before it starts.

Bytes per row, measured on generated click logs at the default feature spec (bits 24, no
conjunctions; 20,000 rows, commit 4f3a47e), rounded up:

=================  =======  ==========================================================
what               B/row    when
=================  =======  ==========================================================
raw gzip'd logs    110      generate (level 1), the training and the test rows
featurized         105      featurize (Parquet, snappy), training and test rows
shard cache        155      train with ``train.data_cache`` = disk (the CSR, 4 B per
                            non-zero): counted always, as ``auto`` picks it at scale
true probability   4        the test set's ``.prob.npy`` sidecars
predictions        12       predict, test rows
score input        250      the raw lines ``terascale score`` reads, uncompressed
scores             20       its output, one line per score
=================  =======  ==========================================================

plus :data:`FIXED_BYTES` for the model, its checkpoints, the ``_groups.npy`` of each dataset
and Spark's temporary files. All of it lives at once at the run's peak (train holds the raw logs,
both datasets and the shard cache). The shard cache goes to ``spark.local.dir`` (``/tmp`` in
local mode): the estimate assumes it is on the work folder's volume, as on this machine.
"""

from __future__ import annotations

import os

PER_TRAIN_ROW = 110 + 105 + 155
PER_TEST_ROW = 110 + 105 + 4 + 12
PER_SCORE_LINE = 250 + 20
FIXED_BYTES = 3 << 30


class DiskRefused(RuntimeError):
    """The run would not fit on the disk."""


def estimate(rows: int, test_rows: int, score_lines: int) -> int:
    """Bytes the run needs at its peak (the table above)."""
    return rows * PER_TRAIN_ROW + test_rows * PER_TEST_ROW + score_lines * PER_SCORE_LINE + FIXED_BYTES


def free_and_total(path: str) -> tuple[int, int]:
    """(bytes available to an unprivileged user, the volume's size) of the volume of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check(path: str, rows: int, test_rows: int, score_lines: int) -> dict:
    """The estimate against the free space of ``path``'s volume; DiskRefused, naming both and
    what to change, when it does not fit. The figures otherwise, and whether the run would take
    the volume below 10% free (the issue's floor), which is allowed but reported."""
    need = estimate(rows, test_rows, score_lines)
    free, total = free_and_total(path)
    if need > free:
        raise DiskRefused(
            f"the scale benchmark at {rows:,} rows (+ {test_rows:,} test rows) needs about {need / 1e9:.1f} GB "
            f"of disk at its peak ({PER_TRAIN_ROW} B per training row: raw gzip + Parquet + shard cache; "
            f"tests/benchmarks/scale_disk.py), but {path} has {free / 1e9:.1f} GB free: free some space, "
            f"pass --workdir on a larger volume, or fewer --rows")
    return {"estimate_bytes": need, "free_at_start_bytes": free, "volume_bytes": total,
            "below_10_percent_expected": free - need < 0.1 * total}
