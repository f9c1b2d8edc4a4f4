"""Featurized rows written as Parquet: the dataset schema (``featurize_task.OUTPUT_SCHEMA``, or
``TIMED_SCHEMA`` with ``time``) from CSR arrays. The files decode to what pyarrow's
``ParquetWriter`` writes from the same rows with no dictionaries, page checksums and the
statistics below, with the same chunk counts and statistics (tested; pyarrow and Spark read
them). Written here because a list column's levels are then RLE runs made per row
(``pipeline.parquet_levels``), where a general writer makes and encodes two levels per value.

File layout (the Apache Parquet format): ``PAR1``, then per row group each column's data pages
(format v1: a Thrift ``PageHeader``, then the page compressed as one block: repetition levels
and definition levels, each a 4-byte little-endian length and RLE runs, then the values), then
the Thrift ``FileMetaData``, its 4-byte length and ``PAR1``. Pages end on row boundaries and hold
at most ``PAGE_BYTES`` of values. Every page header carries the CRC-32 of the page's stored
bytes. Columns: ``label`` and ``weight`` FLOAT, required, PLAIN; ``indices`` a required LIST of
required INT32 (PLAIN, BYTE_STREAM_SPLIT, or DELTA_BINARY_PACKED: ``pipeline.parquet_delta``,
stored without a codec, as its bit-packed values do not compress); ``values`` an optional LIST of
required FLOAT (PLAIN; null where every value of the row is 1); ``time`` INT64, required, PLAIN.
Every other column chunk takes the writer's codec. ``label``,
``weight`` and ``indices`` carry statistics (null count, min, max); a row group's non-zeros are
the ``indices`` chunk's ``num_values - null_count`` (``pipeline.verify``).
"""

from __future__ import annotations

import importlib.metadata
import struct as _struct
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from terascale.pipeline import thrift_compact as tc
from terascale.pipeline.parquet_delta import delta_binary_packed32, max_bytes
from terascale.pipeline.parquet_levels import MAX_RUN_BYTES, byte_stream_split4, list_levels

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib's CRC-32 is the same number
    from zlib import crc32


def _version() -> str:
    try:
        return importlib.metadata.version("terascale")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0+unknown"


CREATED_BY = f"terascale version {_version()}"  # the footer's created_by (parquet-mr parses "NAME version X")
MAGIC = b"PAR1"
PAGE_BYTES = 1 << 20  # values per page, in bytes (pyarrow's default data page size)

# Parquet's enums (parquet.thrift)
T_INT32, T_INT64, T_FLOAT = 1, 2, 4
REQUIRED, OPTIONAL, REPEATED = 0, 1, 2
CONVERTED_LIST = 3
ENC_PLAIN, ENC_RLE, ENC_DELTA, ENC_BSS = 0, 3, 5, 9
CODECS = {"none": 0, "snappy": 1, "zstd": 6, "lz4": 7}  # lz4: LZ4_RAW, as pyarrow writes "lz4"
_ARROW_CODEC = {"snappy": "snappy", "zstd": "zstd", "lz4": "lz4_raw"}
ENCODINGS = {"plain": ENC_PLAIN, "byte_stream_split": ENC_BSS, "delta_binary_packed": ENC_DELTA}


def _signed32(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


def _stat_bytes(v, dtype: str, is_min: bool) -> bytes:
    x = np.array([v], dtype=dtype)
    if dtype == "<f4" and x[0] == 0:  # a zero bound: -0.0 as min, +0.0 as max (the format's rule)
        x[0] = -0.0 if is_min else 0.0
    return x.tobytes()


def _schema_elements(timed: bool) -> list:
    def leaf(name, ptype, rep=REQUIRED):
        return [(1, tc.I32, ptype), (3, tc.I32, rep), (4, tc.BIN, name)]

    def list_of(name, ptype, rep):
        return [
            [(3, tc.I32, rep), (4, tc.BIN, name), (5, tc.I32, 1), (6, tc.I32, CONVERTED_LIST),
             (10, tc.STRUCT, [(3, tc.STRUCT, [])])],  # logicalType: LIST
            [(3, tc.I32, REPEATED), (4, tc.BIN, "list"), (5, tc.I32, 1)],
            leaf("element", ptype),
        ]

    cols = 5 if timed else 4
    out = [[(4, tc.BIN, "schema"), (5, tc.I32, cols)], leaf("label", T_FLOAT), leaf("weight", T_FLOAT)]
    out += list_of("indices", T_INT32, REQUIRED) + list_of("values", T_FLOAT, OPTIONAL)
    if timed:
        out.append(leaf("time", T_INT64))
    return out


class RowsWriter:
    """Row groups of featurized rows into one Parquet file on a pyarrow filesystem.

    ``write_group(labels, weights, indptr, indices, multi, multi_values, times)`` writes one row
    group (a row's values only where ``multi``: null elsewhere); ``close()`` writes the footer. A file whose writer was not closed has no footer and reads
    as no Parquet file."""

    def __init__(self, fs, inner: str, compression: str, encoding: str = "byte_stream_split", timed: bool = False,
                 created_by: str = ""):
        if compression not in CODECS:
            raise ValueError(f"compression {compression!r}: one of {sorted(CODECS)}")
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding of the indices {encoding!r}: one of {sorted(ENCODINGS)}")
        self.codec = CODECS[compression]
        self._arrow_codec = _ARROW_CODEC.get(compression)
        self.timed = timed
        self.created_by = created_by or CREATED_BY
        self._index_encoding = ENCODINGS[encoding]
        self._out = fs.open_output_stream(inner)
        self._pos = 0
        self._groups: list = []
        self._rows = 0
        self._write(MAGIC)

    def _write(self, b) -> None:
        self._out.write(b)
        self._pos += len(b)

    def _page(self, body: bytes | np.ndarray, n_entries: int, encoding: int, compress: bool) -> tuple[int, int]:
        """One data page (``body``: levels and values, uncompressed), compressed with the
        writer's codec if ``compress``; (uncompressed, stored) bytes with the header."""
        raw = memoryview(body).cast("B") if not isinstance(body, bytes) else body
        stored = raw if self._arrow_codec is None or not compress else pa.compress(raw, codec=self._arrow_codec, asbytes=False)
        n_stored = len(stored)  # bytes (a memoryview of bytes, or a pyarrow Buffer)
        header = tc.struct([
            (1, tc.I32, 0),  # DATA_PAGE
            (2, tc.I32, len(raw)),
            (3, tc.I32, n_stored),
            (4, tc.I32, _signed32(crc32(stored) & 0xFFFFFFFF)),
            (5, tc.STRUCT, [(1, tc.I32, n_entries), (2, tc.I32, encoding), (3, tc.I32, ENC_RLE), (4, tc.I32, ENC_RLE)]),
        ])
        self._write(header)
        self._write(stored)
        return len(header) + len(raw), len(header) + n_stored

    def _chunk(self, path, ptype, encoding, pages, stats=None) -> tuple[list, int, int]:
        """Write a column chunk's pages, as ``pages`` makes them ((body, level entries, null
        entries) each: one page in memory at a time); its ColumnChunk fields and (uncompressed,
        stored) bytes. ``stats(nulls)``: the chunk's Statistics fields (None: none).
        DELTA_BINARY_PACKED pages are stored without a codec."""
        start = self._pos
        unc = comp = n_values = nulls = 0
        compress = encoding != ENC_DELTA
        for body, entries, z in pages:
            u, c = self._page(body, entries, encoding, compress)
            unc, comp, n_values, nulls = unc + u, comp + c, n_values + entries, nulls + z
        encs = sorted({ENC_RLE, encoding}) if len(path) > 1 else [encoding]
        meta = [(1, tc.I32, ptype), (2, tc.LIST, (tc.I32, encs)), (3, tc.LIST, (tc.BIN, list(path))),
                (4, tc.I32, self.codec if compress else 0), (5, tc.I64, n_values), (6, tc.I64, unc), (7, tc.I64, comp),
                (9, tc.I64, start), (12, tc.STRUCT, None if stats is None else stats(nulls))]
        return [(2, tc.I64, start), (3, tc.STRUCT, meta)], unc, comp

    @staticmethod
    def _stats(x: np.ndarray, dtype: str):
        """Statistics of values ``x``: min and max (legacy and typed fields), the null count."""
        if x.shape[0] == 0:
            return lambda nulls: [(3, tc.I64, nulls)]
        lo, hi = _stat_bytes(x.min(), dtype, True), _stat_bytes(x.max(), dtype, False)
        return lambda nulls: [(1, tc.BIN, hi), (2, tc.BIN, lo), (3, tc.I64, nulls), (5, tc.BIN, hi), (6, tc.BIN, lo)]

    @staticmethod
    def _scalar_pages(x: np.ndarray) -> Iterator[tuple[np.ndarray, int, int]]:
        per = max(PAGE_BYTES // x.dtype.itemsize, 1)
        for a in range(0, max(x.shape[0], 1), per):
            yield x[a : a + per], min(per, x.shape[0] - a), 0

    def _list_pages(self, indptr: np.ndarray, present: np.ndarray, flat: np.ndarray, vptr: np.ndarray,
                    max_def: int, encoding: int) -> Iterator[tuple[np.ndarray, int, int]]:
        """Pages of a list column, rows cut where a page's values reach PAGE_BYTES (as PLAIN):
        (body, level entries, null entries) each. ``vptr``: each row's first value in ``flat``;
        ``encoding`` of the values: ENC_PLAIN, ENC_BSS (4-byte values) or ENC_DELTA (INT32)."""
        n = indptr.shape[0] - 1
        lens = np.diff(indptr)
        per = PAGE_BYTES // flat.dtype.itemsize
        cuts = [0]
        while cuts[-1] < n:
            a = cuts[-1]
            b = int(np.searchsorted(vptr, vptr[a] + per, side="right")) - 1
            cuts.append(min(max(b, a + 1), n))
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            cap = 2 * MAX_RUN_BYTES * (b - a) + 8
            rep = np.empty(cap, np.uint8)
            dfn = np.empty(cap, np.uint8)
            rw, dw, k, z = list_levels(lens[a:b], present[a:b], max_def, rep, dfn)
            vals = flat[vptr[a] : vptr[b]]
            size = max_bytes(vals.shape[0]) if encoding == ENC_DELTA else vals.nbytes
            body = np.empty(8 + rw + dw + size, np.uint8)  # the page: lengths, levels, values
            body[:4] = np.frombuffer(_struct.pack("<i", rw), np.uint8)
            body[4 : 4 + rw] = rep[:rw]
            body[4 + rw : 8 + rw] = np.frombuffer(_struct.pack("<i", dw), np.uint8)
            body[8 + rw : 8 + rw + dw] = dfn[:dw]
            out = body[8 + rw + dw :]
            if encoding == ENC_DELTA:
                size = delta_binary_packed32(vals, out, np.empty(vals.shape[0] + 128, np.uint32))
                body = body[: 8 + rw + dw + size]
            elif encoding == ENC_BSS:
                byte_stream_split4(vals.view(np.uint8), out)
            else:
                out[...] = vals.view(np.uint8)
            yield body, k, z

    def write_group(self, labels, weights, indptr, indices, multi, multi_values, times=None) -> None:
        """One row group: ``indices`` per row as ``indptr`` says; ``multi_values`` the values of
        the ``multi`` rows only, row after row (``multi_values_of``)."""
        if (times is not None) != self.timed:
            raise ValueError("rows' times are given exactly when the file is timed")
        n = labels.shape[0]
        labels = np.ascontiguousarray(labels, "<f4")
        weights = np.ascontiguousarray(weights, "<f4")
        indptr = np.asarray(indptr, np.int64)
        indices = np.ascontiguousarray(indices, "<i4")
        multi = np.asarray(multi, np.bool_)
        vptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.where(multi, np.diff(indptr), 0), out=vptr[1:])
        flat = np.ascontiguousarray(multi_values, "<f4")
        if flat.shape[0] != vptr[-1]:
            raise ValueError(f"{flat.shape[0]} values for multi rows of {int(vptr[-1])} indices")
        chunks = [
            self._chunk(("label",), T_FLOAT, ENC_PLAIN, self._scalar_pages(labels), self._stats(labels, "<f4")),
            self._chunk(("weight",), T_FLOAT, ENC_PLAIN, self._scalar_pages(weights), self._stats(weights, "<f4")),
            self._chunk(("indices", "list", "element"), T_INT32, self._index_encoding,
                        self._list_pages(indptr, np.ones(n, np.bool_), indices, indptr, 1, self._index_encoding),
                        self._stats(indices, "<i4")),
            self._chunk(("values", "list", "element"), T_FLOAT, ENC_PLAIN, self._list_pages(vptr, multi, flat, vptr, 2, ENC_PLAIN)),
        ]
        if times is not None:
            chunks.append(self._chunk(("time",), T_INT64, ENC_PLAIN, self._scalar_pages(np.ascontiguousarray(times, "<i8"))))
        cols = [c for c, _, _ in chunks]
        total_unc, total_comp = sum(u for _, u, _ in chunks), sum(k for _, _, k in chunks)
        first = cols[0][0][2]
        self._groups.append([(1, tc.LIST, (tc.STRUCT, cols)), (2, tc.I64, total_unc), (3, tc.I64, n),
                             (5, tc.I64, first), (6, tc.I64, total_comp)])
        self._rows += n

    def close(self) -> None:
        leaves = 5 if self.timed else 4
        meta = tc.struct([
            (1, tc.I32, 2),
            (2, tc.LIST, (tc.STRUCT, _schema_elements(self.timed))),
            (3, tc.I64, self._rows),
            (4, tc.LIST, (tc.STRUCT, self._groups)),
            (6, tc.BIN, self.created_by),
            (7, tc.LIST, (tc.STRUCT, [[(1, tc.STRUCT, [])]] * leaves)),  # TypeDefinedOrder for every leaf
        ])
        self._write(bytes(meta))
        self._write(_struct.pack("<i", len(meta)))
        self._write(MAGIC)
        self._out.close()


def multi_values_of(indptr: np.ndarray, values: np.ndarray, multi: np.ndarray, copy: bool = True) -> np.ndarray:
    """The values of the ``multi`` rows, row after row (what the ``values`` column stores): a
    new array, never a view of ``values`` (without ``copy``: ``values`` itself where every row
    is kept)."""
    if not multi.any():
        return np.zeros(0, np.float32)
    if multi.all():
        return (np.array if copy else np.asarray)(values[: int(indptr[-1])], np.float32)
    return values[: int(indptr[-1])][np.repeat(multi, np.diff(indptr))].astype(np.float32, copy=False)
