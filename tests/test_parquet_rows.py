"""terascale's Parquet writer of featurized rows (``pipeline.parquet_rows``) against pyarrow's
``ParquetWriter`` with the options featurize used before (the reference): the same decoded
table and schema, the same chunk ``num_values`` and statistics, page checksums that pyarrow
verifies, and Spark reading the files. The Thrift compact encoding byte by byte."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from terascale.pipeline import parquet_rows, spark_compat
from terascale.pipeline import thrift_compact as tc
from terascale.pipeline.featurize_task import OUTPUT_SCHEMA, TIMED_SCHEMA
from terascale.pipeline.parquet_rows import RowsWriter, multi_values_of

FS = pafs.LocalFileSystem()


def _rows(seed: int, n: int, max_len: int = 40, empty: float = 0.1, multi: float = 0.5):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, n) * (rng.random(n) >= empty)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=indptr[1:])
    nnz = int(indptr[-1])
    indices = rng.integers(0, 1 << 24, nnz).astype(np.int32)
    values = np.where(rng.random(nnz) < 0.7, 1.0, rng.normal(0, 3, nnz)).astype(np.float32)
    m = (rng.random(n) < multi) & (lens > 0)
    labels = (rng.random(n) < 0.3).astype(np.float32)
    weights = rng.choice(np.array([1.0, 10.0, 0.5], np.float32), n)
    times = rng.integers(-(1 << 40), 1 << 40, n)
    return labels, weights, indptr, indices, values, m, times


def _reference_table(labels, weights, indptr, indices, values, multi, times=None) -> pa.Table:
    """The rows as Arrow arrays, built without the writer's code."""
    lists_i, lists_v = [], []
    for r in range(labels.shape[0]):
        a, b = int(indptr[r]), int(indptr[r + 1])
        lists_i.append(indices[a:b].tolist())
        lists_v.append(values[a:b].tolist() if multi[r] else None)
    cols = [pa.array(labels, pa.float32()), pa.array(weights, pa.float32()),
            pa.array(lists_i, OUTPUT_SCHEMA.field("indices").type), pa.array(lists_v, OUTPUT_SCHEMA.field("values").type)]
    if times is None:
        return pa.Table.from_arrays(cols, schema=OUTPUT_SCHEMA)
    return pa.Table.from_arrays(cols + [pa.array(times, pa.int64())], schema=TIMED_SCHEMA)


def _pyarrow_write(path, tables, compression, encoding, timed=False):
    """pyarrow's writer with the options featurize used before its own writer."""
    with pq.ParquetWriter(path, TIMED_SCHEMA if timed else OUTPUT_SCHEMA, compression=None if compression == "none" else compression,
                          use_dictionary=False, column_encoding={"indices.list.element": encoding.upper()},
                          write_statistics=["label", "weight", "indices.list.element"], write_page_checksum=True) as w:
        for t in tables:
            w.write_table(t, row_group_size=max(t.num_rows, 1))


def _ours(path, groups, compression, encoding, timed=False):
    w = RowsWriter(FS, str(path), compression, encoding, timed)
    for labels, weights, indptr, indices, values, multi, times in groups:
        w.write_group(labels, weights, indptr, indices, multi, multi_values_of(indptr, values, multi),
                      times if timed else None)
    w.close()


def _groups(seed=0):
    return [_rows(seed, 3000), _rows(seed + 1, 0), _rows(seed + 2, 517, max_len=3, empty=0.5, multi=0.0),
            _rows(seed + 3, 200, max_len=700, multi=1.0)]


@pytest.mark.parametrize("compression", ["snappy", "zstd", "lz4", "none"])
@pytest.mark.parametrize("encoding", ["byte_stream_split", "plain", "delta_binary_packed"])
@pytest.mark.parametrize("timed", [False, True])
def test_the_files_read_as_pyarrows_with_the_same_metadata(tmp_path, monkeypatch, compression, encoding, timed):
    monkeypatch.setattr(parquet_rows, "PAGE_BYTES", 2048)  # many pages; rows of up to 700 values (2800 bytes) longer than one
    groups = _groups()
    ours, ref = tmp_path / "ours.parquet", tmp_path / "ref.parquet"
    _ours(ours, groups, compression, encoding, timed)
    tables = [_reference_table(*g[:6], g[6] if timed else None) for g in groups]
    _pyarrow_write(ref, tables, compression, encoding, timed)
    got = pq.read_table(ours, page_checksum_verification=True)
    assert got.schema.equals(TIMED_SCHEMA if timed else OUTPUT_SCHEMA)
    assert got.equals(pa.concat_tables(tables))
    mo, mr = pq.ParquetFile(ours).metadata, pq.ParquetFile(ref).metadata
    assert mo.num_rows == mr.num_rows and mo.num_row_groups == mr.num_row_groups == len(groups)
    for g in range(mo.num_row_groups):
        assert mo.row_group(g).num_rows == mr.row_group(g).num_rows
        for c in range(mo.num_columns):
            co, cr = mo.row_group(g).column(c), mr.row_group(g).column(c)
            delta = encoding == "delta_binary_packed" and co.path_in_schema == "indices.list.element"
            assert (co.path_in_schema, co.physical_type, co.num_values) == (cr.path_in_schema, cr.physical_type, cr.num_values)
            assert co.compression == ("UNCOMPRESSED" if delta else cr.compression)  # bit-packed: no codec
            if mo.row_group(g).num_rows:  # (pyarrow writes no page of an empty group, this writer an empty one)
                assert set(co.encodings) <= set(cr.encodings) | {"RLE"}
            so, sr = co.statistics, cr.statistics
            assert (so is not None and so.has_min_max) == (sr is not None and sr.has_min_max)
            if sr is not None and sr.has_min_max:
                assert (so.min, so.max, so.null_count) == (sr.min, sr.max, sr.null_count)
    # a group's non-zeros, as pipeline.verify reads them
    st = mo.row_group(0).column(2)
    assert st.num_values - st.statistics.null_count == int(groups[0][2][-1])


def test_a_zero_bound_is_written_as_the_format_says(tmp_path):
    labels = np.array([0.0, 1.0, 0.0], np.float32)
    _ours(tmp_path / "z.parquet", [(labels, np.ones(3, np.float32), np.array([0, 1, 1, 2]), np.array([5, 7], np.int32),
                                    np.ones(2, np.float32), np.zeros(3, np.bool_), None)], "snappy", "plain")
    st = pq.ParquetFile(tmp_path / "z.parquet").metadata.row_group(0).column(0).statistics
    assert (st.min, st.max) == (0.0, 1.0) and np.signbit(st.min)  # -0.0 as a min
    assert pq.read_table(tmp_path / "z.parquet").column("indices").to_pylist() == [[5], [], [7]]


def test_a_flipped_byte_in_a_page_is_an_error_on_read(tmp_path):
    path = tmp_path / "f.parquet"
    _ours(path, [_rows(3, 2000)], "snappy", "byte_stream_split")
    col = pq.ParquetFile(path).metadata.row_group(0).column(2)
    data = bytearray(path.read_bytes())
    data[col.data_page_offset + 200] ^= 0x10  # inside the first page of the indices
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="(?i)crc|checksum|corrupt"):
        pq.read_table(path, page_checksum_verification=True)


def test_a_file_without_close_has_no_footer(tmp_path):
    path = tmp_path / "open.parquet"
    w = RowsWriter(FS, str(path), "snappy", "plain")
    g = _rows(4, 100)
    w.write_group(*g[:4], g[5], multi_values_of(g[2], g[4], g[5]))
    w._out.close()  # the task died before close()
    with pytest.raises(pa.ArrowInvalid):
        pq.ParquetFile(path)


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="compression 'gzip'"):
        RowsWriter(FS, str(tmp_path / "a.parquet"), "gzip")
    with pytest.raises(ValueError, match="encoding of the indices 'delta'"):
        RowsWriter(FS, str(tmp_path / "b.parquet"), "snappy", "delta")
    w = RowsWriter(FS, str(tmp_path / "c.parquet"), "snappy")
    g = _rows(5, 10, multi=1.0)
    with pytest.raises(ValueError, match="values for multi rows"):
        w.write_group(*g[:4], g[5], np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="times"):
        w.write_group(*g[:4], g[5], multi_values_of(g[2], g[4], g[5]), g[6])


@pytest.mark.spark
def test_spark_reads_the_files(spark, tmp_path):
    encodings = ["plain", "delta_binary_packed"] + (["byte_stream_split"] if spark_compat.parse_version(spark.version) >= spark_compat.BSS_SINCE
                             else [])
    groups = _groups(7)
    want = pa.concat_tables([_reference_table(*g[:6], g[6]) for g in groups]).to_pylist()
    for enc in encodings:
        d = tmp_path / enc
        d.mkdir()
        _ours(d / "part-0.parquet", groups, "snappy", enc, timed=True)
        rows = spark.read.parquet(str(d)).collect()
        got = [{"label": r.label, "weight": r.weight, "indices": list(r.indices),
                "values": None if r["values"] is None else list(r["values"]), "time": r.time} for r in rows]
        assert sorted(got, key=repr) == sorted(want, key=repr), enc


# ---------------------------------------------------------------------------------------------
# Thrift compact protocol


def test_thrift_varints_and_zigzag():
    out = bytearray()
    for n in (0, 1, 127, 128, 300, 2**35):
        tc.varint(n, out)
    assert bytes(out) == bytes([0, 1, 0x7F, 0x80, 0x01, 0xAC, 0x02, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01])
    assert [tc.zigzag(n, 32) for n in (0, -1, 1, -2, 2**31 - 1, -(2**31))] == [0, 1, 2, 3, 2**32 - 2, 2**32 - 1]
    with pytest.raises(ValueError):
        tc.zigzag(2**31, 32)


def test_thrift_structs_byte_by_byte():
    # i32 field 1 = 3; binary field 2 = "ab"; i64 field 20 (long form) = -1; bool field 21 true; stop
    b = tc.struct([(1, tc.I32, 3), (2, tc.BIN, "ab"), (20, tc.I64, -1), (21, tc.BOOL, True), (22, tc.I32, None)])
    assert bytes(b) == bytes([0x15, 0x06, 0x18, 0x02, 0x61, 0x62, 0x06, 0x28, 0x01, 0x11, 0x00])
    # list of 2 i32 (short header 0x25), list of 15 structs (long header 0xFC 0x0F), nested struct
    b = tc.struct([(1, tc.LIST, (tc.I32, [1, -1])), (2, tc.LIST, (tc.STRUCT, [[]] * 15)), (3, tc.STRUCT, [(1, tc.I32, 0)])])
    assert bytes(b) == bytes([0x19, 0x25, 0x02, 0x01, 0x19, 0xFC, 0x0F] + [0x00] * 15 + [0x1C, 0x15, 0x00, 0x00, 0x00])
    with pytest.raises(ValueError, match="increase"):
        tc.struct([(2, tc.I32, 1), (1, tc.I32, 1)])
