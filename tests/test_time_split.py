"""The held-out split on time (pipeline/time_split.py, featurize.time_column, train.holdout_latest):
a table's time column is kept with each row, its quantiles go into the manifest, and training
holds out exactly the rows at or after the cut, for any number of workers; a row without a time
is quarantined (bad_time)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import ConfigError, feature_spec, load_config
from terascale.pipeline import time_split as T
from terascale.pipeline.manifest import read_manifest

BASE = ["featurize.format=table", "featurize.bits=14", "featurize.label=clicked", "featurize.partitions=3",
        "featurize.columns=[site, {name: price, kind: numeric, bucketing: log}]"]
T0 = 1_764_000_000_000_000  # 2025-11-24 in microseconds


def test_time_values_by_type():
    ts = pa.array([T0 * 1000, None, (T0 + 5) * 1000], pa.timestamp("ns", tz="UTC"))
    v, ok = T.time_values(ts)
    assert v.tolist()[0::2] == [T0, T0 + 5] and ok.tolist() == [True, False, True]
    v, ok = T.time_values(pa.array([0, 20_000], pa.date32()))
    assert v.tolist() == [0, 20_000] and ok.all()
    v, _ = T.time_values(pa.array([7, 3], pa.int16()).dictionary_encode())
    assert v.tolist() == [7, 3]
    assert [T.unit_of(t) for t in (pa.timestamp("ms"), pa.date64(), pa.int32(), pa.float64(), pa.string())] == [
        "us", "days", "value", None, None]
    with pytest.raises(pa.ArrowInvalid):
        T.time_values(pa.array([2**63 + 1], pa.uint64()))  # no silent wrap
    with pytest.raises(TypeError, match="timestamp, a date or an integer"):
        T.time_values(pa.array([1.5]))


@pytest.mark.parametrize("tasks", [1, 3, 7])
def test_merged_quantiles_and_the_cut_hold_out_the_latest_fraction(tasks):
    rng = np.random.default_rng(tasks)
    times = rng.integers(0, 10**9, 60_000)
    parts = np.array_split(rng.permutation(times), tasks)
    q = T.merge_points([T.task_points(p) for p in parts])
    assert len(q) == T.POINTS + 1 and q[0] == times.min() and q[-1] == times.max() and q == sorted(q)
    exact = np.quantile(times, np.arange(T.POINTS + 1) / T.POINTS, method="inverted_cdf")
    ranks = np.searchsorted(np.sort(times), q) / times.shape[0]
    assert np.max(np.abs(ranks - np.arange(T.POINTS + 1) / T.POINTS)) < 2e-3, (q[:5], exact[:5])
    for f in (0.05, 0.1, 0.3):
        cut = T.cut_for_latest(q, f)
        share = T.held_out_by_time(times, cut).mean()
        assert f - 1 / T.POINTS - 2e-3 <= share <= f + 2e-3, (f, share)


def test_ties_stay_together_and_bad_fractions_are_refused():
    times = np.repeat(np.arange(10), 100)  # 10 distinct times
    q = T.merge_points([T.task_points(times)])
    cut = T.cut_for_latest(q, 0.15)
    assert cut == 9 or cut == 8
    held = T.held_out_by_time(times, cut)
    assert set(times[held]) == set(range(cut, 10)) and not set(times[~held]) & set(range(cut, 10))
    for f in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            T.cut_for_latest(q, f)


def _table(n: int, seed: int, null_ts: float = 0.0) -> pa.Table:
    rng = np.random.default_rng(seed)
    ts = T0 + rng.integers(0, 7 * 86_400_000_000, n)
    return pa.table({
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC"), mask=rng.random(n) < null_ts),
        "site": pa.array([f"s{x}" for x in rng.integers(0, 50, n)]),
        "price": pa.array(rng.lognormal(0, 1, n)),
        "clicked": pa.array(rng.random(n) < 1 / (1 + np.exp(-(ts - T0) / 2e11 + 1.0))),
    })


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("timed")
    (d / "in").mkdir()
    parts = [_table(4000, 1, null_ts=0.01), _table(3000, 2, null_ts=0.01)]
    for i, t in enumerate(parts):
        pq.write_table(t, d / "in" / f"part-{i}.parquet", row_group_size=1000)
    return d, parts


def _featurize(spark, d, out, *sets, where=""):
    from terascale.pipeline.spark_table import run_table_featurize

    cfg = load_config([], [*BASE, "featurize.time_column=ts", *sets])
    return run_table_featurize(spark, [str(d / "in")], str(out), feature_spec(cfg), cfg.featurize, where=where)


def _written_times(ds) -> np.ndarray:
    m = read_manifest(str(ds))
    return np.concatenate([pq.read_table(ds / f["path"], columns=["time"]).column("time").to_numpy()
                           for f in m["files"]])


@pytest.mark.spark
@pytest.mark.parametrize("through_spark", [False, True])
def test_featurize_keeps_each_rows_time_and_quarantines_rows_without_one(spark, logs, tmp_path, through_spark):
    d, parts = logs
    m = _featurize(spark, d, tmp_path / "ds", where="price > 0" if through_spark else "")
    src = pa.concat_tables(parts)
    ts = src.column("ts").cast(pa.int64()).to_numpy(zero_copy_only=False)
    nulls = int(src.column("ts").null_count)
    assert m["quarantine"]["by_reason"] == {"bad_time": nulls}
    assert m["lines"] == src.num_rows == m["rows"] + nulls  # rows in = written + quarantined
    got = _written_times(tmp_path / "ds")
    assert sorted(got.tolist()) == sorted(ts[src.column("ts").is_valid().to_numpy(zero_copy_only=False)].tolist())
    e = m["time"]
    assert (e["column"], e["unit"], e["rows"]) == ("ts", "us", m["rows"])
    assert e["quantiles"][0] == got.min() and e["quantiles"][-1] == got.max() and len(e["quantiles"]) == T.POINTS + 1
    q = pq.read_table(tmp_path / "ds" / "_quarantine").to_pylist()
    name = b'"__time": null' if through_spark else b'"ts": null'  # Spark's projection names the column __time
    assert {r["reason"] for r in q} == {"bad_time"} and all(name in r["raw"] for r in q)


@pytest.mark.spark
def test_time_column_types_are_checked_before_spark(spark, logs, tmp_path):
    from terascale.pipeline.table_schema import SchemaError

    d, _ = logs
    with pytest.raises(SchemaError, match=r"featurize.time_column: column 'price' .* is double, which must be a "
                                          r"timestamp, a date or an integer"):
        _featurize(spark, d, tmp_path / "ds", "featurize.time_column=price")
    with pytest.raises(ConfigError, match="featurize.time_column: only for featurize.format = 'table'"):
        load_config([], ["featurize.time_column=ts"])


@pytest.mark.spark
def test_training_holds_out_exactly_the_rows_at_or_after_the_cut_for_any_workers(spark, logs, tmp_path):
    from terascale.jobs.train_job import run_train

    d, _ = logs
    ds = tmp_path / "ds"
    m = _featurize(spark, d, ds)
    times = _written_times(ds)
    want_cut = T.cut_for_latest(m["time"]["quantiles"], 0.2)
    held = int((times >= want_cut).sum())
    assert 0.18 * m["rows"] <= held <= 0.21 * m["rows"]
    metas = []
    for k in (1, 2):
        cfg = load_config([], [f"train.workers={k}", "train.holdout_latest=0.2", "train.passes=3", "train.l2=1e-4",
                               "spark.master=local[2]"])
        metas.append(run_train(spark, cfg, str(ds), str(tmp_path / f"m{k}")))
    for meta in metas:
        assert meta["holdout"] == {"by": "time", "column": "ts", "unit": "us", "fraction": 0.2, "cut": want_cut}
        assert sum(r["holdout_rows"] for r in meta["per_rank"]) == held
        assert sum(r["rows"] for r in meta["per_rank"]) == m["rows"] - held


@pytest.mark.spark
def test_holdout_latest_needs_a_dataset_with_a_time_column(spark, logs, tmp_path):
    from terascale.jobs.train_job import run_train
    from terascale.pipeline.spark_table import run_table_featurize

    d, _ = logs
    cfg = load_config([], BASE)
    run_table_featurize(spark, [str(d / "in")], str(tmp_path / "ds"), feature_spec(cfg), cfg.featurize)
    assert "time" not in read_manifest(str(tmp_path / "ds"))
    cfg = load_config([], ["train.holdout_latest=0.1"])
    with pytest.raises(ConfigError, match=r"train.holdout_latest = 0.1: the dataset .* has no time column; featurize "
                                          r"it with featurize.time_column"):
        run_train(spark, cfg, str(tmp_path / "ds"), str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()


def test_l2_auto_takes_the_split_by_time_as_its_held_out_rows():
    cfg = load_config([], ["train.l2=auto", "train.holdout_period=0", "train.holdout_latest=0.1"])
    assert cfg.train.holdout_latest == 0.1
    with pytest.raises(ConfigError, match="needs held-out rows"):
        load_config([], ["train.l2=auto", "train.holdout_period=0"])


def test_a_tasks_batches_summarised_as_one():
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 10**6, n) for n in (5000, 70_000, 1, 0, 30_000)]
    pts, n = T.merge_summaries([T.task_points(b) for b in batches])
    allt = np.sort(np.concatenate(batches))
    assert n == allt.shape[0] and len(pts) == T.TASK_POINTS and pts[0] == allt[0] and pts[-1] == allt[-1]
    ranks = np.searchsorted(allt, pts) / n
    assert np.max(np.abs(ranks - np.linspace(0, 1, T.TASK_POINTS))) < 2e-3
    assert T.merge_summaries([]) == ([], 0) and T.merge_summaries([([3, 4], 2)]) == ([3, 4], 2)
