"""The train task's held-out rows are chosen by row identity (file relative to the dataset, index
in that file): the same (file, row) pairs for any number of workers and shard boundaries, and
wherever the dataset lives. Pyarrow only (no Spark): the task's own read-and-split path
(``jobs.train_task._read``) on shards planned by ``pipeline.dataset.plan_shards``."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.train_task import Inject, TaskSpec, _read
from terascale.pipeline.dataset import ShardPart, holdout_mask, plan_shards
from terascale.solvers.params import SolverParams

D = 1 << 16
ROW0 = 64  # feature ROW0 + r marks row r of its file; feature f (< ROW0) marks file number f
FILES = [("part-00000.parquet", 2000), ("part-00001.parquet", 1700), ("sub/part-00002.parquet", 2600)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Three files in uneven row groups of 333 rows (not a multiple of any period tested), each
    row's features naming its (file, row), as a manifest lists them."""
    root = tmp_path_factory.mktemp("hold") / "ds"
    rng = np.random.default_rng(11)
    files = []
    for f, (name, n) in enumerate(FILES):
        rows = [np.array([f, ROW0 + r], np.int32) for r in range(n)]
        t = pa.table({"label": pa.array((rng.random(n) < 0.3).astype(np.float32)),
                      "weight": pa.array(np.ones(n, np.float32)),
                      "indices": pa.array(rows, type=pa.list_(pa.int32()))})
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, root / name, row_group_size=333)
        files.append({"path": name, "rows": n, "nnz": 2 * n})
    return root, {"files": files, "rows": sum(n for _, n in FILES), "nnz": 2 * sum(n for _, n in FILES)}


def _split(root, manifest, k: int, period: int, seed: int = 0):
    """{(file, row)} held out and trained on, over the k shards the task reads and splits."""
    shards = plan_shards(str(root), k, manifest)
    spec = TaskSpec(shards=tuple(tuple(s) for s in shards), n_features=D, params=SolverParams(seed=seed),
                    holdout_period=period, checkpoint_dir="", checkpoint_interval_s=0.0, staging_dir="",
                    inject=Inject())
    held, trained = [], []
    for i in range(k):
        train_data, hold, _ = _read(spec, SimpleNamespace(shard=i))
        for data, out in ((train_data, trained), (hold, held)):
            if data is not None:
                first = data.indices[data.indptr[:-1]]  # a row's sorted features: (file, ROW0 + row)
                out.extend(zip(first.tolist(), (data.indices[data.indptr[:-1] + 1] - ROW0).tolist(), strict=True))
    assert len(set(held)) == len(held) and len(set(trained)) == len(trained)
    return shards, set(held), set(trained)


def test_the_held_out_rows_are_the_same_for_any_number_of_workers(dataset):
    root, manifest = dataset
    total = manifest["rows"]
    _, held1, trained1 = _split(root, manifest, 1, 10)
    assert len(held1) + len(trained1) == total and not held1 & trained1
    for k in (2, 3, 5):
        shards, held, trained = _split(root, manifest, k, 10)
        # not vacuous: some file's row groups are dealt out to different shards
        spread = {p.name: {i for i, s in enumerate(shards) for q in s if q.name == p.name} for s in shards for p in s}
        assert max(len(v) for v in spread.values()) > 1
        assert held == held1 and trained == trained1, k


def test_the_held_out_fraction_is_binomial_and_each_file_shares(dataset):
    root, manifest = dataset
    for period in (2, 10, 37):
        _, held, _ = _split(root, manifest, 3, period)
        n, p = manifest["rows"], 1.0 / period
        assert abs(len(held) - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1, period
        for f, (_, rows) in enumerate(FILES):
            got = sum(1 for g, _ in held if g == f)
            assert abs(got - rows * p) <= 5 * np.sqrt(rows * p * (1 - p)) + 1, (period, f)


def test_moving_the_dataset_keeps_the_split_and_the_seed_changes_it(dataset, tmp_path):
    root, manifest = dataset
    _, held, _ = _split(root, manifest, 2, 10)
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(root, moved)
    assert _split(moved, manifest, 3, 10)[1] == held
    other = _split(root, manifest, 2, 10, seed=1)[1]
    assert other != held and len(other & held) < len(held) / 3  # about 1/10 in common


def test_period_zero_and_one(dataset):
    root, manifest = dataset
    shards, held, trained = _split(root, manifest, 2, 0)
    assert not held and len(trained) == manifest["rows"]
    assert holdout_mask(shards[0], 0, 0) is None
    _, held, trained = _split(root, manifest, 2, 1)
    assert len(held) == manifest["rows"] and not trained


def test_a_part_must_name_its_file_and_hold_consecutive_row_groups():
    with pytest.raises(ValueError, match="dataset-relative name"):
        holdout_mask([ShardPart("/x/a.parquet", (0,), 10, 0)], 10, 0)
    with pytest.raises(ValueError, match="not consecutive"):
        holdout_mask([ShardPart("/x/a.parquet", (0, 2), 10, 0, "a.parquet", 0)], 10, 0)
    part = ShardPart("/x/a.parquet", (3, 4), 10, 0, "a.parquet", 999)
    assert ShardPart.from_json(part.to_json()) == part
    assert ShardPart.from_json(["/x/a.parquet", [0], 10, 0]) == ShardPart("/x/a.parquet", (0,), 10, 0)
