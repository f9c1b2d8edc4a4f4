"""Tests of the synthetic ad-log table generator (``pipeline.gen_adlog``): its schema, its
determinism whatever the chunking, the rates it promises, its files (Parquet, and JSON lines
read back with pyarrow and, for the map column, with the json module), and that its featurize
configuration parses and featurizes every row of it."""

from __future__ import annotations

import datetime as dt
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest

from terascale.pipeline import gen_adlog as G

ROWS = 200_000


@pytest.fixture(scope="module")
def data():
    return G.generate_adlog(ROWS, seed=7)


def _bytes(t: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(t, buf)
    return buf.getvalue()


def test_schema_and_value_ranges(data):
    t, p = data
    assert t.schema == G.SCHEMA and t.num_rows == ROWS and p.shape == (ROWS,) and p.dtype == np.float64
    assert str(t.schema.field("ts").type) == "timestamp[us]"
    assert t.schema.field("user_segments").type == pa.list_(pa.string())
    assert t.schema.field("interests").type == pa.map_(pa.string(), pa.float64())
    ts = t.column("ts").cast(pa.int64()).to_numpy()
    start = int(G.START.timestamp()) * 10**6
    assert np.all(np.diff(ts) >= 0) and ts[0] >= start and ts[-1] < start + 7 * 86400 * 10**6
    assert np.all(ts % 10**6 == 0)
    assert np.array_equal(t.column("hour").to_numpy(), (ts - start) // 3_600_000_000 % 24)
    hours = np.bincount(t.column("hour").to_numpy(), minlength=24)
    assert hours.argmax() in range(12, 18) and hours.max() > 2 * hours.min()  # diurnal traffic
    assert set(t.column("device_type").to_pylist()) == set(G.DEVICE_TYPES)
    assert set(t.column("banner_pos").to_pylist()) == set(range(8))
    assert pc.all(pc.match_substring_regex(t.column("site_id").drop_null(), "^s[0-9a-f]{5}$")).as_py()
    assert pc.count_distinct(t.column("site_id")).as_py() > 5_000
    assert pc.count_distinct(t.column("device_id")).as_py() > 30_000
    assert pc.min(t.column("price")).as_py() > 0
    seg_len = pc.list_value_length(t.column("user_segments")).to_numpy(zero_copy_only=False)
    assert np.nanmax(seg_len) == 8
    assert all(len(set(s)) == len(s) for s in t.column("user_segments").slice(0, 5000).to_pylist() if s)
    interests = t.column("interests").slice(0, 5000).to_pylist()
    assert max(len(m) for m in interests) == 4
    assert all(len({k for k, _ in m}) == len(m) and all(0 < v <= 1 for _, v in m) for m in interests)
    assert set(t.column("weight").to_numpy()) == {1.0, 2.0}
    assert np.all((p > 0) & (p < 1))


def test_null_and_empty_fractions(data):
    t, _ = data
    for name, rate in G.NULL_RATE.items():
        assert abs(t.column(name).null_count / ROWS - rate) < 0.005, name
    assert t.column("interests").null_count == 0
    lengths = pc.list_value_length(t.column("user_segments").drop_null()).to_numpy()
    assert abs(np.mean(lengths == 0) - G.SEGMENT_COUNT_P[0]) < 0.01
    assert abs(np.mean(t.column("weight").to_numpy() == 2.0) - G.WEIGHTED_RATE) < 0.005


def test_click_rate_and_bayes_logloss(data):
    t, p = data
    y = t.column("clicked").to_numpy()
    truth = G.truth_of(y, p, t.column("weight").to_numpy())
    assert abs(truth["positive_rate"] - 0.05) < 0.004 and abs(p.mean() - 0.05) < 0.003
    assert truth["bayes_logloss"] < truth["base_logloss"] - 0.01
    assert truth["bayes_logloss_weighted"] < truth["base_logloss_weighted"] - 0.01
    ll = -np.mean(np.where(y, np.log(p), np.log(1 - p)))  # the obvious formula
    assert truth["bayes_logloss"] == pytest.approx(ll, rel=1e-12)


def test_other_click_rate():
    t, p = G.generate_adlog(50_000, seed=3, click_rate=0.2)
    assert abs(pc.mean(t.column("clicked").cast(pa.float64())).as_py() - 0.2) < 0.012


def test_deterministic_and_chunking_independent():
    rows = G.BLOCK_ROWS + 9_000  # two blocks
    t, p = G.generate_adlog(rows, seed=5)
    t2, p2 = G.generate_adlog(rows, seed=5)
    assert _bytes(t) == _bytes(t2) and np.array_equal(p, p2)
    small, ps = G.generate_adlog(rows, seed=5, chunk_rows=9_999)
    assert small.equals(t) and np.array_equal(ps, p)
    windows = list(G.iter_adlog(rows, seed=5, start=60_000, stop=70_000, chunk_rows=3_000))
    assert pa.concat_tables([w for w, _ in windows]).equals(t.slice(60_000, 10_000))
    other, _ = G.generate_adlog(rows, seed=6)
    assert not other.equals(t)


def test_write_adlog_parquet_json_truth(tmp_path):
    rows = 30_000
    truth = G.write_adlog(tmp_path / "out", rows, seed=11, files=3, chunk_rows=7_000)
    t, p = G.generate_adlog(rows, seed=11)
    out = tmp_path / "out"
    assert sorted(x.name for x in out.rglob("*")) == sorted(
        ["parquet", "json", "truth.json"] + [f"part-{i:05d}.parquet" for i in range(3)]
        + [f"part-{i:05d}.json" for i in range(3)])
    parts = [pq.read_table(out / "parquet" / f"part-{i:05d}.parquet") for i in range(3)]
    assert [x.num_rows for x in parts] == [10_000] * 3
    assert pa.concat_tables(parts).equals(t)

    assert json.loads((out / "truth.json").read_text()) == truth
    expect = G.truth_of(t.column("clicked").to_numpy(), p, t.column("weight").to_numpy())
    for k, v in expect.items():
        assert truth[k] == pytest.approx(v, rel=1e-9), k
    assert truth["files"]["json"] == [f"json/part-{i:05d}.json" for i in range(3)]

    # pyarrow's JSON reader has no conversion to a map: the map column is checked with json below
    cols = [f for f in G.SCHEMA if f.name != "interests"]
    parse = pajson.ParseOptions(explicit_schema=pa.schema(cols), unexpected_field_behavior="ignore")
    back = pa.concat_tables([pajson.read_json(out / "json" / f"part-{i:05d}.json", parse_options=parse)
                             for i in range(3)])
    assert back.equals(t.select([f.name for f in cols]))
    inferred = pajson.read_json(out / "json" / "part-00000.json").schema
    assert inferred.field("price").type == pa.float64() and inferred.field("weight").type == pa.float64()
    lines = (out / "json" / "part-00001.json").read_bytes().splitlines()
    records = t.slice(10_000, 10_000).to_pylist()
    assert len(lines) == len(records)
    for line, rec in zip(lines[:2000], records, strict=False):
        obj = json.loads(line)
        assert list(obj) == G.SCHEMA.names
        assert obj["interests"] == dict(rec["interests"])
        assert obj["ts"] == rec["ts"].isoformat() and obj["user_segments"] == rec["user_segments"]

    with pytest.raises(FileExistsError):
        G.write_adlog(out, 10, seed=11)


def test_write_adlog_empty_files(tmp_path):
    truth = G.write_adlog(tmp_path, 2, seed=1, files=3, formats=("parquet",))
    assert truth["rows"] == 2 and truth["files"] == {"parquet": [f"parquet/part-{i:05d}.parquet" for i in range(3)]}
    assert [pq.read_table(tmp_path / f).num_rows for f in truth["files"]["parquet"]] == [0, 1, 1]


def test_spec_yaml_loads_and_featurizes_every_row(tmp_path, data):
    from terascale.jobs.config import feature_spec, load_config
    from terascale.pipeline.table_kernel import featurize_batch
    from terascale.pipeline.table_task import Columns

    conf = tmp_path / "adlog.yaml"
    conf.write_text(G.ADLOG_SPEC_YAML, encoding="utf-8")
    cfg = load_config([conf])
    assert cfg.featurize.format == "table" and cfg.featurize.label == "clicked"
    spec = feature_spec(cfg)
    assert [f.name for f in spec.table.fields] == [
        "site_id", "app_id", "device_id", "device_type", "banner_pos", "hour", "price", "user_segments", "interests"]
    assert spec.table.crosses == (("site_id", "banner_pos"),)
    t, _ = data
    t = t.slice(0, 50_000)
    price = t.column("price").drop_null().to_numpy()
    table = spec.table.with_boundaries({"price": np.unique(np.quantile(price, np.arange(1, 16) / 16))})
    batch = Columns.of(spec).batch(t.combine_chunks().to_batches()[0])
    rows = featurize_batch(table, spec.bits, spec.seed, batch)
    assert np.all(rows.status == 0)
    assert rows.indptr.shape[0] == t.num_rows + 1 and rows.indices.max() < 2**spec.bits
    assert np.array_equal(rows.labels, t.column("clicked").to_numpy().astype(np.float32))
    assert np.array_equal(rows.weights, t.column("weight").to_numpy().astype(np.float32))
    assert np.diff(rows.indptr).min() >= 5  # the categorical fields that are never null, and hour


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="click_rate"):
        G.generate_adlog(10, click_rate=1.0)
    with pytest.raises(ValueError, match="rows"):
        G.generate_adlog(-1)
    with pytest.raises(ValueError, match="formats"):
        G.write_adlog(tmp_path, 10, formats=("csv",))
    assert G.generate_adlog(0)[0].schema == G.SCHEMA


def test_ts_is_utc_wall_time(data):
    t, _ = data
    first = t.column("ts")[0].as_py()
    assert first.tzinfo is None and first >= dt.datetime(2026, 11, 20)


def test_cli_generates_the_table_and_its_featurize_conf(tmp_path, capsys):
    from terascale.jobs.cli import main as cli_main
    from terascale.jobs.config import feature_spec, load_config

    assert cli_main(["generate", "--kind", "adlog", "--rows", "3000", "--files", "2", "--out", str(tmp_path / "ad")]) == 0
    assert sorted(p.name for p in (tmp_path / "ad" / "parquet").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    spec = feature_spec(load_config([tmp_path / "ad" / "adlog.yaml"]))
    assert spec.format == "table" and spec.table.label == "clicked"
    assert cli_main(["generate", "--kind", "adlog", "--rows", "10", "--out", str(tmp_path / "ad")]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err
