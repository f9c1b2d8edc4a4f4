"""Reading tables for ``featurize.format = table``: Parquet, ORC, JSON lines and CSV files, read by
each featurize task itself with pyarrow (any pyarrow filesystem), as batches of the columns the
spec needs, each with its file and the 1-based number of its first record there.

The driver plans (:func:`plan_pieces`) from the files' footers: a Parquet file splits into runs
of row groups; a JSON-lines file into line-aligned byte ranges (``pipeline.spark_table``, as the
text formats); an ORC or CSV file goes whole to one task (a CSV file is read whole into its
memory: a quoted field may hold a newline, so it is not cut). Record numbers are
the record's position in its file (for CSV with a header, the header is not a record), so the
negative-downsampling decisions and the quarantine's ``line`` do not depend on the split. A
JSON or CSV record that does not parse becomes a bad record (``unparsable``, or
``wrong_field_count`` for a CSV row of the wrong width) instead of failing its task.
No pyspark here.
"""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.orc as paorc
import pyarrow.parquet as pq

from terascale.pipeline import fsutil

INPUT_FORMATS = ("parquet", "orc", "json", "csv")
BATCH_ROWS = 262144  # rows a batch: a batch's distinct values are hashed once (measured: 65536 rows 0.6M, 262144 0.7M rows per CPU s)
TARGET_TASK_BYTES = 64 << 20  # a task's share of the (compressed) input when planning automatically


class TableInputError(fsutil.InputError):
    """An input table that cannot be read as declared (names the file)."""


@dataclass(frozen=True)
class TablePiece:
    """Units [first, first + count) of one file (Parquet row groups, ORC stripes; CSV a whole
    file: 0, 1; JSON lines the bytes [first, first + count), count -1: the whole file), whose
    first record is record number ``first_row`` (1-based; JSON: its line number) of the file."""

    uri: str
    fmt: str
    first: int
    count: int
    first_row: int
    bytes: int

    def to_json(self) -> list:
        return [self.uri, self.fmt, self.first, self.count, self.first_row, self.bytes]

    @classmethod
    def from_json(cls, v: list) -> TablePiece:
        return cls(*v)


@dataclass(frozen=True)
class BadRecord:
    """A record the reader could not decode: ``row`` its number in the file, ``raw`` its text."""

    row: int
    reason: str
    raw: bytes


@dataclass(frozen=True)
class ReadOptions:
    fmt: str
    columns: tuple[str, ...]  # the input columns to read
    schema_b64: str = ""  # JSON/CSV: the Arrow schema of the input (pa.Schema.serialize), base64
    csv_header: bool = True
    csv_delimiter: str = ","
    batch_rows: int = BATCH_ROWS

    @property
    def schema(self) -> pa.Schema | None:
        if not self.schema_b64:
            return None
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(self.schema_b64)))


def encode_schema(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


# ---------------------------------------------------------------------------------------------
# Schemas


_DDL_TYPES = {
    "string": pa.string(), "varchar": pa.string(), "str": pa.string(), "binary": pa.binary(),
    "bigint": pa.int64(), "long": pa.int64(), "int": pa.int32(), "integer": pa.int32(), "smallint": pa.int16(),
    "tinyint": pa.int8(), "double": pa.float64(), "float": pa.float32(), "real": pa.float32(),
    "boolean": pa.bool_(), "bool": pa.bool_(), "date": pa.date32(), "timestamp": pa.timestamp("us"),
}


def parse_ddl(text: str) -> pa.Schema:
    """A Spark-style DDL schema (``site string, price double, segs array<string>,
    kv map<string,double>``) as an Arrow schema; ValueError naming the bad part."""
    fields = []
    for part in _split_top(text):
        m = re.match(r"^\s*`?([^`\s]+)`?\s+(.+?)\s*$", part)
        if not m:
            raise ValueError(f"featurize.schema: {part.strip()!r} is not 'name type'")
        fields.append(pa.field(m.group(1), _ddl_type(m.group(2), part)))
    if not fields:
        raise ValueError("featurize.schema: no columns")
    return pa.schema(fields)


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in out + [cur] if p.strip()]


def _ddl_type(t: str, part: str) -> pa.DataType:
    t = t.strip()
    low = t.lower()
    if low in _DDL_TYPES:
        return _DDL_TYPES[low]
    m = re.match(r"^array\s*<(.*)>$", t, re.I)
    if m:
        return pa.list_(_ddl_type(m.group(1), part))
    m = re.match(r"^map\s*<(.*)>$", t, re.I)
    if m:
        kv = _split_top(m.group(1))
        if len(kv) == 2:
            return pa.map_(_ddl_type(kv[0], part), _ddl_type(kv[1], part))
    raise ValueError(f"featurize.schema: type {t!r} in {part.strip()!r} is not supported "
                     f"(one of {', '.join(sorted(_DDL_TYPES))}, array<T>, map<K,V>)")


def file_schema(uri: str, opts: ReadOptions) -> pa.Schema:
    """The schema of one input file: Parquet's and ORC's own; for JSON and CSV the declared one,
    else inferred from the file's first block."""
    fs, inner = fsutil.resolve(uri)
    try:
        if opts.fmt == "parquet":
            with fs.open_input_file(inner) as f:
                return pq.ParquetFile(f).schema_arrow
        if opts.fmt == "orc":
            with fs.open_input_file(inner) as f:
                return paorc.ORCFile(f).schema
        if opts.schema is not None:
            return opts.schema
        with fs.open_input_stream(inner) as f:
            head = f.read(1 << 20)
        if opts.fmt == "json":
            head = head[: head.rfind(b"\n") + 1] or head
            try:
                return pajson.read_json(io.BytesIO(head)).schema
            except pa.ArrowInvalid:  # a bad record in the first block: infer from the good ones
                good = []
                for line in head.split(b"\n"):
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        good.append(obj)
                if not good:
                    raise
                return pa.Table.from_pylist(good).schema
        head = head[: head.rfind(b"\n") + 1] or head
        return pacsv.read_csv(io.BytesIO(head), **_csv_options(opts, None, None)).schema
    except (pa.ArrowInvalid, OSError) as e:
        raise TableInputError(f"{uri}: cannot read it as {opts.fmt} ({e})") from None


# ---------------------------------------------------------------------------------------------
# Planning


def plan_pieces(files: list[fsutil.InputFile], fmt: str, n_tasks_hint: int) -> list[TablePiece]:
    """The pieces of the input files: Parquet row groups in runs of about a task's share of the
    bytes; ORC, JSON and CSV files whole."""
    total = sum(f.size for f in files)
    share = max(1, total // max(1, n_tasks_hint))
    out: list[TablePiece] = []
    for f in files:
        fs, inner = fsutil.resolve(f.uri)
        if fmt == "parquet":
            try:
                with fs.open_input_file(inner) as fh:
                    md = pq.ParquetFile(fh).metadata
            except (pa.ArrowInvalid, OSError) as e:
                raise TableInputError(f"{f.uri}: not a Parquet file ({e})") from None
            units = [(md.row_group(i).num_rows, md.row_group(i).total_byte_size) for i in range(md.num_row_groups)]
        elif fmt == "orc":  # whole files: ORC's per-stripe row counts are not in its footer's pyarrow view
            try:
                with fs.open_input_file(inner) as fh:
                    stripes = paorc.ORCFile(fh).nstripes
            except (pa.ArrowInvalid, OSError) as e:
                raise TableInputError(f"{f.uri}: not an ORC file ({e})") from None
            out.append(TablePiece(f.uri, fmt, 0, stripes, 1, f.size))
            continue
        else:
            out.append(TablePiece(f.uri, fmt, 0, 1, 1, f.size))
            continue
        row, i = 1, 0
        while i < len(units):
            j, b = i, 0
            while j < len(units) and (j == i or b + units[j][1] <= share):
                b += units[j][1]
                j += 1
            out.append(TablePiece(f.uri, fmt, i, j - i, row, b))
            row += sum(u[0] for u in units[i:j])
            i = j
    return out


def assign(pieces: list[TablePiece], n_tasks: int) -> list[list[TablePiece]]:
    """Longest-processing-time-first by bytes; each task's pieces in input order; no empty task."""
    n_tasks = max(1, min(n_tasks, len(pieces)))
    loads = [(0, t) for t in range(n_tasks)]
    tasks: list[list[int]] = [[] for _ in range(n_tasks)]
    for k in sorted(range(len(pieces)), key=lambda k: (-pieces[k].bytes, k)):
        load, t = min(loads)
        loads[t] = (load + pieces[k].bytes, t)
        tasks[t].append(k)
    return [[pieces[k] for k in sorted(ks)] for ks in tasks if ks]


def task_count(pieces: list[TablePiece], partitions: int, target_mb: int, parallelism: int) -> int:
    if partitions > 0:
        return partitions
    total = sum(p.bytes for p in pieces)
    n = max(1, -(-total // (target_mb << 20)), min(parallelism, -(-total // TARGET_TASK_BYTES)))
    if n > parallelism > 1:
        n = -(-n // parallelism) * parallelism
    return n


# ---------------------------------------------------------------------------------------------
# Reading


def read_piece(piece: TablePiece, opts: ReadOptions) -> Iterator[tuple[int, pa.RecordBatch | BadRecord]]:
    """(record number of the batch's first record, batch of ``opts.columns``), or (record
    number, BadRecord) for a record that does not decode, in file order."""
    fs, inner = fsutil.resolve(piece.uri)
    cols = list(opts.columns)
    if piece.fmt == "parquet":
        with fs.open_input_file(inner) as fh:
            pf = pq.ParquetFile(fh)
            keep = _small_dictionaries(pf, piece.first, cols, opts.batch_rows)
            if keep:
                pf = pq.ParquetFile(fh, read_dictionary=keep)
            row = piece.first_row
            for g in range(piece.first, piece.first + piece.count):  # a batch within one row group (its dictionaries)
                for b in pf.iter_batches(batch_size=opts.batch_rows, row_groups=[g], columns=cols, use_threads=False):
                    yield row, b
                    row += b.num_rows
        return
    if piece.fmt == "orc":
        with fs.open_input_file(inner) as fh:
            o = paorc.ORCFile(fh)
            row = piece.first_row
            for i in range(piece.first, piece.first + piece.count):
                t = o.read_stripe(i, columns=cols)
                for b in (t.to_batches(opts.batch_rows) if isinstance(t, pa.Table) else [t]):
                    yield row, b
                    row += b.num_rows
        return
    if piece.fmt == "json" and piece.count >= 0:  # a byte range of a plain file, aligned to lines
        with fs.open_input_file(inner) as fh:
            fh.seek(piece.first)
            data = fh.read(piece.count)
    else:
        with fs.open_input_stream(inner) as fh:  # a whole file (a .gz one decompressed)
            data = fh.read()
    yield from (_read_json(data, opts, piece.first_row) if piece.fmt == "json" else _read_csv(data, opts))


def _small_dictionaries(pf: pq.ParquetFile, row_group: int, cols: list[str], batch_rows: int) -> list[str]:
    """The string columns (and lists of strings, by their leaf's path) to read as dictionaries:
    those whose dictionary page (in the piece's first row group) is small beside a batch. pyarrow hands every batch the column chunk's whole
    dictionary, so a large one (10^6 ids) would be copied and hashed per batch; such a column is
    read as strings and each batch's distinct values are found by the kernel instead."""
    schema, md = pf.schema_arrow, pf.metadata
    if md.num_row_groups == 0:
        return []
    rg = md.row_group(row_group)
    limit = 8 * batch_rows  # dictionary page bytes: about a batch's worth of short strings
    out = []
    for i in range(rg.num_columns):
        c = rg.column(i)
        path = c.path_in_schema  # a column's own name (dots and all), or a list's leaf: "segs.list.element"
        name, nested = path, False
        if path not in cols:
            name, sep, leaf = path.rpartition(".list.")
            if not sep or "." in leaf:
                continue
            nested = True
        if name not in cols or name not in schema.names or not c.has_dictionary_page:
            continue
        t = schema.field(name).type
        if nested:  # a list of strings is read as a list of dictionary entries
            if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
                continue
            t = t.value_type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            continue
        if c.data_page_offset - c.dictionary_page_offset <= limit:
            out.append(path)
    return out


def _batches(t: pa.Table, first_row: int, n: int) -> Iterator[tuple[int, pa.RecordBatch]]:
    row = first_row
    for b in t.combine_chunks().to_batches(n):
        yield row, b
        row += b.num_rows


def _project(schema: pa.Schema, cols: list[str]) -> pa.Schema:
    return pa.schema([schema.field(c) for c in cols])


def adapt_inferred(schema: pa.Schema, kinds: dict[str, str]) -> pa.Schema:
    """An inferred JSON or CSV schema made fit for the spec: a JSON object read for a map field
    becomes map<string, double>, a column of nulls a string (categorical, multi element) or a
    double (numeric, label, weight)."""
    out = []
    for f in schema:
        kind, t = kinds.get(f.name), f.type
        if kind == "map" and pa.types.is_struct(t):
            t = pa.map_(pa.string(), pa.float64())
        elif pa.types.is_null(t):
            t = {"multi": pa.list_(pa.string()), "categorical": pa.string()}.get(kind, pa.float64())
        elif kind == "multi" and pa.types.is_list(t) and pa.types.is_null(t.value_type):
            t = pa.list_(pa.string())
        elif kind in ("numeric", "label", "weight") and pa.types.is_integer(t):
            t = pa.float64()  # a later record's 0.4 must not be truncated into an integer column
        out.append(pa.field(f.name, t))
    return pa.schema(out)


_BLANK_LINE = re.compile(rb"(?:^|\n)[ \t\r]*\n")


def _read_json(data: bytes, opts: ReadOptions, first_line: int = 1) -> Iterator[tuple[int, pa.RecordBatch | BadRecord]]:
    """The records of JSON lines whose first line is line ``first_line`` of its file; a record's
    number is its line's (a blank line is no record but is counted)."""
    schema = _project(opts.schema, list(opts.columns))
    maps = [f.name for f in schema if pa.types.is_map(f.type)]
    blank = _BLANK_LINE.search(data) is not None or (bool(data) and not data.rstrip(b" \t\r\n"))
    if not maps and not blank:  # pyarrow's reader builds no map, and would number past a blank line
        parse = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        try:
            t = pajson.read_json(io.BytesIO(data), parse_options=parse)
            yield from _batches(t.select(list(opts.columns)), first_line, opts.batch_rows)
            return
        except pa.ArrowInvalid:
            pass
    # maps, or some record that does not parse: each line decoded alone, so only the bad ones
    # are lost; the good ones converted in bulk (record by record only in a chunk that fails)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    good: list[tuple[int, dict]] = []
    for k, line in enumerate(lines, start=first_line):
        if not line.strip():  # no record (as in pyarrow's reader), but a line: the run of records ends
            yield from _json_good(good, schema, opts.batch_rows)
            good = []
            continue
        rec = _json_record(line, schema)
        if isinstance(rec, str):
            yield from _json_good(good, schema, opts.batch_rows)
            good = []
            yield k, BadRecord(k, rec, line)
        else:
            good.append((k, rec))
    yield from _json_good(good, schema, opts.batch_rows)


def _json_good(good: list[tuple[int, dict]], schema: pa.Schema, n: int) -> Iterator[tuple[int, pa.RecordBatch | BadRecord]]:
    """Good records of consecutive lines (line, record) as batches; a record whose values do not convert
    to the schema's types is a BadRecord (``unparsable``)."""
    for s in range(0, len(good), n):
        chunk = good[s:s + n]
        try:
            t = pa.Table.from_pylist([r for _, r in chunk], schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            run: list[tuple[int, dict]] = []
            for k, r in chunk:
                try:
                    pa.Table.from_pylist([r], schema)
                    run.append((k, r))
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                    yield from _json_good(run, schema, n)
                    run = []
                    yield k, BadRecord(k, "unparsable", json.dumps(r).encode())
            yield from _json_good(run, schema, n)
            continue
        yield from _batches(t, chunk[0][0], n)


def _json_record(line: bytes, schema: pa.Schema) -> dict | str:
    """One JSON line as a record of ``schema``, or the reason it is bad."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    if not text.strip():
        return "empty_line"
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            return "unparsable"
        rec = {c: obj.get(c) for c in schema.names}
        for f in schema:
            if pa.types.is_map(f.type) and isinstance(rec[f.name], dict):
                rec[f.name] = list(rec[f.name].items())
        return rec
    except (ValueError, TypeError):
        return "unparsable"


def _csv_options(opts: ReadOptions, schema: pa.Schema | None, bad: list | None) -> dict:
    names = None if opts.csv_header else (schema.names if schema is not None else None)
    read = pacsv.ReadOptions(column_names=names, autogenerate_column_names=names is None and not opts.csv_header)

    def on_invalid(row) -> str:
        bad.append(row)
        return "skip"

    parse = pacsv.ParseOptions(delimiter=opts.csv_delimiter, invalid_row_handler=on_invalid if bad is not None else None)
    conv = pacsv.ConvertOptions(
        column_types=None if schema is None else {f.name: f.type for f in schema},
        include_columns=None if schema is None else list(opts.columns),
        strings_can_be_null=False, quoted_strings_can_be_null=False)
    return {"read_options": read, "parse_options": parse, "convert_options": conv}


def _read_csv(data: bytes, opts: ReadOptions) -> Iterator[tuple[int, pa.RecordBatch | BadRecord]]:
    schema = opts.schema
    bad: list = []
    try:
        t = pacsv.read_csv(io.BytesIO(data), **_csv_options(opts, schema, bad))
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        t = None
    if t is not None and not bad:
        yield from _batches(t.select(list(opts.columns)), 1, opts.batch_rows)
        return
    # a row of the wrong width, or a value of the wrong type: row by row
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    header = 1 if opts.csv_header else 0
    text_opts = ReadOptions(opts.fmt, opts.columns, "", False, opts.csv_delimiter)
    names = schema.names
    good: list[dict] = []
    first = 1
    body = [x for x in lines[header:] if x.strip()]  # blank lines are no records (as in pyarrow's reader)
    for k, line in enumerate(body, start=1):
        rec = _csv_record(line, names, schema, text_opts)
        if isinstance(rec, str):
            if good:
                yield from _batches(pa.Table.from_pylist(good, _project(schema, list(opts.columns))), first, opts.batch_rows)
                good = []
            yield k, BadRecord(k, rec, line)
            first = k + 1
        else:
            good.append(rec)
    if good:
        yield from _batches(pa.Table.from_pylist(good, _project(schema, list(opts.columns))), first, opts.batch_rows)


def _csv_record(line: bytes, names: list[str], schema: pa.Schema, opts: ReadOptions) -> dict | str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    if not line.strip():
        return "empty_line"
    strings = pa.schema([pa.field(n, pa.string()) for n in names])
    bad: list = []
    try:
        t = pacsv.read_csv(io.BytesIO(line + b"\n"), **_csv_options(opts, strings, bad))
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return "unparsable"
    if bad or t.num_rows != 1:
        return "wrong_field_count"
    rec = {}
    for c in opts.columns:
        v = t.column(c)
        typ = schema.field(c).type
        try:
            cast = v if pa.types.is_string(typ) else pc.cast(pc.if_else(pc.equal(v, ""), None, v), typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return "unparsable"
        rec[c] = cast[0].as_py()
    return rec
