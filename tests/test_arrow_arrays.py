"""pipeline.arrow_arrays against pyarrow's own conversions (the reference): validity and filled
values of boolean, integer and floating arrays, with nulls, sliced at odd offsets, empty; arrays
made on numpy buffers; and a fresh process that featurizes a table batch never imports pandas."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from terascale.pipeline.arrow_arrays import filled, from_numpy, valid_mask

RNG = np.random.default_rng(5)
N = 203
NULLS = RNG.random(N) < 0.3
ARRAYS = {
    "bool": pa.array(RNG.random(N) < 0.5, mask=NULLS),
    "int8": pa.array(RNG.integers(-100, 100, N).astype(np.int8), mask=NULLS),
    "uint16": pa.array(RNG.integers(0, 60000, N).astype(np.uint16), mask=NULLS),
    "int32": pa.array(RNG.integers(-(2**31), 2**31, N).astype(np.int32), mask=NULLS),
    "int64": pa.array(RNG.integers(-(2**62), 2**62, N), mask=NULLS),
    "float32": pa.array(RNG.normal(size=N).astype(np.float32), mask=NULLS),
    "float64": pa.array(RNG.normal(size=N), mask=NULLS),
    "no nulls": pa.array(RNG.normal(size=N)),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
@pytest.mark.parametrize("cut", [(0, N), (3, 77), (13, 0), (8, 190), (N - 1, 1)])
def test_filled_and_valid_equal_pyarrows_conversion(name, cut):
    arr = ARRAYS[name].slice(*cut)
    fill = False if name == "bool" else 7
    want = arr.fill_null(fill).to_numpy(zero_copy_only=False)
    got = filled(arr, fill)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert valid_mask(arr).tolist() == arr.is_valid().to_pylist()
    if len(arr):
        got[0] = got[-1]  # a new array: the column's buffers are not written
        assert arr.equals(ARRAYS[name].slice(*cut))


def test_from_numpy_is_pa_array_without_nulls():
    for x in (np.arange(5, dtype=np.int64), np.array([1.5, -2.0]), np.arange(10, dtype=np.int32)[::2]):
        assert from_numpy(x).equals(pa.array(x))
    days = from_numpy(np.array([0, 19000], np.int32), pa.date32())
    assert days.type == pa.date32() and days.cast(pa.string()).to_pylist() == ["1970-01-01", "2022-01-08"]


def test_a_fresh_worker_featurizes_a_table_batch_without_pandas(tmp_path):
    """As a Spark worker: read a Parquet file, featurize it; pandas stays out of the process."""
    import pyarrow.parquet as pq

    pq.write_table(pa.table({
        "__label": pa.array([True, None, False]), "site": pa.array(["a", None, "b"]), "n": pa.array([1, None, 3]),
        "x": pa.array([0.5, None, 2.0]), "tags": pa.array([["t"], None, []]), "day": pa.array([0, None, 19000], pa.int32()).cast(pa.date32()),
    }), tmp_path / "t.parquet")
    code = f"""
import sys
import pyarrow.parquet as pq
from terascale.pipeline.table_kernel import featurize_batch
from terascale.pipeline.table_spec import TableSpec, parse_fields
spec = TableSpec(fields=parse_fields(["site", "n", "day", {{"name": "x", "kind": "numeric"}}, {{"name": "tags", "kind": "multi"}}]),
                 label="__label")
batch = next(pq.ParquetFile({str(tmp_path / "t.parquet")!r}, read_dictionary=["site"]).iter_batches())
rows = featurize_batch(spec, 18, 0, batch)
print(rows.status.tolist(), "pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    status, pandas = out.stdout.rsplit(" ", 1)
    assert pandas.strip() == "False", out.stdout
    assert status.startswith("[0, ") and status.endswith(", 0]") and status != "[0, 0, 0]"  # the null label's row
