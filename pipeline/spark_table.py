"""The featurize job for tables (``featurize.format = table``) on Spark.

Two ways in, one task and one commit:

- **Files** (``--input`` with ``featurize.input_format`` parquet, orc, json or csv) and a spec
  without expressions: each task reads its pieces itself with pyarrow (``pipeline.table_sources``:
  Parquet row groups split across tasks, ORC, JSON and CSV files whole), as the text
  formats do; Spark only schedules, retries and speculates.
- **Spark reads** (a catalog table, ``--table db.logs --where "dt = '2026-11-27'"``, or a spec
  with Spark SQL expressions): Spark reads and projects the rows (label, weight, each field as
  a column or an expression, and the record's file), and ``mapInArrow`` hands each partition's
  batches to the same task.

Either way a task writes its Parquet file, quarantine and group map into a directory private to
its attempt inside the attempts' sibling of the output, the driver (on a classic session) waits
until every attempt has ended (``pipeline.spark_settle``) and commits the accepted ones exactly as for text logs
(``pipeline.spark_featurize._commit``): the same manifest, row accounting per input file, atomic
replacement. The schema is checked on the driver before any Spark job: a missing column, or a
type its field cannot take, is an error naming both (exit code 2). Quantile boundaries are
learned first, by a job that reads only those columns, and written into the spec.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, replace

import numpy as np
import pyarrow as pa

from terascale.pipeline import artifacts, fsutil, spark_compat, spark_tasks, time_split
from terascale.pipeline.featurize_task import TaskOptions, format_task_times, task_times
from terascale.pipeline.manifest import merge_inputs
from terascale.pipeline.plan import plan_ranges
from terascale.pipeline.spark_errors import spark_error_summary
from terascale.pipeline.spark_featurize import (
    EmptyInputError,
    FeaturizeError,
    _attempt_tag,
    _commit,
    _merge_groups,
    _pieces,
    check_not_empty,
    collect_tasks,
    discard,
)
from terascale.pipeline.spec import FeatureSpec
from terascale.pipeline.table_fields import as_float64
from terascale.pipeline.table_kernel import LABEL, WEIGHT
from terascale.pipeline.table_schema import SchemaError, check_schema
from terascale.pipeline.table_sources import (
    ReadOptions,
    TablePiece,
    adapt_inferred,
    assign,
    encode_schema,
    file_schema,
    parse_ddl,
    plan_pieces,
    read_piece,
    task_count,
)
from terascale.pipeline.table_task import TIME, Columns, run_table_task

log = logging.getLogger("terascale.featurize")
SOURCE = "__source"
QUANTILE_POINTS = 2001  # order statistics a task returns per quantile column


def needs_spark_read(spec: FeatureSpec, table: str, where: str) -> bool:
    """A catalog table, a row filter or an expression: Spark reads the rows."""
    return bool(table or where or spec.table.has_expressions)


def _typed_columns(spec: FeatureSpec, cols: Columns) -> list[tuple[str, str, str]]:
    t = spec.table
    out = [("featurize.label" if not t.label_expr else "featurize.label_expr", cols.label, "label")]
    if cols.weight:
        out.append(("featurize.weight" if not t.weight_expr else "featurize.weight_expr", cols.weight, "weight"))
    for i, (f, (_, col)) in enumerate(zip(t.fields, cols.fields, strict=True)):
        out.append((f"featurize.columns[{i}] ({f.name}, {f.kind})", col, f.kind))
    if cols.time:
        out.append(("featurize.time_column", cols.time, "time"))
    return out


def _time_entry(column: str, results: list[dict]) -> dict:
    """The manifest's ``time`` entry (``pipeline.time_split``): the column, its unit and the
    quantiles of the written rows' times, merged from the tasks' order statistics."""
    units = sorted({u for r in results for u in r.get("time_units", ())})
    if len(units) > 1:
        raise FeaturizeError(f"featurize.time_column {column!r}: the inputs hold it as {' and as '.join(units)} "
                             "(timestamps, dates and integers are not comparable); cast it in every input alike")
    summaries = [tuple(r["time_points"]) for r in results]
    return {"column": column, "unit": units[0] if units else "value", "rows": sum(n for _, n in summaries),
            "quantiles": time_split.merge_points(summaries)}


def run_table_featurize(spark, inputs: list[str], output: str, spec: FeatureSpec, fconf,
                        table: str = "", where: str = "") -> dict:
    """Featurize a table into ``output``; return the manifest. Raises FeaturizeError,
    SchemaError (before any Spark job) or an input error."""
    t0 = time.perf_counter()
    out = fsutil.normalize(output)
    opts = TaskOptions(
        max_line_bytes=fconf.max_line_bytes, block_bytes=fconf.block_mb << 20, on_error=fconf.on_error,
        compression=fconf.compression, parquet_encoding=spark_compat.parquet_encoding(fconf.parquet_encoding, spark.version),
        negative_rate=float(fconf.negative_rate), sample_seed=int(fconf.sample_seed),
    )
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    root = artifacts.staging_path(out, run_id)
    staging = artifacts.open_attempts(out, run_id)
    try:
        if needs_spark_read(spec, table, where):
            spec, results, sources = _spark_read(spark, inputs, table, where, spec, fconf, opts, staging, out, run_id)
        else:
            spec, results, sources = _file_read(spark, inputs, spec, fconf, opts, staging, out, run_id)
    except BaseException:
        discard(out, run_id)
        raise
    times = task_times(results)
    log.info("featurize: %s", format_task_times(times), extra={"task_times": times})
    try:
        check_not_empty(merge_inputs(results, sources), fconf.allow_empty)
        group_map = _merge_groups(spark, spec, results)
    except EmptyInputError:
        discard(out, run_id)
        raise
    except Exception as e:  # noqa: BLE001 - Spark wraps task errors
        discard(out, run_id)
        raise FeaturizeError(f"featurize failed merging the group maps: {spark_error_summary(e)}") from e
    options = {**asdict(opts), "input_format": fconf.input_format, "table": table, "where": where}
    extra = {"time": _time_entry(fconf.time_column, results)} if fconf.time_column else None
    try:
        return _commit(out, root, spec, sources, results, time.perf_counter() - t0, options, group_map, None,
                       overwrite=fconf.overwrite, run_id=run_id, extra=extra)
    except Exception:
        discard(out, run_id)
        raise


# ---------------------------------------------------------------------------------------------
# Files read by the tasks


def _file_read(spark, inputs, spec, fconf, opts, staging, out, run_id):
    parallelism = spark_tasks.parallelism(spark)
    files = fsutil.expand_inputs(inputs)
    check_not_empty([{"path": f.uri, "bytes": f.size} for f in files], fconf.allow_empty)
    cols = Columns.of(spec, time_column=fconf.time_column)
    declared = parse_ddl(fconf.schema) if fconf.schema else None
    read = ReadOptions(fconf.input_format, cols.read, csv_header=fconf.csv_header, csv_delimiter=fconf.csv_delimiter)
    if fconf.input_format in ("json", "csv"):
        kinds = {col: kind for _, col, kind in _typed_columns(spec, cols)}
        schema = declared if declared is not None else adapt_inferred(file_schema(files[0].uri, read), kinds)
        read = replace(read, schema_b64=encode_schema(schema))
        check_schema(spec.table, schema, _typed_columns(spec, cols), files[0].uri)
    else:
        for f in files:  # Parquet and ORC carry their schema: every file is checked
            check_schema(spec.table, file_schema(f.uri, read), _typed_columns(spec, cols), f.uri)
    pieces = plan_pieces(files, fconf.input_format, max(parallelism, 1) * 4)
    n_tasks = task_count(pieces, fconf.partitions, fconf.target_file_mb, parallelism)
    if fconf.input_format == "json":  # line-aligned byte ranges, as for text logs: a task holds its range only
        pieces = _json_ranges(spark, files, n_tasks)
    plan = assign(pieces, n_tasks)
    log.info("featurize: %d %s files, %d pieces -> %d tasks", len(files), fconf.input_format, len(pieces), len(plan))
    spec = _learn_file_quantiles(spark, spec, cols, read, plan)
    payload = [(i, [p.to_json() for p in task]) for i, task in enumerate(plan)]
    fail_task, slow_task, slow_s = fconf.inject_fail_task, fconf.inject_slow_task, fconf.inject_slow_s

    def task_fn(_, items):
        for i, pieces_json in items:
            tag = _attempt_tag()
            ps = [TablePiece.from_json(p) for p in pieces_json]
            batches = ((p.uri, row, b) for p in ps for row, b in read_piece(p, read))
            o = replace(opts, inject_fail=(i == fail_task and tag.startswith("a0-")))
            result = run_table_task(i, batches, spec, cols, o, fsutil.join(staging, f"task-{i:05d}-{tag}"),
                                    expected_sources=[p.uri for p in ps])
            if i == slow_task and tag.startswith("a0-"):
                time.sleep(slow_s)
            yield result

    results = collect_tasks(spark, out, run_id, payload, task_fn,
                            f"terascale featurize: {len(files)} {fconf.input_format} files -> {out}")
    return spec, results, [f.uri for f in files]


def _json_ranges(spark, files, n_tasks: int) -> list[TablePiece]:
    """JSON-lines files cut into about ``n_tasks`` byte ranges aligned to line starts, each with
    the number of its first line (``pipeline.plan``'s ranges, aligned on the executors as the
    text formats' are); a gzip'd file stays whole."""
    ranges = plan_ranges(files, n_tasks)
    out = []
    for p in _pieces(spark, ranges, files).values():
        whole = p.gzip or p.end < 0
        out.append(TablePiece(p.uri, "json", 0 if whole else p.start, -1 if whole else p.end - p.start,
                              p.first_line, next(f.size for f in files if f.uri == p.uri) if whole else p.end - p.start))
    return sorted((q for q in out if q.count != 0), key=lambda q: (q.uri, q.first))


def _quantile_fields(spec: FeatureSpec) -> list:
    """The quantile fields whose boundaries are still to learn (a spec taken from a dataset or a
    model, ``featurize.spec_from``, has them)."""
    return [f for f in spec.table.fields if f.bucketing == "quantile" and not f.boundaries]


def summary_points(x: np.ndarray, k: int = QUANTILE_POINTS) -> tuple[list[float], int]:
    """``k`` evenly spaced order statistics of the finite values ``x`` and their count."""
    pts, n = time_split.order_statistics(x[np.isfinite(x)], k)
    return pts.tolist(), n


def boundaries_from(summaries: list[tuple[list[float], int]], buckets: int) -> list[float]:
    """The ``buckets - 1`` inner quantiles of the union of the tasks' summaries (each point
    weighted by its task's count / points), distinct and ascending."""
    q = time_split.weighted_quantiles(summaries, np.arange(1, buckets) / buckets, np.float64)
    if q is None:
        return [0.0]
    b = np.unique(q)
    return b.tolist() or [float(min(min(p) for p, n in summaries if n))]


def _learn_file_quantiles(spark, spec: FeatureSpec, cols: Columns, read: ReadOptions, plan) -> FeatureSpec:
    qf = _quantile_fields(spec)
    if not qf:
        return spec
    src = dict(cols.fields)
    qcols = tuple(dict.fromkeys(src[f.name] for f in qf))
    rd = replace(read, columns=qcols)
    payload = [[p.to_json() for p in task] for task in plan]

    def summarize(_, items):
        for pieces_json in items:
            got: dict[str, list] = {c: [] for c in qcols}
            for p in pieces_json:
                for _, b in read_piece(TablePiece.from_json(p), rd):
                    if isinstance(b, pa.RecordBatch):
                        for c in qcols:
                            got[c].append(np.asarray(as_float64(b.column(c)).fill_null(np.nan)
                                                     .to_numpy(zero_copy_only=False)))
            yield {c: summary_points(np.concatenate(v) if v else np.zeros(0)) for c, v in got.items()}

    try:
        parts = spark_tasks.run_tasks(spark, payload, summarize, f"terascale featurize: quantiles of {', '.join(qcols)}")
    except Exception as e:  # noqa: BLE001
        raise FeaturizeError(f"featurize failed learning quantile boundaries: {spark_error_summary(e)}") from e
    learned = {f.name: boundaries_from([p[src[f.name]] for p in parts], f.quantiles) for f in qf}
    log.info("featurize: quantile boundaries learned for %s", ", ".join(learned))
    return replace(spec, table=spec.table.with_boundaries(learned))


# ---------------------------------------------------------------------------------------------
# Rows read by Spark


def _spark_frame(spark, inputs, table, where, fconf):
    if table:
        df = spark.table(table)
    else:
        files = fsutil.expand_inputs(inputs)
        reader = spark.read.format(fconf.input_format)
        if fconf.schema:
            reader = reader.schema(fconf.schema)
        if fconf.input_format == "csv":
            reader = reader.option("header", str(fconf.csv_header).lower()).option("sep", fconf.csv_delimiter)
            if not fconf.schema:
                reader = reader.option("inferSchema", "true")
        df = reader.load([f.uri for f in files])
    return df.where(where) if where else df


def _projection(spec: FeatureSpec, time_column: str = ""):
    from pyspark.sql import functions as F

    t = spec.table

    def pick(expr: str, column: str):
        return F.expr(expr) if expr else F.col(f"`{column}`")

    cols = [pick(t.label_expr, t.label).alias(LABEL)]
    if t.weight or t.weight_expr:
        cols.append(pick(t.weight_expr, t.weight).alias(WEIGHT))
    cols += [pick(f.expr, f.source).alias(f.name) for f in t.fields]
    if time_column:
        cols.append(F.col(f"`{time_column}`").alias(TIME))
    cols.append(F.input_file_name().alias(SOURCE))  # last: the tasks split it off
    return cols


def _spark_read(spark, inputs, table, where, spec, fconf, opts, staging, out, run_id):
    from pyspark.errors import AnalysisException

    what = f"table {table}" if table else f"{fconf.input_format} input"
    try:
        df = _spark_frame(spark, inputs, table, where, fconf).select(*_projection(spec, fconf.time_column))
        schema = spark_compat.arrow_schema(df.schema)
    except AnalysisException as e:
        raise SchemaError(f"featurize: {what}: {str(e).splitlines()[0]}") from None
    cols = Columns.of(spec, exprs=True, time_column=fconf.time_column)
    check_schema(spec.table, schema, _typed_columns(spec, cols), what)
    qf = _quantile_fields(spec)
    if qf:
        names = [f.name for f in qf]
        probs = {f.name: [k / f.quantiles for k in range(1, f.quantiles)] for f in qf}
        learned = {}
        for n in names:
            got = df.select(n).na.drop().approxQuantile(n, probs[n], 1e-4)
            learned[n] = sorted(set(float(x) for x in got)) or [0.0]
        spec = replace(spec, table=spec.table.with_boundaries(learned))
    fallback = table or "spark"
    fail_task, slow_task, slow_s = fconf.inject_fail_task, fconf.inject_slow_task, fconf.inject_slow_s
    tspec = spec

    def task_fn(batches):
        from pyspark import TaskContext

        pid = TaskContext.get().partitionId()
        tag = _attempt_tag()

        def items():
            seen: dict[str, int] = {}
            for b in batches:
                src = b.column(SOURCE).to_numpy(zero_copy_only=False)
                body = b.drop_columns([SOURCE]) if hasattr(b, "drop_columns") else pa.RecordBatch.from_arrays(
                    b.columns[:-1], names=b.schema.names[:-1])
                cuts = np.flatnonzero(src[1:] != src[:-1]) + 1
                for s, e in zip(np.r_[0, cuts], np.r_[cuts, len(src)], strict=True):
                    name = str(src[s]) or fallback
                    first = seen.get(name, 0) + 1
                    seen[name] = first - 1 + int(e - s)
                    yield name, first, body.slice(int(s), int(e - s))

        o = replace(opts, inject_fail=(pid == fail_task and tag.startswith("a0-")))
        result = run_table_task(pid, items(), tspec, cols, o, fsutil.join(staging, f"task-{pid:05d}-{tag}"),
                                key_salt=f"#{pid}")
        if pid == slow_task and tag.startswith("a0-"):
            time.sleep(slow_s)
        yield pa.RecordBatch.from_pydict({"result": [json.dumps(result)]})

    mapped = spark_compat.map_in_arrow(df, task_fn, "result string", "featurize through Spark (a table, a filter, an expression)")
    rows = collect_tasks(spark, out, run_id, mapped, None, f"terascale featurize: {what} -> {out}")
    results = [json.loads(r["result"]) for r in rows]
    sources = sorted({u for r in results for u in r["inputs"]})
    return spec, results, sources
