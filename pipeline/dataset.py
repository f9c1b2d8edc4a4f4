"""Reading a featurized dataset: shard planning and Parquet -> CSR without Python rows.

A shard is a list of (file, row groups). ``read_csr`` reads a shard with pyarrow (any pyarrow
filesystem) and turns each Arrow ``list<int32>`` chunk's offsets and values into the CSR
``indptr`` and ``indices`` directly; a null ``values`` row means all ones.

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
from terascale.pipeline.verify import Footer, check_footers, read_row_groups
from terascale.solvers.data import CSRData
from terascale.solvers.holdout import held_out

COLUMNS = ["label", "weight", "indices", "values"]


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


def _table(part: ShardPart) -> pa.Table:
    return read_row_groups(part.path, part.row_groups, COLUMNS)  # a bad file: DataFileError


def read_csr(parts: list[ShardPart], n_features: int) -> CSRData:
    """Read the parts of one shard into one CSR matrix (one copy: the concatenation)."""
    return tables_to_csr([_table(p) for p in parts], n_features)


def tables_to_csr(tables: list[pa.Table], n_features: int) -> CSRData:
    """Arrow tables with the dataset columns (``weight`` and ``values`` optional) as one CSR matrix."""
    n = sum(t.num_rows for t in tables)
    nnz = 0
    for t in tables:
        for c in t.column("indices").chunks:
            nnz += int(c.offsets[-1].as_py() - c.offsets[0].as_py()) if len(c) else 0
    indptr = np.zeros(n + 1, np.int64)
    indices = np.empty(nnz, np.int32)
    values = np.ones(nnz, np.float32)
    labels = np.empty(n, np.float32)
    weights = np.empty(n, np.float32)
    r = 0
    z = 0
    for t in tables:
        idx_col = t.column("indices")
        val_col = t.column("values") if "values" in t.column_names else None
        lab = t.column("label").to_numpy()
        wt = t.column("weight").to_numpy() if "weight" in t.column_names else np.ones(t.num_rows, np.float32)
        labels[r:r + t.num_rows] = lab
        weights[r:r + t.num_rows] = wt
        for ci, chunk in enumerate(idx_col.chunks):
            m = len(chunk)
            if m == 0:
                continue
            off = chunk.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
            lens = np.diff(off)
            span = int(off[-1] - off[0])
            flat = chunk.values.to_numpy(zero_copy_only=False)[off[0]:off[-1]]
            indices[z:z + span] = flat
            indptr[r + 1:r + m + 1] = z + (off[1:] - off[0])
            if val_col is not None:
                vchunk = val_col.chunk(ci) if val_col.num_chunks == idx_col.num_chunks else None
                if vchunk is None:  # chunking differs between columns: fall back to a slice
                    vchunk = val_col.slice(sum(len(c) for c in idx_col.chunks[:ci]), m).combine_chunks()
                if vchunk.null_count < m:
                    valid = vchunk.is_valid().to_numpy(zero_copy_only=False)
                    mask = np.repeat(valid, lens)
                    values[z:z + span][mask] = vchunk.flatten().to_numpy(zero_copy_only=False)
            r += m
            z += span
    return CSRData(indptr, indices, values, labels, weights, n_features)


def read_dataset(dataset_dir: str) -> tuple[CSRData, dict]:
    """The whole dataset as one CSR matrix (small data: tests, evaluation on the driver)."""
    m = read_manifest(dataset_dir)
    parts = [p for s in plan_shards(dataset_dir, 1, m) for p in s]
    return read_csr(parts, 1 << int(m["spec"]["bits"])), m
