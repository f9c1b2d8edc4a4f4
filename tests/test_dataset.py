"""Parquet -> CSR reading and shard planning on a real featurized dataset."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.pipeline.dataset import plan_shards, read_csr, read_dataset
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.manifest import read_manifest
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec
from terascale.pipeline.verify import DataFileError

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def dataset(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    generate_clicklogs(d / "raw", 6000, files=3, seed=9, processes=1)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=6, seed=1)  # 64 buckets: many collisions -> values
    fconf = load_config([], ["featurize.partitions=3"]).featurize
    run_featurize(spark, [str(d / "raw")], str(d / "ds"), spec, fconf)
    return str(d / "ds")


def _rows_from_parquet(ds):
    m = read_manifest(ds)
    out = []
    for f in m["files"]:
        t = pq.read_table(os.path.join(ds, f["path"]))
        for lab, idx, val in zip(t["label"].to_pylist(), t["indices"].to_pylist(), t["values"].to_pylist(), strict=True):
            out.append((lab, idx, val if val is not None else [1.0] * len(idx)))
    return out


def test_read_dataset_equals_the_parquet_rows(dataset):
    csr, m = read_dataset(dataset)
    rows = _rows_from_parquet(dataset)
    assert csr.n_rows == m["rows"] == len(rows) and csr.nnz == m["nnz"] and csr.n_features == 64
    assert any(v != [1.0] * len(v) for _, _, v in rows)  # the collision values are exercised
    values = csr.full_values()
    for i, (lab, idx, val) in enumerate(rows):
        a, b = csr.indptr[i], csr.indptr[i + 1]
        assert csr.labels[i] == lab and csr.indices[a:b].tolist() == idx and values[a:b].tolist() == val
    assert np.all(csr.weights == 1.0)


def test_shards_cover_every_row_group_once_and_read_back(dataset):
    m = read_manifest(dataset)
    for k in (1, 2, 3, 5):
        shards = plan_shards(dataset, k, m)
        assert len(shards) == k
        parts = sorted((p.path, p.row_groups) for s in shards for p in s)
        assert len(parts) == len(set(parts))
        total = sum(read_csr(s, 64).n_rows for s in shards)
        assert total == m["rows"]
    empty = plan_shards(dataset, 5, m)[-1]
    assert read_csr(empty, 64).n_rows == 0  # 3 files, 5 shards: empty shards are legal


def test_multi_row_group_files_and_chunked_columns(tmp_path, dataset):
    import pyarrow as pa

    m = read_manifest(dataset)
    src = os.path.join(dataset, m["files"][0]["path"])
    t = pq.read_table(src)
    out = tmp_path / "rg.parquet"
    pq.write_table(t, out, row_group_size=333)  # many small row groups
    from terascale.pipeline.dataset import ShardPart

    n_rg = pq.ParquetFile(out).metadata.num_row_groups
    assert n_rg > 3
    csr = read_csr([ShardPart(str(out), tuple(range(n_rg)), t.num_rows, 0)], 64)
    ref = read_csr([ShardPart(src, (0,), t.num_rows, 0)], 64)
    for a in ("indptr", "indices", "values", "labels"):
        assert np.array_equal(getattr(csr, a), getattr(ref, a)), a
    assert isinstance(t, pa.Table)


def test_read_shard_splits_held_out_rows_as_it_reads(dataset, monkeypatch):
    """read_shard (batches, split while reading) = read_csr then split_held_out, bit for bit,
    whatever the batch size; binary rows store no values, collisions only their exceptions."""
    import terascale.pipeline.dataset as D

    shard = plan_shards(dataset, 2)[0]
    whole = read_csr(shard, 64)
    want_train, want_held = whole.split_held_out(D.holdout_mask(shard, 7, 3))
    assert 0 < whole.vpos.size < whole.nnz // 3 and whole.values.size == whole.vpos.size  # 64 buckets: many
    for batch_rows in (1 << 16, 97):
        monkeypatch.setattr(D, "BATCH_ROWS", batch_rows)
        train, held = D.read_shard(shard, 64, 7, 3)
        for got, want in ((train, want_train), (held, want_held)):
            for a in ("indptr", "indices", "labels", "weights", "vpos", "values"):
                assert getattr(got, a).tobytes() == getattr(want, a).tobytes(), a
    monkeypatch.setattr(D, "BATCH_ROWS", 1 << 16)
    bad = [dataclasses.replace(shard[0], rows=shard[0].rows + 1)] + shard[1:]
    with pytest.raises(DataFileError, match="the plan"):
        D.read_shard(bad, 64)
