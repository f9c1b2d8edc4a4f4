"""The table featurizer (pipeline.table_kernel) against the plain-Python reference
(pipeline.table_spec.record_row), bit for bit, for every field kind; and the Criteo preset
against the Criteo parser on the same lines."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from terascale.pipeline.rowkernels import REASONS
from terascale.pipeline.spec import FeatureSpec
from terascale.pipeline.table_kernel import LABEL, TILE_ROWS, WEIGHT, featurize_batch
from terascale.pipeline.table_schema import SchemaError, check_schema
from terascale.pipeline.table_spec import (
    BadRow,
    TableSpec,
    criteo_preset,
    expand_crosses,
    parse_fields,
    record_label,
    record_row,
    record_weight,
)
from terascale.solvers.constraints import ConfigError
from tests.parse_helpers import parse_bytes

NAMES = ["site", "app", "flag", "day", "price", "cnt", "pb", "segs", "kv", "ids"]
SPEC = TableSpec(
    fields=parse_fields([
        {"name": "site", "missing": "token"}, {"name": "app"}, {"name": "flag"}, {"name": "day"},
        {"name": "price", "kind": "numeric"}, {"name": "cnt", "kind": "numeric", "bucketing": "log", "missing": "token"},
        {"name": "pb", "kind": "numeric", "bucketing": "boundaries", "boundaries": [0.2, 0.5, 1.0]},
        {"name": "segs", "kind": "multi", "max_values": 3, "namespace": "seg"},
        {"name": "kv", "kind": "map", "max_values": 2, "overflow": "truncate", "missing": "token"},
        {"name": "ids", "kind": "multi"},
    ]),
    crosses=expand_crosses([["site", "app"], ["site", "segs", "flag"], ["kv", "price"]], [["app", "flag", "day"]], NAMES),
    max_row_features=60,
)
TYPES = {
    LABEL: pa.int64(), WEIGHT: pa.float64(), "site": pa.string(), "app": pa.int64(), "flag": pa.bool_(),
    "day": pa.date32(), "price": pa.float64(), "cnt": pa.int32(), "pb": pa.float64(),
    "segs": pa.list_(pa.string()), "kv": pa.map_(pa.string(), pa.float64()), "ids": pa.list_(pa.int64()),
}
TEXT = st.text(alphabet=st.sampled_from(list("ab^=#é日\u00a0x ")), max_size=4)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64) | st.sampled_from([0.0, 1.0, 2.0, 2.5, -3.0, 1e300])
RECORD = st.fixed_dictionaries({
    LABEL: st.none() | st.sampled_from([0, 1, 2, -1, -2, 7]),
    WEIGHT: st.none() | st.sampled_from([1.0, 0.5, 0.0, -1.0, float("nan"), 3.0]),
    "site": st.none() | TEXT,
    "app": st.none() | st.integers(-(2**63), 2**63 - 1),
    "flag": st.none() | st.booleans(),
    "day": st.none() | st.dates(dt.date(1970, 1, 1), dt.date(2100, 1, 1)),
    "price": st.none() | FLOATS,
    "cnt": st.none() | st.integers(-(2**31), 2**31 - 1),
    "pb": st.none() | FLOATS,
    "segs": st.none() | st.lists(st.none() | TEXT, max_size=5),
    "kv": st.none() | st.lists(st.tuples(TEXT, st.none() | FLOATS), max_size=4, unique_by=lambda kv: kv[0]),
    "ids": st.none() | st.lists(st.none() | st.integers(-5, 5), max_size=4),
})


def reference(spec: TableSpec, bits: int, seed: int, rec: dict):
    """(reason, label, weight, indices, values) of one record by the reference."""
    try:
        y = record_label(rec[LABEL])
        w = record_weight(rec[WEIGHT]) if WEIGHT in rec else 1.0
        idx, vals = record_row(spec, bits, seed, rec)
    except BadRow as e:
        return e.reason, None, None, None, None
    return "ok", y, w, idx, vals


def check_batch(spec: TableSpec, bits: int, seed: int, records: list[dict], types: dict, offset: int = 0) -> dict:
    """The kernel against the reference on ``records`` (from ``offset`` on: a slice of the batch,
    as readers that cut a table into batches hand it over)."""
    batch = pa.RecordBatch.from_pylist(records, pa.schema([pa.field(k, types[k]) for k in records[0]])).slice(offset)
    rows = featurize_batch(spec, bits, seed, batch)
    k = 0
    reasons: dict[str, int] = {}
    for i, rec in enumerate(batch.to_pylist()):
        reason, y, w, idx, vals = reference(spec, bits, seed, rec)
        assert REASONS[rows.status[i]] == reason, (i, rec)
        reasons[reason] = reasons.get(reason, 0) + 1
        if reason != "ok":
            continue
        a, b = rows.indptr[k], rows.indptr[k + 1]
        assert rows.indices[a:b].tolist() == idx, (i, rec)
        assert rows.values[a:b].tolist() == vals, (i, rec)
        assert rows.multi[k] == any(v != 1.0 for v in vals)
        assert (rows.labels[k], rows.weights[k]) == (np.float32(y), np.float32(w))
        k += 1
    assert k == rows.labels.shape[0] == rows.indptr.shape[0] - 1
    return reasons


@settings(max_examples=60, deadline=None)
@given(st.lists(RECORD, min_size=1, max_size=40), st.sampled_from([1, 6, 20, 28]), st.integers(0, 2**32 - 1))
@example([{LABEL: 1, WEIGHT: 1.0, "site": "日本", "app": None, "flag": None, "day": None, "price": None, "cnt": None,
           "pb": None, "segs": [], "kv": [], "ids": None}], 20, 0)
@example([{LABEL: 1, WEIGHT: 1.0, "site": "", "app": -(2**63), "flag": True, "day": dt.date(2026, 11, 27),
           "price": 1e300, "cnt": 2, "pb": 0.5, "segs": ["a", None, "", "a", "b"], "kv": [("k", 0.0), ("", 2.0), ("z", None)],
           "ids": [None, 0, -1]}], 20, 7)
def test_kernel_equals_reference(records, bits, seed):
    check_batch(SPEC, bits, seed, records, TYPES)


def test_every_reason_on_a_fixed_batch():
    """Every reason, over three of the assembly's tiles (fields of at most one token a row are
    gathered without branches, carrying their positions from tile to tile)."""
    rng = np.random.default_rng(3)
    pick = lambda vals, n=2 * TILE_ROWS + 500: [vals[i] for i in rng.integers(0, len(vals), n)]  # noqa: E731
    recs = [dict(zip(TYPES, vals, strict=True)) for vals in zip(
        pick([0, 1, 5, -1, -4, None]), pick([1.0, 0.25, float("inf"), None]), pick(["a.com", "b", "", None, "ü"]),
        pick([1, 2, None]), pick([True, False, None]), pick([dt.date(2026, 1, 1), None]),
        pick([0.0, 1.5, float("nan"), None]), pick([0, 3, 1000, None]), pick([0.1, 0.7, 9.0, None]),
        pick([["s1"], ["a", "b", "c", "d"], [], None]), pick([[("k1", 1.0)], [("k", float("-inf"))], [("a", 1.0), ("b", 2.0), ("c", 3.0)], None]),
        pick([[1, 2, 3], [], None]), strict=True)]
    reasons = check_batch(SPEC, 16, 3, recs, TYPES)
    assert {"ok", "bad_label", "bad_weight", "bad_numeric", "too_many_features"} <= set(reasons)
    check_batch(SPEC, 16, 3, recs, TYPES, offset=37)  # a slice: every column's buffers start inside


@pytest.mark.parametrize("bits", [6, 20, 28])
def test_long_rows_and_repeated_indices_equal_the_reference(bits):
    """Rows longer than the ranking sort takes (RANK_SORT_MAX entries: merge sort), with and
    without repeated indices, at indices narrower and wider than 25 bits (int32 and int64 keys)."""
    spec = TableSpec(fields=parse_fields([{"name": "toks", "kind": "multi"}, {"name": "x", "kind": "numeric"}]),
                     label=LABEL, max_row_features=1000)
    rng = np.random.default_rng(bits)
    recs = [{LABEL: int(rng.integers(0, 2)), WEIGHT: 1.0, "x": float(rng.normal()),
             "toks": [f"t{v}" for v in rng.integers(0, 10 ** int(rng.integers(1, 4)), int(rng.integers(0, 200)))]}
            for _ in range(300)]
    types = {LABEL: pa.int64(), WEIGHT: pa.float64(), "toks": pa.list_(pa.string()), "x": pa.float64()}
    check_batch(spec, bits, 11, recs, types)


def test_dictionary_and_plain_columns_hash_alike():
    spec = TableSpec(fields=parse_fields(["site"]), label=LABEL)
    vals = ["x", "y", None, "x", "ü", ""]
    plain = pa.RecordBatch.from_arrays([pa.array([1] * 6), pa.array(vals)], names=[LABEL, "site"])
    enc = pa.RecordBatch.from_arrays([pa.array([1] * 6), pa.array(vals).dictionary_encode()], names=[LABEL, "site"])
    a, b = featurize_batch(spec, 20, 1, plain), featurize_batch(spec, 20, 1, enc)
    assert a.indices.tolist() == b.indices.tolist() and a.indptr.tolist() == b.indptr.tolist()


def test_invalid_utf8_in_a_binary_column_is_quarantined():
    spec = TableSpec(fields=parse_fields(["site"]), label=LABEL)
    b = pa.RecordBatch.from_arrays([pa.array([1, 0, 1]), pa.array([b"ok", b"\xff\xfe", b"ok"], pa.binary())],
                                   names=[LABEL, "site"])
    rows = featurize_batch(spec, 20, 0, b)
    assert [REASONS[s] for s in rows.status] == ["ok", "invalid_utf8", "ok"]


@pytest.mark.parametrize(("kind", "typ", "message"), [
    ("categorical", pa.struct([("a", pa.int32())]), "cannot|must be a string"),
    ("categorical", pa.float64(), "make it numeric"),
    ("numeric", pa.string(), "cast it in an expr"),
    ("multi", pa.string(), "an array"),
    ("map", pa.map_(pa.int32(), pa.float64()), "map<string, number>"),
])
def test_schema_errors_name_the_column_and_its_type(kind, typ, message):
    spec = TableSpec(fields=parse_fields([{"name": "f", "kind": kind}]))
    schema = pa.schema([("label", pa.int64()), ("f", typ)])
    with pytest.raises(SchemaError, match=f"column 'f' of logs.parquet is {typ}.*({message})"):
        check_schema(spec, schema, [("featurize.label", "label", "label"), ("featurize.columns[0]", "f", kind)],
                     "logs.parquet")
    with pytest.raises(SchemaError, match="column 'F' is not in logs.parquet \\(did you mean 'f'\\?\\)"):
        check_schema(spec, schema, [("featurize.columns[0]", "F", kind)], "logs.parquet")


@pytest.mark.parametrize(("decl", "message"), [
    ([{"name": "a=b"}], r"columns\[0\]\.name = 'a=b': must be a field name"),
    ([{"name": "a", "kind": "numeric", "bucketing": "boundaries"}], r"columns\[0\]\.boundaries = \[\]: must be set"),
    ([{"name": "a", "kind": "numeric", "bucketing": "boundaries", "boundaries": [2, 1]}], "strictly ascending"),
    ([{"name": "a", "bucketing": "log"}], r"columns\[0\]\.bucketing = 'log': must be 'none' for a field of kind 'categorical'"),
    ([{"name": "a", "kind": "numeric", "bucketing": "quantile"}], r"quantiles = 0: must be an integer in \[2"),
    ([{"name": "a", "max_values": 3}], "only for kind multi or map"),
    ([{"name": "a"}, {"name": "a"}], "a second field of this name"),
    ([{"name": "a", "column": "x", "expr": "y"}], "set column or expr, not both"),
])
def test_declaration_errors_name_the_key(decl, message):
    with pytest.raises(ConfigError, match=message):
        parse_fields(decl)


def test_cross_all_expands_to_every_pair_once():
    assert expand_crosses([["a", "b"]], [["a", "b", "c"]], ["a", "b", "c"]) == (("a", "b"), ("a", "c"), ("b", "c"))
    with pytest.raises(ConfigError, match=r"crosses\[0\] = \['a', 'q'\]: 'q' is not a field"):
        expand_crosses([["a", "q"]], [], ["a"])


def test_spec_round_trips_through_json():
    fs = FeatureSpec(format="table", bits=18, seed=4, table=SPEC)
    assert FeatureSpec.from_json(fs.to_json()) == fs


CRITEO_FIELDS = tuple(f"I{k}" for k in range(1, 14)) + tuple(f"C{k}" for k in range(1, 27))


def _criteo_line(label: str, ints: dict, cats: dict) -> bytes:
    fields = [label] + [ints.get(k, "") for k in range(1, 14)] + [cats.get(k, "") for k in range(1, 27)]
    return "\t".join(fields).encode("utf-8") + b"\n"


CRITEO_LINES = (
    _criteo_line("1", {1: "5", 3: "-3", 4: "1000000", 5: "2", 6: "0", 7: "77", 13: "9"},
                 {1: "68fd1e64", 2: "80e26c9b", 26: "3f1a9b2c"})
    + _criteo_line("0", {2: "1"}, {26: "deadbeef"})
    + _criteo_line("1", {1: "123456789012", **{k: str(k) for k in range(2, 14)}}, {k: "abé" for k in range(1, 27)})
)


@pytest.mark.parametrize(("bucketing", "conj"), [("log_squared", ()), ("identity", (("C1", "C2"), ("I1", "C26")))])
def test_criteo_preset_gives_the_criteo_parsers_indices(bucketing, conj):
    """Criteo's TSV read as a table (pyarrow CSV, integers int64, categories strings) through the
    preset: the same indices and values as the Criteo parser."""
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=20, seed=9, int_bucketing=bucketing, conjunctions=conj)
    rows, reasons = parse_bytes(CRITEO_LINES, spec)
    assert set(reasons) == {"ok"}
    names = ["label", *CRITEO_FIELDS]
    types = {n: pa.int64() if n == "label" or n.startswith("I") else pa.string() for n in names}
    t = pacsv.read_csv(pa.BufferReader(CRITEO_LINES), read_options=pacsv.ReadOptions(column_names=names),
                       parse_options=pacsv.ParseOptions(delimiter="\t"), convert_options=pacsv.ConvertOptions(column_types=types))
    t = t.rename_columns([LABEL, *CRITEO_FIELDS])
    got = featurize_batch(criteo_preset(CRITEO_FIELDS, bucketing, conj), 20, 9, t)
    assert got.indptr.shape[0] - 1 == len(rows)
    for r, (label, idx, vals) in enumerate(rows):
        a, b = got.indptr[r], got.indptr[r + 1]
        assert got.labels[r] == label
        assert got.indices[a:b].tolist() == idx
        assert got.values[a:b].tolist() == vals


def test_review_edges_agree_with_the_reference():
    """Integers past 2^53, decimals, a weight beyond float32, a log bucket below -2^62, and a
    cross of long arrays (too_many_features before the cross is built)."""
    import decimal

    spec = TableSpec(fields=parse_fields([
        {"name": "big", "kind": "numeric"}, {"name": "dec", "kind": "numeric", "bucketing": "boundaries",
                                              "boundaries": [-8852696.54, 0.1, 1.0]},
        {"name": "lg", "kind": "numeric", "bucketing": "log"}, {"name": "a", "kind": "multi"}, {"name": "b", "kind": "multi"},
    ]), crosses=(("a", "b"),), max_row_features=50)
    types = {LABEL: pa.int64(), WEIGHT: pa.float64(), "big": pa.int64(), "dec": pa.decimal128(10, 2),
             "lg": pa.float64(), "a": pa.list_(pa.int64()), "b": pa.list_(pa.int64())}
    d = decimal.Decimal
    recs = [
        {LABEL: 1, WEIGHT: 1.0, "big": 2**53 + 1, "dec": d("-8852696.54"), "lg": 3.0, "a": [1], "b": [2]},
        {LABEL: 0, WEIGHT: 1e39, "big": 1, "dec": d("0.10"), "lg": 1.0, "a": [], "b": []},
        {LABEL: 1, WEIGHT: 1.0, "big": 2**63 - 1, "dec": d("12345678.91"), "lg": -1e19, "a": [], "b": []},
        {LABEL: 1, WEIGHT: 1.0, "big": None, "dec": None, "lg": None, "a": list(range(10)), "b": list(range(10))},
    ] + [{LABEL: 1, WEIGHT: 1.0, "big": -(2**62) - k, "dec": d(f"{k}.07"), "lg": 1e18 * k, "a": [k], "b": [k, k + 1]}
         for k in range(50)]
    reasons = check_batch(spec, 16, 5, recs, types)
    assert {"bad_weight", "bad_numeric", "too_many_features"} <= set(reasons)
