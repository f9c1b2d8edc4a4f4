"""Reading a featurized dataset: shard planning and Parquet -> CSR without Python rows.

A shard is a list of (file, row groups). ``read_shard`` reads a shard with pyarrow (any pyarrow
filesystem), one row group at a time, and turns each Arrow ``list<int32>`` chunk's offsets and
values into the CSR ``indptr`` and ``indices`` of a sink (``pipeline.shard_sink``); a null
``values`` row means all ones, and a shard with no other values keeps no values array.

Each part also carries its rows' identity: the file's name relative to the dataset root and
the index in that file of the part's first row. ``holdout_mask`` decides from it alone which
rows of a shard are held out (``solvers.holdout``), so the held-out rows are the same however
the row groups are dealt out to shards.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from terascale.pipeline import fsutil
from terascale.pipeline.manifest import MANIFEST, dataset_files, read_manifest
from terascale.pipeline.shard_sink import MemorySink
from terascale.pipeline.time_split import held_out_by_time
from terascale.pipeline.verify import (
    DataFileError,
    Footer,
    check_footers,
    iter_row_groups,
    read_row_groups,
)
from terascale.solvers.data import CSRData
from terascale.solvers.holdout import held_out

COLUMNS = ["label", "weight", "indices", "values"]
#: Rows per record batch while a shard is read (a batch's Arrow arrays and the split's
#: temporaries are what reading holds beside the CSR: about 2 MiB per 1000 non-zeros per row).
BATCH_ROWS = 1 << 16


@dataclass(frozen=True)
class ShardPart:
    path: str
    row_groups: tuple[int, ...]  # consecutive, ascending
    rows: int
    nnz_estimate: int
    name: str = ""  # the file's name relative to the dataset root (the manifest's "path")
    first_row: int = 0  # the index within the file of the first row of row_groups[0]

    def to_json(self) -> list:
        return [self.path, list(self.row_groups), self.rows, self.nnz_estimate, self.name, self.first_row]

    @classmethod
    def from_json(cls, v: list) -> ShardPart:
        name, first_row = (str(v[4]), int(v[5])) if len(v) > 4 else ("", 0)
        return cls(v[0], tuple(v[1]), int(v[2]), int(v[3]), name, first_row)


def _row_groups(footer: Footer, name: str, file_rows: int, file_nnz: int) -> list[ShardPart]:
    per_row = file_nnz / file_rows if file_rows else 0.0
    starts = np.concatenate([[0], np.cumsum(footer.rows, dtype=np.int64)])
    return [ShardPart(footer.path, (g,), n, round(n * per_row), name, int(starts[g])) for g, n in enumerate(footer.rows)]


def plan_shards(dataset_dir: str, k: int, manifest: dict | None = None) -> list[list[ShardPart]]:
    """Split the dataset's row groups into ``k`` shards balanced by non-zeros (LPT).

    A shard may come out empty when the dataset has fewer row groups than ``k``; an empty shard
    is a legal participant (it contributes nothing to the sums). Every file's footer is checked
    against the manifest first (``pipeline.verify``: raises DataFileError naming the file).
    """
    m = manifest if manifest is not None else read_manifest(dataset_dir)
    footers = check_footers(dataset_files(dataset_dir, m), m, fsutil.join(fsutil.normalize(dataset_dir), MANIFEST))
    parts: list[ShardPart] = []
    for f, footer in zip(m["files"], footers, strict=True):
        parts.extend(_row_groups(footer, f["path"], f["rows"], f["nnz"]))
    shards: list[list[ShardPart]] = [[] for _ in range(k)]
    heap = [(0, i) for i in range(k)]
    for p in sorted(parts, key=lambda p: (-p.nnz_estimate, p.path, p.row_groups)):
        load, i = heapq.heappop(heap)
        shards[i].append(p)
        heapq.heappush(heap, (load + p.nnz_estimate, i))
    for s in shards:
        s.sort(key=lambda p: (p.path, p.row_groups))
    return shards


def holdout_mask(parts: list[ShardPart], period: int, seed: int) -> np.ndarray | None:
    """Which rows of the shard ``parts`` (in :func:`read_csr`'s order) are held out, from each
    row's (file name, index in the file) and ``seed`` (``solvers.holdout``); None for period 0.
    Needs no data: a part's rows are ``first_row .. first_row + rows - 1`` of its file."""
    if period <= 0:
        return None
    masks = []
    for p in parts:
        if not p.name:
            raise ValueError(f"{p.path}: a shard part without its file's dataset-relative name")
        g = p.row_groups
        if g and g != tuple(range(g[0], g[0] + len(g))):
            raise ValueError(f"{p.path}: row groups {g} are not consecutive")
        masks.append(held_out(p.name, p.first_row, p.rows, period, seed))
    return np.concatenate(masks) if masks else np.zeros(0, dtype=bool)


def time_mask(parts: list[ShardPart], cut: int) -> np.ndarray:
    """Which rows of the shard ``parts`` are held out by time: their ``time`` >= ``cut``
    (``pipeline.time_split``); the time column only is read."""
    masks = []
    for p in parts:
        t = read_row_groups(p.path, p.row_groups, ["time"])
        if "time" not in t.column_names:
            raise DataFileError(f"{p.path}: has no time column (featurized without featurize.time_column)")
        if t.num_rows != p.rows:
            raise DataFileError(f"{p.path}: row groups {p.row_groups} hold {t.num_rows} rows, the plan {p.rows}")
        times = t.column("time").to_numpy()
        masks.append(held_out_by_time(times, cut))
    return np.concatenate(masks) if masks else np.zeros(0, dtype=bool)


def _table(part: ShardPart) -> pa.Table:
    return read_row_groups(part.path, part.row_groups, COLUMNS)  # a bad file: DataFileError


def read_csr(parts: list[ShardPart], n_features: int) -> CSRData:
    """Read the parts of one shard into one CSR matrix (:func:`read_shard` without held-out rows)."""
    return read_shard(parts, n_features)[0]


def read_shard(parts: list[ShardPart], n_features: int, holdout_period: int = 0, seed: int = 0,
               sink_factory=None, holdout_cut: int | None = None) -> tuple[CSRData, CSRData | None]:
    """(training rows, held-out rows or None) of the shard ``parts``, read in record batches of
    :data:`BATCH_ROWS` rows: each batch is split by :func:`holdout_mask` (or, with a
    ``holdout_cut``, :func:`time_mask`: the rows at or after that time) and handed to the sinks
    (``sink_factory(rows, nnz_hint)``, default :class:`~pipeline.shard_sink.MemorySink`), then
    dropped, so the shard is held once. Row order is the parts' order."""
    make = sink_factory or MemorySink
    held = time_mask(parts, holdout_cut) if holdout_cut is not None else holdout_mask(parts, holdout_period, seed)
    n = sum(p.rows for p in parts)
    nnz = sum(p.nnz_estimate for p in parts)
    n_held = 0 if held is None else int(held.sum())
    share = n_held / n if n else 0.0
    sinks = [make(n - n_held, round(nnz * (1 - share)))]
    if held is not None:
        sinks.append(make(n_held, round(nnz * share)))
    try:
        r = 0
        for p in parts:
            first = r
            for batch in iter_row_groups(p.path, p.row_groups, COLUMNS, BATCH_ROWS):
                t = pa.Table.from_batches([batch])
                mask = None if held is None else held[r : r + t.num_rows]
                _append_table(t, sinks, mask)
                r += t.num_rows
                del t, batch
            if r - first != p.rows:
                raise DataFileError(f"{p.path}: row groups {p.row_groups} hold {r - first} rows, the plan {p.rows}")
        pa.default_memory_pool().release_unused()  # or the pool keeps the freed batches' pages
        out = [s.finish(n_features) for s in sinks]
    finally:
        for s in sinks:
            s.close()
    return out[0], (out[1] if held is not None else None)


def tables_to_csr(tables: list[pa.Table], n_features: int) -> CSRData:
    """Arrow tables with the dataset columns (``weight`` and ``values`` optional) as one CSR matrix."""
    n = sum(t.num_rows for t in tables)
    nnz = 0
    for t in tables:
        for c in t.column("indices").chunks:
            nnz += int(c.offsets[-1].as_py() - c.offsets[0].as_py()) if len(c) else 0
    sink = MemorySink(n, nnz)
    for t in tables:
        _append_table(t, [sink], None)
    return sink.finish(n_features)


def _append_table(t: pa.Table, sinks: list, held: np.ndarray | None) -> None:
    """Hand the rows of ``t`` to ``sinks[0]`` (all of them, or those not ``held``) and the held
    rows to ``sinks[1]``, one Arrow chunk at a time."""
    idx_col = t.column("indices")
    val_col = t.column("values") if "values" in t.column_names else None
    labels = t.column("label").to_numpy().astype(np.float32, copy=False)
    weights = (t.column("weight").to_numpy().astype(np.float32, copy=False) if "weight" in t.column_names
               else np.ones(t.num_rows, np.float32))
    r = 0
    for ci, chunk in enumerate(idx_col.chunks):
        m = len(chunk)
        if m == 0:
            continue
        off = chunk.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        lens = np.diff(off)
        flat = chunk.values.to_numpy(zero_copy_only=False)[off[0]:off[-1]]
        vals = None
        if val_col is not None:
            vchunk = val_col.chunk(ci) if val_col.num_chunks == idx_col.num_chunks else None
            if vchunk is None:  # chunking differs between columns: fall back to a slice
                vchunk = val_col.slice(r, m).combine_chunks()
            if vchunk.null_count < m:
                vals = np.ones(flat.shape[0], np.float32)
                valid = vchunk.is_valid().to_numpy(zero_copy_only=False)
                vals[np.repeat(valid, lens)] = vchunk.flatten().to_numpy(zero_copy_only=False)
        lab, wt = labels[r : r + m], weights[r : r + m]
        if held is None:
            sinks[0].append(lens, flat, vals, lab, wt)
        else:
            h = held[r : r + m]
            for sink, rows in ((sinks[0], ~h), (sinks[1], h)):
                if rows.any():
                    keep = np.repeat(rows, lens)
                    sinks_vals = None if vals is None else vals[keep]
                    sink.append(lens[rows], flat[keep], sinks_vals, lab[rows], wt[rows])
        r += m


def read_dataset(dataset_dir: str) -> tuple[CSRData, dict]:
    """The whole dataset as one CSR matrix (small data: tests, evaluation on the driver)."""
    m = read_manifest(dataset_dir)
    parts = [p for s in plan_shards(dataset_dir, 1, m) for p in s]
    return read_csr(parts, 1 << int(m["spec"]["bits"])), m
