"""featurize.format=table on a real Spark session: Parquet, ORC, JSON lines, CSV and a catalog
table with a partition filter give the reference's rows exactly; row accounting per input;
quarantine reasons; schema errors before any Spark job (exit code 2)."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.orc as paorc
import pyarrow.parquet as pq
import pytest

from terascale.jobs.cli import main as cli_main
from terascale.jobs.config import feature_spec, load_config
from terascale.pipeline.spark_table import run_table_featurize
from terascale.pipeline.table_schema import SchemaError
from terascale.pipeline.table_spec import BadRow, record_label, record_row
from tests.frames import frame
from tests.test_featurize_spark import _written_rows

pytestmark = pytest.mark.spark

COLUMNS = ("[{name: site, missing: token}, app, {name: price, kind: numeric, bucketing: log}, "
           "{name: segs, kind: multi, max_values: 3}, {name: kv, kind: map}]")
BASE = ["featurize.format=table", "featurize.bits=16", "featurize.seed=3", "featurize.label=clicks",
        f"featurize.columns={COLUMNS}", "featurize.crosses=[[site, app]]"]


def _table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    site = np.array([None, "", "a.com", "b.org", "ü.de", "日本.jp"], dtype=object)[rng.integers(0, 6, n)]
    segs = [None if k == 0 else [f"s{x}" for x in rng.integers(0, 9, k - 1)] for k in rng.integers(0, 6, n)]
    kv = [[(f"k{x}", float(rng.integers(-1, 3))) for x in range(rng.integers(0, 3))] for _ in range(n)]
    clicks = rng.integers(-2, 3, n)  # -2: a bad label
    price = rng.lognormal(0, 2, n)
    price[rng.random(n) < 0.02] = np.nan  # bad_numeric
    return pa.table({
        "clicks": pa.array(clicks, pa.int64()), "site": pa.array(site, pa.string()),
        "app": pa.array(rng.integers(0, 40, n), pa.int64()), "price": pa.array(price),
        "segs": pa.array(segs, pa.list_(pa.string())), "kv": pa.array(kv, pa.map_(pa.string(), pa.float64())),
        "ts": pa.array(1_764_000_000_000_000 + rng.integers(0, 86_400_000_000, n), pa.timestamp("us", tz="UTC")),
        "dt": pa.array(np.where(rng.random(n) < 0.5, "2026-11-27", "2026-11-28"), pa.string()),
    })


def _expected(spec, records: list[dict]) -> tuple[Counter, Counter]:
    """(rows, reasons) of the reference over records {column: value}."""
    t = spec.table
    rows, reasons = Counter(), Counter()
    for rec in records:
        r = {f.name: rec[f.source] for f in t.fields}
        try:
            y = record_label(rec[t.label])
            idx, vals = record_row(t, spec.bits, spec.seed, r)
        except BadRow as e:
            reasons[e.reason] += 1
            continue
        rows[(y, tuple(idx), tuple(vals))] += 1
    return rows, reasons


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    parts = [_table(3000, 1), _table(2000, 2)]
    for fmt in ("parquet", "orc", "json", "csv"):
        (d / fmt).mkdir()
    for i, t in enumerate(parts):
        pq.write_table(t, d / "parquet" / f"part-{i}.parquet", row_group_size=700)
        paorc.write_table(t.drop_columns(["ts"]), d / "orc" / f"part-{i}.orc", stripe_size=64 << 10)
        with open(d / "json" / f"part-{i}.json", "w", encoding="utf-8") as f:
            for r in t.drop_columns(["ts"]).to_pylist():
                r["kv"] = dict(r["kv"])
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        flat = t.select(["clicks", "site", "app", "price"])
        pacsv.write_csv(flat, d / "csv" / f"part-{i}.csv")
    return d, parts


def _run(spark, inputs, out, sets, table="", where=""):
    cfg = load_config([], BASE + sets)
    spec = feature_spec(cfg)
    return spec, run_table_featurize(spark, inputs, str(out), spec, cfg.featurize, table=table, where=where)


def _records(parts, drop=()):
    recs = []
    for t in parts:
        for r in t.drop_columns(list(drop)).to_pylist():
            if "kv" in r and r["kv"] is not None:
                r["kv"] = list(r["kv"])
            recs.append(r)
    return recs


@pytest.mark.parametrize("fmt", ["parquet", "orc", "json"])
def test_files_give_the_references_rows(spark, logs, tmp_path, fmt):
    d, parts = logs
    spec, m = _run(spark, [str(d / fmt)], tmp_path / "ds", [f"featurize.input_format={fmt}", "featurize.partitions=3"])
    rows, reasons = _expected(spec, _records(parts))
    assert _written_rows(tmp_path / "ds") == rows
    assert m["quarantine"]["by_reason"] == dict(reasons) and set(reasons) >= {"bad_label", "bad_numeric"}
    for p, t in zip(m["per_input"], parts, strict=True):  # rows in = written + quarantined, per file
        assert p["lines"] == t.num_rows == p["rows"] + p["quarantined"]
    assert m["spec"]["table"]["fields"][0] == {"name": "site", "kind": "categorical", "missing": "token"}
    assert m["groups"]["names"] == ["site", "app", "price", "segs", "kv", "site^app"]


def test_csv_with_bad_rows_quarantines_them(spark, logs, tmp_path):
    d, parts = logs
    src = tmp_path / "in"
    src.mkdir()
    text = (d / "csv" / "part-0.csv").read_bytes().split(b"\n")
    text.insert(5, b"1,x.com,notanumber,1.0")  # unparsable: app is an integer
    text.insert(9, b"1,x.com")  # wrong_field_count
    (src / "a.csv").write_bytes(b"\n".join(text))
    spec, m = _run(spark, [str(src)], tmp_path / "ds", ["featurize.input_format=csv", "featurize.schema=clicks bigint, site string, app bigint, price double",
                                                       "featurize.columns=[{name: site, missing: token}, app, {name: price, kind: numeric, bucketing: log}]"])
    rows, reasons = _expected(spec, _records([parts[0].select(["clicks", "site", "app", "price"])]))
    assert _written_rows(tmp_path / "ds") == rows
    assert m["quarantine"]["by_reason"] == {**reasons, "unparsable": 1, "wrong_field_count": 1}
    q = pq.read_table(tmp_path / "ds" / "_quarantine").to_pylist()
    assert {(r["line"], r["reason"]) for r in q if r["reason"] in ("unparsable", "wrong_field_count")} == {
        (5, "unparsable"), (9, "wrong_field_count")}


def test_catalog_table_with_a_partition_filter_and_an_expression(spark, logs, tmp_path):
    d, parts = logs
    t = pa.concat_tables(parts)
    df = frame(spark, t.select(["clicks", "site", "app", "price", "ts", "dt"]))
    df.write.partitionBy("dt").option("path", str(tmp_path / "wh")).saveAsTable("ad_logs_test")
    try:
        sets = ["featurize.columns=[{name: site, missing: token}, app, {name: hour, expr: 'hour(ts)'}]",
                "featurize.crosses=[[site, hour]]"]
        spark.conf.set("spark.sql.session.timeZone", "UTC")
        spec, m = _run(spark, [], tmp_path / "ds", sets, table="ad_logs_test", where="dt = '2026-11-27'")
    finally:
        spark.sql("DROP TABLE ad_logs_test")
    recs = [dict(r, hour=r["ts"].astimezone(dt.UTC).hour) for r in _records([t.select(["clicks", "site", "app", "ts", "dt"])])
            if r["dt"] == "2026-11-27"]
    rows, reasons = _expected(spec, recs)
    assert _written_rows(tmp_path / "ds") == rows
    assert m["lines"] == len(recs) and m["quarantine"]["by_reason"] == dict(reasons)
    assert m["options"]["table"] == "ad_logs_test" and m["options"]["where"] == "dt = '2026-11-27'"


def test_negative_downsampling_accounts_for_every_row(spark, logs, tmp_path):
    d, parts = logs
    _, m = _run(spark, [str(d / "parquet")], tmp_path / "ds", ["featurize.negative_rate=0.25"])
    for p in m["per_input"]:
        assert p["lines"] == p["rows"] + p["dropped"] + p["quarantined"] and p["dropped"] > 0
    _, again = _run(spark, [str(d / "parquet")], tmp_path / "ds2", ["featurize.negative_rate=0.25", "featurize.partitions=1"])
    assert _written_rows(tmp_path / "ds") == _written_rows(tmp_path / "ds2")  # the decisions do not depend on the split


def test_schema_problems_stop_before_spark_with_exit_code_2(spark, logs, tmp_path, capsys):
    d, _ = logs
    with pytest.raises(SchemaError, match="featurize.columns\\[1\\] \\(app, map\\): column 'app' .* is int64"):
        _run(spark, [str(d / "parquet")], tmp_path / "x", ["featurize.columns=[site, {name: app, kind: map}]"])
    with pytest.raises(SchemaError, match="column 'nope' is not in"):
        _run(spark, [str(d / "parquet")], tmp_path / "x", ["featurize.columns=[nope, site, app]"])
    assert not (tmp_path / "x").exists()
    rc = cli_main(["featurize", "--input", str(d / "parquet"), "--output", str(tmp_path / "y"),
                   *sum((["--set", s] for s in BASE + ["featurize.columns=[{name: site, kind: numeric}, app]"]), [])])
    assert rc == 2 and "column 'site'" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_test_data_takes_the_training_specs_learned_boundaries(spark, logs, tmp_path):
    """A quantile field learns its boundaries on the data it featurizes; --spec-from takes a
    dataset's (boundaries included), so test data is bucketed as its training data was."""
    from terascale.jobs.steps import spec_from

    d, parts = logs
    q = ["featurize.columns=[site, app, {name: price, kind: numeric, bucketing: quantile, quantiles: 8}]"]
    spec, m = _run(spark, [str(d / "parquet" / "part-0.parquet")], tmp_path / "train", q)
    learned = m["spec"]["table"]["fields"][2]["boundaries"]
    assert len(learned) == 7 and learned == sorted(learned)
    prices = np.sort(parts[0]["price"].to_numpy())
    prices = prices[np.isfinite(prices)]
    for k, b in enumerate(learned, start=1):  # each boundary near its quantile (summaries of 2001 points)
        assert abs(np.searchsorted(prices, b) / prices.shape[0] - k / 8) < 0.01
    other = run_table_featurize(spark, [str(d / "parquet" / "part-1.parquet")], str(tmp_path / "own"), spec,
                                load_config([], BASE + q).featurize)
    assert other["spec"]["table"]["fields"][2]["boundaries"] != learned  # learned again on other rows
    cfg = load_config([], BASE + q + [f"featurize.spec_from={tmp_path / 'train'}"])
    test = run_table_featurize(spark, [str(d / "parquet" / "part-1.parquet")], str(tmp_path / "test"),
                               spec_from(cfg.featurize.spec_from), cfg.featurize)
    assert test["spec"] == m["spec"]


@pytest.mark.parametrize("with_map", [True, False])  # a map field: record by record; else pyarrow's reader
def test_a_json_file_is_cut_into_line_ranges_and_numbers_its_lines(spark, logs, tmp_path, with_map):
    """One JSON-lines file in 4 byte ranges (each task reads only its own), with blank lines and a
    bad line: the reference's rows, and the bad line quarantined under its line number."""
    d, parts = logs
    src = tmp_path / "in"
    src.mkdir()
    lines = (d / "json" / "part-0.json").read_bytes().split(b"\n")[:-1]
    lines[100:100] = [b"", b"   "]  # lines 101 and 102: blank, no records
    lines.insert(1500, b"{broken")  # line 1501
    (src / "a.json").write_bytes(b"\n".join(lines) + b"\n")
    sets = ["featurize.input_format=json", "featurize.partitions=4"]
    if not with_map:
        sets.append("featurize.columns=[{name: site, missing: token}, app, {name: price, kind: numeric, bucketing: log}, "
                    "{name: segs, kind: multi, max_values: 3}]")
    spec, m = _run(spark, [str(src)], tmp_path / "ds", sets)
    assert len(m["files"]) == 4
    rows, reasons = _expected(spec, _records([parts[0]]))
    assert _written_rows(tmp_path / "ds") == rows
    assert m["quarantine"]["by_reason"] == {**reasons, "unparsable": 1}
    assert m["per_input"][0]["lines"] == parts[0].num_rows + 1
    q = pq.read_table(tmp_path / "ds" / "_quarantine").to_pylist()
    assert [r["line"] for r in q if r["reason"] == "unparsable"] == [1501]
    bad_label = [r["line"] for r in q if r["reason"] == "bad_label"]
    want = [k + 1 + (2 if k >= 100 else 0) + (1 if k + (2 if k >= 100 else 0) >= 1500 else 0)
            for k, c in enumerate(parts[0]["clicks"].to_pylist()) if c == -2]
    assert sorted(bad_label) == want


def test_python_workers_get_the_executor_environment(spark):
    """jobs.session.EXECUTOR_ENV reaches the Python workers (local mode too): numpy's huge-page
    advice off, and the allocators keeping freed memory for the next batch."""
    import os

    from terascale.jobs.session import EXECUTOR_ENV

    names = [k.removeprefix("spark.executorEnv.") for k in EXECUTOR_ENV]
    got = spark.sparkContext.parallelize([0], 1).map(lambda _: {n: os.environ.get(n) for n in names}).collect()[0]
    assert got == {k.removeprefix("spark.executorEnv."): v for k, v in EXECUTOR_ENV.items()}
    assert got["MIMALLOC_PURGE_DELAY"] == "-1" and int(got["MALLOC_TRIM_THRESHOLD_"]) >= 256 << 20


def test_parquet_strings_and_lists_of_strings_are_read_as_dictionaries(tmp_path):
    """table_sources.read_piece: string columns (a dotted name too) and lists of strings whose
    dictionary page is small come as dictionaries, batches stay within a row group (a list's
    dictionaries cannot span two), and the values are the file's."""
    from terascale.pipeline import fsutil
    from terascale.pipeline.table_sources import ReadOptions, plan_pieces, read_piece

    n = 1000
    t = pa.table({"a.b": pa.array([f"v{i % 7}" for i in range(n)]),
                  "segs": pa.array([[f"s{i % 5}", None] if i % 3 else None for i in range(n)], pa.list_(pa.string())),
                  "odd.list.name": pa.array([[f"x{i % 4}"] for i in range(n)], pa.list_(pa.string())),
                  "n": pa.array(range(n), pa.int64())})
    pq.write_table(t, tmp_path / "f.parquet", row_group_size=300)
    cols = ("a.b", "segs", "odd.list.name", "n")
    pieces = plan_pieces(fsutil.expand_inputs([str(tmp_path / "f.parquet")]), "parquet", 1)
    got = [x for p in pieces for x in read_piece(p, ReadOptions("parquet", cols, batch_rows=256))]
    assert [row for row, _ in got] == [1, 257, 301, 557, 601, 857, 901]  # 300-row groups, 256-row batches
    b = got[0][1]
    assert pa.types.is_dictionary(b.schema.field("a.b").type)
    assert pa.types.is_dictionary(b.schema.field("segs").type.value_type)
    assert pa.types.is_dictionary(b.schema.field("odd.list.name").type.value_type)
    read = pa.Table.from_batches([x for _, x in got]).select(list(cols))
    for c in cols:
        assert read.column(c).to_pylist() == t.column(c).to_pylist(), c
