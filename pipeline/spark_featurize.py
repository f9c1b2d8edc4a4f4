"""The featurize job on Spark: the only module of ``pipeline`` that imports pyspark.

Spark schedules the tasks, retries them and runs speculative copies; it never carries the data.
Each task reads its byte ranges itself (pyarrow filesystems), parses and hashes them in a
compiled kernel, and writes one Parquet file and its group map into a directory private to its
attempt, inside a hidden sibling of the output (``.NAME.attempts-RUN``, ``pipeline.artifacts``).
The executors merge the accepted attempts' group maps (elementwise minimum, ``pipeline.groups``).
The driver then builds the whole new dataset in its staging sibling (``.NAME.tmp-RUN``: the
accepted attempts' files, the merged group map, the manifest last), retires the attempts'
directory (``artifacts.retire_attempts``: no attempt still running can write into the output)
and swaps the dataset in with ``pipeline.artifacts.replace_dir``: the old dataset stays whole
until the new one is complete on disk. It runs on a classic session and on Spark Connect alike
(``pipeline.spark_tasks``). Before any Spark work the output is
checked (``pipeline.artifacts.check_target``): a missing path, an empty directory or, with
``featurize.overwrite``, an earlier dataset. A failed run leaves the old output untouched.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from dataclasses import asdict, replace

import numpy as np

from terascale.pipeline import artifacts, fsutil, groups, spark_compat, spark_tasks, tokendict
from terascale.pipeline.blocks import Piece, align_range
from terascale.pipeline.featurize_task import (
    MalformedInput,
    TaskOptions,
    format_task_times,
    run_task,
    task_times,
)
from terascale.pipeline.manifest import MANIFEST, QUARANTINE_DIR, build_manifest, merge_inputs
from terascale.pipeline.plan import assign, output_files, plan_ranges
from terascale.pipeline.redact import redact_text
from terascale.pipeline.spark_errors import spark_error_summary as task_error_summary
from terascale.pipeline.spec import FeatureSpec

log = logging.getLogger("terascale.featurize")
OVERWRITE_FLAG = "--overwrite (or featurize.overwrite: true)"


class FeaturizeError(RuntimeError):
    """The featurize job failed; the message says where."""


class EmptyInputError(FeaturizeError, fsutil.InputError):
    """The inputs hold no line, or no line became a row (``featurize.allow_empty`` is off)."""


def check_not_empty(per_input: list[dict], allow_empty: bool) -> None:
    """Refuse a dataset of 0 rows unless ``allow_empty``; ``per_input``: ``merge_inputs`` records
    (or, before Spark, ``{"path", "bytes"}`` records: every input has 0 bytes, so no line)."""
    if allow_empty:
        return
    if all("bytes" in p for p in per_input):
        if any(p["bytes"] for p in per_input):
            return
        names = ", ".join(p["path"] for p in per_input)
        raise EmptyInputError(f"featurize: the inputs hold no line ({len(per_input)} files of 0 bytes: {names}); "
                              "set featurize.allow_empty=true to commit an empty dataset")
    if sum(p["rows"] for p in per_input) > 0:
        return
    lines = sum(p["lines"] for p in per_input)
    detail = "; ".join(f"{p['path']}: {p['lines']} lines, {p['quarantined']} quarantined"
                       + (f" ({', '.join(f'{k}={v}' for k, v in sorted(p['by_reason'].items()))})" if p["by_reason"] else "")
                       for p in per_input)
    what = "the inputs hold no line" if lines == 0 else f"none of the {lines} lines became a row"
    raise EmptyInputError(f"featurize: {what} ({detail}); nothing committed; set featurize.allow_empty=true "
                          "to commit an empty dataset")


def _attempt_tag() -> str:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return uuid.uuid4().hex[:12]
    return f"a{ctx.attemptNumber()}-t{ctx.taskAttemptId()}"  # taskAttemptId is unique per SparkContext


def _pieces(spark, ranges, files) -> dict:
    """Align the cut ranges to line starts (on the executors) and give each piece its first line."""
    sizes = {f.uri: f.size for f in files}
    cut = [r for r in ranges if r.cuts > 1]
    aligned = {}
    if cut:
        args = [(r.uri, r.start, r.end, sizes[r.uri]) for r in cut]
        out = spark_tasks.run_tasks(spark, args, lambda _, it: (align_range(*a) for a in it),
                                    f"terascale featurize: align {len(cut)} byte ranges")
        aligned = {(r.uri, r.cut_index): a for r, a in zip(cut, out, strict=True)}
    pieces = {}
    line_base: dict[str, int] = {}
    for r in sorted(ranges, key=lambda r: (r.uri, r.cut_index)):
        if r.cuts == 1:
            pieces[(r.uri, r.cut_index)] = Piece(r.uri, 0, -1 if r.gzip else r.end, 1, r.gzip)
            continue
        a, b, newlines = aligned[(r.uri, r.cut_index)]
        first = line_base.get(r.uri, 1)
        line_base[r.uri] = first + newlines
        pieces[(r.uri, r.cut_index)] = Piece(r.uri, a, b, first, False)
    return pieces


def _malformed_message(err: BaseException) -> str | None:
    text = str(err)
    i = text.find(MalformedInput.MARKER)
    if i < 0:
        return None
    line = text[i + len(MalformedInput.MARKER):].split("\n", 1)[0].strip()
    return line


def _glob_base(pattern: str) -> str:
    """The literal directory part of an input pattern (the whole path when it has no glob)."""
    parts = fsutil.normalize(pattern).split("/")
    first = next((i for i, p in enumerate(parts) if set("*?[") & set(p)), len(parts))
    return "/".join(parts[:first])


def check_output(inputs: list[str], output: str, overwrite: bool) -> None:
    """Refuse, before any Spark work, an output that is not a new, empty or (with ``overwrite``)
    earlier dataset, or that overlaps an input."""
    for p in inputs:
        base = _glob_base(p)
        # a glob lists only the files it matches: an output below its literal part is not read back
        artifacts.check_apart(output, "--output", {"the input": base}, inside=base == fsutil.normalize(p))
    artifacts.check_target(output, artifacts.DATASET, overwrite, "--output", OVERWRITE_FLAG)


def run_featurize(spark, inputs: list[str], output: str, spec: FeatureSpec, fconf) -> dict:
    """Featurize ``inputs`` into ``output``; return the manifest. Raises FeaturizeError."""
    t0 = time.perf_counter()
    check_output(inputs, output, fconf.overwrite)
    files = fsutil.expand_inputs(inputs)
    out = fsutil.normalize(output)
    n_tasks = output_files(files, spec.format, fconf.partitions, fconf.target_file_mb, spark_tasks.parallelism(spark))
    ranges = plan_ranges(files, n_tasks)
    log.info("featurize: %d input files, %d bytes, %d ranges -> %d tasks", len(files),
             sum(f.size for f in files), len(ranges), n_tasks)
    check_not_empty([{"path": f.uri, "bytes": f.size} for f in files], fconf.allow_empty)  # before any Spark job
    pieces = _pieces(spark, ranges, files)
    plan = [[pieces[(r.uri, r.cut_index)] for r in task] for task in assign(ranges, n_tasks)]
    plan = [[p for p in task if p.gzip or p.end > p.start] for task in plan]  # drop empty aligned pieces
    opts = TaskOptions(
        max_line_bytes=fconf.max_line_bytes, block_bytes=fconf.block_mb << 20,
        on_error=fconf.on_error, compression=fconf.compression,
        parquet_encoding=spark_compat.parquet_encoding(fconf.parquet_encoding, spark.version),
        negative_rate=float(fconf.negative_rate), sample_seed=int(fconf.sample_seed),
        token_dictionary=bool(fconf.token_dictionary), dictionary_per_bucket=int(fconf.dictionary_per_bucket),
        dictionary_max_buckets=int(fconf.dictionary_max_buckets),
    )
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    root = artifacts.staging_path(out, run_id)  # the new dataset, complete before it replaces the old
    staging = artifacts.open_attempts(out, run_id)  # the task attempts' private directories
    payload = [(i, [p.to_json() for p in task]) for i, task in enumerate(plan)]

    fail_task = fconf.inject_fail_task
    slow_task, slow_s = fconf.inject_slow_task, fconf.inject_slow_s

    def task_fn(_, items):
        for i, pieces_json in items:
            tag = _attempt_tag()
            attempt_dir = fsutil.join(staging, f"task-{i:05d}-{tag}")
            o = replace(opts, inject_fail=(i == fail_task and tag.startswith("a0-")))
            result = run_task(i, [Piece.from_json(p) for p in pieces_json], spec, o, attempt_dir)
            if i == slow_task and tag.startswith("a0-"):
                time.sleep(slow_s)  # chaos drill: a straggler whose output is complete
            yield result

    results = collect_tasks(spark, out, run_id, payload, task_fn, f"terascale featurize: {len(files)} files -> {out}")
    times = task_times(results)  # the bench reads the record's task_times
    log.info("featurize: %s", format_task_times(times), extra={"task_times": times})
    try:
        check_not_empty(merge_inputs(results, [f.uri for f in files]), fconf.allow_empty)
    except EmptyInputError:
        discard(out, run_id)
        raise
    try:
        group_map = _merge_groups(spark, spec, results)
    except Exception as e:  # noqa: BLE001 - as above
        discard(out, run_id)
        raise FeaturizeError(f"featurize failed merging the group maps: {task_error_summary(e)}") from e
    try:
        fsutil.makedirs(root)  # the new dataset's directory: the merged dictionary goes there first
        tokens = _merge_tokens(root, opts, results)
    except Exception as e:  # noqa: BLE001 - a failed merge leaves no dataset, like any other failure
        discard(out, run_id)
        raise FeaturizeError(f"featurize failed merging the token dictionaries: {e}") from e
    try:
        manifest = _commit(out, root, spec, [f.uri for f in files], results, time.perf_counter() - t0, asdict(opts),
                           group_map, tokens, overwrite=fconf.overwrite, run_id=run_id)
    except Exception:
        discard(out, run_id)
        raise
    return manifest


def discard(out: str, run_id: str) -> None:
    """A failed run's staging directory and task attempts, deleted (``out`` stays as it was)."""
    fsutil.delete(artifacts.staging_path(out, run_id))
    artifacts.retire_attempts(out, run_id)


def collect_tasks(spark, out: str, run_id: str, items, task_fn, description: str) -> list[dict]:
    """The featurize tasks' results (``items``: a list, one task per item, run by ``task_fn``
    as ``spark_tasks.run_tasks`` runs it; or a DataFrame of the tasks' rows), on a classic session
    once every attempt has ended; on failure the run's directories are deleted (:func:`discard`)
    and the error is a FeaturizeError naming the malformed line or summarizing Spark's error."""
    try:
        if task_fn is None:
            return spark_tasks.collect(spark, items, redact_text(description), settle=True)
        return spark_tasks.run_tasks(spark, items, task_fn, redact_text(description), settle=True)
    except Exception as e:  # noqa: BLE001 - Spark wraps task errors in Py4J/Spark exceptions
        discard(out, run_id)
        msg = _malformed_message(e)
        if msg is not None:
            raise FeaturizeError(msg) from None
        raise FeaturizeError(f"featurize failed: {task_error_summary(e)}") from e


DRIVER_MERGE_BYTES = 64 << 20  # group maps this large in all are merged on the driver


def _merge_groups(spark, spec: FeatureSpec, results: list[dict]) -> np.ndarray | None:
    """The elementwise minimum of the tasks' group maps (each 2^bits bytes).

    Maps of at most DRIVER_MERGE_BYTES in all are read and merged by the driver (a Spark job
    costs a few tenths of a second; ten 4 MiB maps, some hundredths). Larger ones are merged on
    the executors: each of at most ``parallelism`` tasks reduces its share of the maps, and the
    driver combines their partial maps.
    """
    if spec.bits > groups.GROUPS_MAX_BITS:
        return None
    paths = [r["groups_path"] for r in sorted(results, key=lambda r: r["task"]) if r["groups_path"]]
    n_buckets = 1 << spec.bits
    if not paths:  # no task wrote a row
        return groups.new_map(spec.bits)
    if len(paths) * n_buckets <= DRIVER_MERGE_BYTES:
        return functools.reduce(groups.merge_maps, (groups.load_map(p, n_buckets) for p in paths))
    n = min(len(paths), max(1, spark_tasks.parallelism(spark)))

    def merge(_, it):
        acc = None
        for p in it:
            m = groups.load_map(p, n_buckets)
            acc = m if acc is None else groups.merge_maps(acc, m)
        if acc is not None:
            yield acc

    return functools.reduce(groups.merge_maps, spark_tasks.run_tasks(
        spark, paths, merge, f"terascale featurize: merge {len(paths)} group maps", n=n))


def _merge_tokens(root: str, opts: TaskOptions, results: list[dict]) -> dict | None:
    """The accepted attempts' token dictionaries merged into the new dataset ``root``
    (``pipeline.tokendict``)."""
    if not opts.token_dictionary:
        return None
    paths = [r["dictionary_path"] for r in sorted(results, key=lambda r: r["task"]) if r.get("dictionary_path")]
    entry = tokendict.merge_files(paths, fsutil.join(root, tokendict.TOKENS_FILE), opts.dictionary_per_bucket,
                                  opts.dictionary_max_buckets)
    return {"path": tokendict.TOKENS_FILE, **entry}


def _commit(out: str, root: str, spec: FeatureSpec, inputs: list[str], results: list[dict],
            seconds: float, options: dict, group_map: np.ndarray | None = None, tokens: dict | None = None,
            overwrite: bool = False, run_id: str = "", extra: dict | None = None) -> dict:
    """Build the dataset in the staging directory ``root`` (the token dictionary, when asked for,
    is already there) and swap it in at ``out``; ``extra``: more manifest entries (``time``)."""
    fsutil.makedirs(root)
    files, qfiles = [], []
    results = sorted(results, key=lambda r: r["task"])
    for r in results:
        name = f"part-{r['task']:05d}.parquet"
        if r["rows"] > 0:
            fsutil.move(r["data_path"], fsutil.join(root, name))
            files.append({
                "path": name, "rows": r["rows"], "nnz": r["nnz"], "bytes": r["bytes"],
                "positives": r["positives"], "weight_sum": r["weight_sum"], "rows_with_values": r["multi_rows"],
            })
        if r["quarantine_path"]:
            fsutil.makedirs(fsutil.join(root, QUARANTINE_DIR))
            fsutil.move(r["quarantine_path"], fsutil.join(root, QUARANTINE_DIR, name))
            qfiles.append(f"{QUARANTINE_DIR}/{name}")
    artifacts.retire_attempts(out, run_id)  # rejected and speculative attempts
    group_entry, distinct = None, None
    if group_map is not None:
        groups.write_map(fsutil.join(root, groups.GROUPS_FILE), group_map)  # before the manifest
        distinct = groups.bucket_count(group_map)
        group_entry = {"path": groups.GROUPS_FILE, "names": groups.group_names(spec), "buckets": distinct}
    manifest = build_manifest(spec, inputs, files, qfiles, merge_inputs(results, inputs), distinct, seconds, options,
                              groups=group_entry)
    if tokens is not None:  # the token dictionary (pipeline.tokendict), in place before the manifest
        manifest["dictionary"] = tokens
    manifest.update(extra or {})
    fsutil.write_json_atomic(fsutil.join(root, MANIFEST), manifest)
    # checked again: the output may have changed while the tasks ran
    artifacts.check_target(out, artifacts.DATASET, overwrite, "--output", OVERWRITE_FLAG)
    artifacts.replace_dir(root, out, run_id or uuid.uuid4().hex[:10])
    log.info("featurize: committed %d files, %d rows, %d quarantined -> %s", len(files), manifest["rows"],
             manifest["quarantine"]["rows"], out)
    return manifest
