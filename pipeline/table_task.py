"""One featurize task of a table (``featurize.format = table``): batches of records in, one
Parquet file of hashed rows and its quarantine out, into a directory private to the attempt
(as ``pipeline.featurize_task`` does for text logs; the same output schema, counts and commit).

The batches come from the task's own pyarrow reads (``pipeline.table_sources``) or, for Spark
SQL expressions and catalog tables, from Spark (``mapInArrow``); either way each batch carries
its source (a file, or a table partition) and the 1-based number of its first record there,
which key the negative-downsampling decisions and name a quarantined record. No pyspark here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from terascale.pipeline import sampling, time_split
from terascale.pipeline.featurize_task import PHASES, TaskOptions, TaskOutput
from terascale.pipeline.rowkernels import BAD_TIME, REASONS
from terascale.pipeline.spec import FeatureSpec
from terascale.pipeline.table_kernel import LABEL, WEIGHT, featurize_batch
from terascale.pipeline.table_sources import BadRecord

TIME = "__time"  # the time column's name in a batch Spark projected


@dataclass(frozen=True)
class Columns:
    """Which batch column feeds the label, the weight and each field (a field's name in the
    batch may differ from the input column it reads: ``column:``)."""

    label: str
    weight: str  # '' = no weight
    fields: tuple[tuple[str, str], ...]  # (field name, batch column)
    time: str = ""  # the rows' time column (featurize.time_column); '' = none

    @classmethod
    def of(cls, spec: FeatureSpec, exprs: bool = False, time_column: str = "") -> Columns:
        """The input columns of a spec read straight from files; with ``exprs`` (Spark projected
        the batch), the columns Spark named after the label, weight, fields and time."""
        t = spec.table
        if exprs:
            return cls(LABEL, WEIGHT if (t.weight or t.weight_expr) else "", tuple((f.name, f.name) for f in t.fields),
                       TIME if time_column else "")
        return cls(t.label, t.weight, tuple((f.name, f.source) for f in t.fields), time_column)

    @property
    def read(self) -> tuple[str, ...]:
        """The distinct input columns, in first-use order."""
        names = ([self.label] + ([self.weight] if self.weight else []) + [c for _, c in self.fields]
                 + ([self.time] if self.time else []))
        return tuple(dict.fromkeys(names))

    def batch(self, b: pa.RecordBatch) -> pa.RecordBatch:
        """The kernel's view of a batch: ``__label``, ``__weight`` and one column per field."""
        arrays = [b.column(self.label)] + ([b.column(self.weight)] if self.weight else [])
        names = [LABEL] + ([WEIGHT] if self.weight else [])
        for name, col in self.fields:
            arrays.append(b.column(col))
            names.append(name)
        return pa.RecordBatch.from_arrays(arrays, names=names)


def _raw(b: pa.RecordBatch, rows: np.ndarray) -> list[bytes]:
    """The records as JSON text (a quarantined record's ``raw``)."""
    recs = b.take(pa.array(rows)).to_pylist()
    return [json.dumps(r, default=str, ensure_ascii=False).encode("utf-8") for r in recs]


def run_table_task(task_index: int, batches: Iterable[tuple[str, int, pa.RecordBatch | BadRecord]],
                   spec: FeatureSpec, cols: Columns, opts: TaskOptions, attempt_dir: str,
                   expected_sources: Iterable[str] = (), key_salt: str = "") -> dict:
    """Featurize ``batches`` ((source, first record number, batch or bad record)) into
    ``attempt_dir``; return the task's counts and paths (the keys of ``featurize_task.run_task``).
    A record's downsampling decision hashes (source + ``key_salt``, record number): Spark-read
    partitions number their records from 1 each and salt with the partition."""
    t0 = time.perf_counter()
    clock = time.process_time
    c0 = clock()
    phases = dict.fromkeys(PHASES, 0.0)
    out = TaskOutput(attempt_dir, spec.bits, opts, phases, timed=bool(cols.time))
    for src in expected_sources:  # a piece with no records still counts its file
        out.stats(src)
    phases["setup"] = clock() - c0
    units: set[str] = set()  # of the time column's batches
    try:
        it = iter(batches)
        while True:
            c = clock()
            item = next(it, None)
            phases["read"] += clock() - c
            if item is None:
                break
            src, first_row, b = item
            stats = out.stats(src)
            if isinstance(b, BadRecord):
                stats["lines"] += 1
                out.bad(src, b.row, 0, b.reason, len(b.raw), b.raw, stats)
                continue
            c = clock()
            try:
                rows = featurize_batch(spec.table, spec.bits, spec.seed, cols.batch(b), out.group_map)
            except Exception as e:  # noqa: BLE001 - the error, named by its input
                raise RuntimeError(f"{src}, records {first_row}..{first_row + b.num_rows - 1}: {e}") from e
            c1 = clock()
            phases["parse"] += c1 - c
            stats["lines"] += b.num_rows
            if rows.status.any():
                where = np.flatnonzero(rows.status)
                for k, raw in zip(where.tolist(), _raw(b, where), strict=True):
                    out.bad(src, first_row + k, 0, REASONS[int(rows.status[k])], len(raw), raw, stats)
            labels, weights, indptr, indices, values, multi = (rows.labels, rows.weights, rows.indptr, rows.indices,
                                                              rows.values, rows.multi)
            good = np.flatnonzero(rows.status == 0)  # the records of the kernel's rows
            times = None
            if cols.time:
                units.add(time_split.unit_of(b.column(cols.time).type))
                tv, valid = time_split.time_values(b.column(cols.time))
                times, ok = tv[good], valid[good]
                if not ok.all():  # a row without a time cannot be placed in a split by time
                    lost = good[~ok]
                    for k, raw in zip(lost.tolist(), _raw(b, lost), strict=True):
                        out.bad(src, first_row + k, 0, REASONS[BAD_TIME], len(raw), raw, stats)
                    indptr, indices, values = sampling.take_rows(indptr, indices, values, ok)
                    labels, weights, multi, times, good = labels[ok], weights[ok], multi[ok], times[ok], good[ok]
            if opts.negative_rate < 1.0 and labels.shape[0]:
                row_numbers = first_row + good
                key = sampling.file_key(src + key_salt, opts.sample_seed)
                keep = sampling.keep_mask(key, opts.sample_seed, row_numbers, labels, opts.negative_rate)
                stats["dropped"] += int(keep.shape[0] - keep.sum())
                indptr, indices, values = sampling.take_rows(indptr, indices, values, keep)
                labels, weights, multi = labels[keep], weights[keep], multi[keep]
                times = None if times is None else times[keep]
            weights = (weights * sampling.row_weights(labels, opts.negative_rate)).astype(np.float32, copy=False)
            phases["rows"] += clock() - c1
            out.make_room(labels.shape[0])  # (a write: its own phase)
            c = clock()
            out.add(stats, labels, indptr, indices, values, multi, weights, times, owned=True)  # the kernel's own arrays
            phases["rows"] += clock() - c
            out.flush(full_only=True)
            out.fail_if_drilled(task_index)
        out.flush()
    finally:
        out.close()
    return {**out.finish(task_index, t0, c0, clock()), "time_units": sorted(units)}
