"""The ``terascale`` command line: one entry point, one subcommand per job.

Every job subcommand takes ``--conf FILE`` (repeatable, later files win) and repeatable
``--set section.key=value``; the configuration is validated before any Spark work starts and the
resolved configuration is logged once. Exit codes: 0 success, 1 the job failed, 2 bad usage or
configuration, including an output path the job refuses to write (``pipeline.artifacts``: it
holds something else than the job's own artifact, or an earlier one without ``--overwrite``),
checked before the Spark session starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from terascale.jobs.config import ConfigError, load_config, render_yaml
from terascale.jobs.memory_accounting import memory_line
from terascale.jobs.steps import (
    check_metrics_out,
    evaluate,
    featurize,
    featurize_summary,
    metrics_summary,
    tracking_line,
    train,
    train_summary,
)
from terascale.pipeline.artifacts import OutputError
from terascale.pipeline.redact import RedactingFormatter, redact_text

log = logging.getLogger("terascale")


#: The exit status of every command (the reference page is generated from this table).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_CODES = {
    EXIT_OK: "done",
    EXIT_FAILED: "the job failed: bad input data (`input error`: a missing, truncated or corrupt data file, "
                 "empty input; `failed`: a malformed line with `featurize.on_error=fail` or in `terascale score`), "
                 "a training run that failed on every attempt or with an error a retry would only repeat "
                 "(divergence, no usable checkpoint), a quality gate that did not pass",
    EXIT_USAGE: "bad usage or configuration, checked before any Spark work starts: an unknown flag or "
                "configuration key, a value out of range, a cross-check between keys, a run that does not fit "
                "in memory (the preflight), or an output path the job refuses to write (it holds something else "
                "than the job's own artifact, or an earlier one without `--overwrite`)",
}


class UsageError(ValueError):
    """Bad command-line arguments (exit code 2)."""


def _setup_logging(verbose: bool) -> None:
    """terascale's own logger and handler: spark-submit's Python may have configured the root."""
    root = logging.getLogger("terascale")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not any(getattr(h, "_terascale", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        h._terascale = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.propagate = False


def _add_overwrite_arg(p: argparse.ArgumentParser, what: str, key: str | None) -> None:
    conf = f" (or {key}: true in the configuration)" if key else ""
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace {what} left by an earlier run, atomically{conf}; anything else there is always refused")


def _add_conf_args(p: argparse.ArgumentParser, example: str = "featurize.bits=22") -> None:
    p.add_argument("--conf", action="append", default=[], metavar="FILE", help="YAML configuration file (repeatable)")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                   help=f"override one parameter, e.g. --set {example} (repeatable)")


def _add_remote_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote", metavar="URL", help="run on this Spark Connect server (sc://host:port), as "
                   "--set spark.remote=URL (default: the SPARK_REMOTE environment variable, if set)")


def _say(msg: str) -> None:
    """A line on stdout, paths' credentials redacted (``pipeline.redact``)."""
    print(redact_text(msg))


def _resolve(args) -> object:
    cfg = load_config(args.conf, args.sets + ([f"spark.remote={args.remote}"] if getattr(args, "remote", None) else []))
    section = getattr(cfg, args.command, None)
    if getattr(args, "overwrite", False) and hasattr(section, "overwrite"):
        import dataclasses

        cfg = dataclasses.replace(cfg, **{args.command: dataclasses.replace(section, overwrite=True)})
    log.info("resolved configuration (secrets shown as ***):\n%s", render_yaml(cfg, with_help=False).rstrip())
    return cfg


# ---------------------------------------------------------------------------------------------
# subcommands


def cmd_generate(args) -> int:
    from terascale.pipeline.generate import generate_clicklogs

    if args.kind == "adlog":
        return _generate_adlog(args)
    if args.rows < 0:
        raise UsageError(f"--rows {args.rows}: must be >= 0")
    if args.files < 1:
        raise UsageError(f"--files {args.files}: must be >= 1")
    if not 0.0 <= args.malformed_rate <= 1.0:
        raise UsageError(f"--malformed-rate {args.malformed_rate}: must be in [0, 1]")
    if args.positive_rate is None:
        args.positive_rate = 0.25
    if not 0.001 <= args.positive_rate <= 0.999:
        raise UsageError(f"--positive-rate {args.positive_rate}: must be in [0.001, 0.999]")
    summary = generate_clicklogs(
        args.out, args.rows, files=args.files, seed=args.seed, malformed_rate=args.malformed_rate,
        with_prob=args.with_prob, compress="gzip" if args.gzip else None, positive_rate=args.positive_rate,
    )
    _say(json.dumps(summary, indent=2, default=str))
    return 0


def _generate_adlog(args) -> int:
    """The ad-log table (``pipeline.gen_adlog``): Parquet and JSON lines, truth.json, and
    adlog.yaml, a featurize configuration for it."""
    import os

    from terascale.pipeline.gen_adlog import ADLOG_SPEC_YAML, write_adlog

    if args.malformed_rate or args.with_prob or args.gzip:
        raise UsageError("--kind adlog: --malformed-rate, --with-prob and --gzip are for Criteo logs")
    rate = 0.05 if args.positive_rate is None else args.positive_rate
    try:
        summary = write_adlog(args.out, args.rows, seed=args.seed, files=args.files, click_rate=rate)
    except (ValueError, FileExistsError) as e:
        raise UsageError(f"generate --kind adlog: {e}") from None
    conf = os.path.join(args.out, "adlog.yaml")
    with open(conf + ".tmp", "w", encoding="utf-8") as f:
        f.write(ADLOG_SPEC_YAML)
    os.replace(conf + ".tmp", conf)
    _say(json.dumps({**summary, "featurize_conf": conf}, indent=2, default=str))
    return 0


def cmd_featurize(args) -> int:
    sets = list(args.sets)
    if args.table is not None:
        sets.append(f"featurize.table={args.table}")
    if args.where is not None:
        sets.append(f"featurize.where={args.where}")
    if args.spec_from is not None:
        sets.append(f"featurize.spec_from={args.spec_from}")
    args.sets = sets
    cfg = _resolve(args)
    if bool(args.input) == bool(cfg.featurize.table):
        raise UsageError("featurize: give --input files or a catalog table (--table, or featurize.table), not both"
                         if args.input else "featurize: give --input files, or --table for a catalog table")
    m = featurize(cfg, args.input or [], args.output)
    what = f"table {cfg.featurize.table}" if cfg.featurize.table else f"{len(m['inputs'])} input files"
    _say(f"featurized {what} -> {args.output}")
    print(featurize_summary(m))
    return 0


def cmd_train(args) -> int:
    from terascale.jobs import tracking
    from terascale.jobs.train_job import check_outputs

    cfg = _warm_start(_resolve(args), args.init_model_if_exists)
    _refuse_served_model(args.model, cfg.train.init_model)
    check_outputs(cfg, args.input, args.model)  # before an MLflow run is created
    run = tracking.start_train(cfg, args.input, args.model)  # None: not tracked (off, or unreachable: warned)
    try:
        meta = train(cfg, args.input, args.model, run.record() if run else None)
    except BaseException:
        tracking.fail_train(run)
        raise
    tracking.finish_train(run, cfg, meta, args.model)
    _say(f"trained {args.model}")
    print(train_summary(meta))
    print(f"  memory             {memory_line(meta)}")
    if line := tracking_line(meta):
        _say(line)
    return 0


def cmd_evaluate(args) -> int:
    cfg = _resolve(args)
    args.model = _model_path(args.model)
    if args.out:
        check_metrics_out(args.out, args.overwrite)
    r = evaluate(cfg, args.input, args.model)
    _say(f"evaluated {args.model} on {args.input}")
    print(metrics_summary(r))
    from terascale.jobs.tracking import log_evaluation

    if run_id := log_evaluation(cfg, args.model, r):  # the model's MLflow run, when tracking is on
        print(f"  mlflow run          {run_id} (metrics logged as eval/*)")
    if args.out:
        from terascale.pipeline.fsutil import write_json_atomic

        check_metrics_out(args.out, args.overwrite)  # again: it may have changed meanwhile
        write_json_atomic(args.out, r)
        _say(f"metrics written to {args.out}")
    return 0


def cmd_predict(args) -> int:
    from terascale.jobs.scoring import check_output, predict
    from terascale.jobs.session import get_spark

    cfg = _resolve(args)
    args.model = _model_path(args.model)
    check_output(args.input, args.model, args.output, cfg.predict.overwrite)  # before the session starts
    m = predict(get_spark(cfg.spark), args.input, args.model, args.output, tuple(cfg.predict.keep_columns),
                cfg.predict.calibration, overwrite=cfg.predict.overwrite)
    _say(f"wrote {m['rows']:,} predictions ({m['column']}) in {len(m['files'])} files -> {args.output}")
    return 0


def cmd_score(args) -> int:
    """Raw lines on stdin -> one score per line on stdout; no Spark (``pipeline.scorer``)."""
    import numpy as np

    from terascale.pipeline.scorer import MalformedLine, Scorer

    if args.chunk_mb < 1:
        raise UsageError(f"--chunk-mb {args.chunk_mb}: must be >= 1")
    for kv in args.sets:  # any other --set would be ignored silently: the model fixes the rest
        key = kv.split("=", 1)[0].strip()
        if key != "predict.calibration":
            raise UsageError(f"--set {key}: terascale score takes only predict.calibration; the feature spec "
                             "and everything else come from the model")
    cfg = load_config(args.conf, args.sets + ([f"spark.remote={args.remote}"] if getattr(args, "remote", None) else []))
    scorer = Scorer.from_model_dir(args.model, cfg.predict.calibration, labeled=not args.no_label)
    stdin, out = sys.stdin.buffer, sys.stdout
    chunk_bytes = args.chunk_mb << 20
    line, bad, carry = 1, 0, b""
    while True:
        data = stdin.read(chunk_bytes)
        if data:
            data = carry + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            block, carry = data[:cut], data[cut:]
        else:
            block, carry = carry, b""
            if not block:
                break
        scores = scorer.predict_block(block, skip_bad=True, first_line=line)
        nan = np.isnan(scores)
        if nan.any() and not args.skip_bad:
            first = int(np.flatnonzero(nan)[0])
            if first:
                out.write("\n".join(map(repr, scores[:first].tolist())) + "\n")
            out.flush()
            scorer.predict_block(block, first_line=line)  # raises MalformedLine naming the line
            raise MalformedLine(line + first, "unknown")  # not reached: the parser rejected the line
        bad += int(nan.sum())
        if scores.shape[0]:
            out.write("\n".join(map(repr, scores.tolist())) + "\n")
        line += scores.shape[0]
        if not data:
            break
    out.flush()
    if bad:
        print(f"terascale score: {bad:,} malformed lines scored as nan (--skip-bad)", file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    from terascale.pipeline.modelinspect import render, top_features

    if args.top < 1:
        raise UsageError(f"--top {args.top}: must be >= 1")
    r = top_features(args.model, args.top, args.names)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _say(render(r))
    return 0


def cmd_report(args) -> int:
    from terascale.jobs.report import build_report

    path = build_report(args.model, args.eval, args.out)
    _say(f"report written to {path}")
    return 0


def cmd_config(args) -> int:
    if args.defaults:
        sys.stdout.write(render_yaml())
        return 0
    cfg = load_config(args.conf, args.sets + ([f"spark.remote={args.remote}"] if getattr(args, "remote", None) else []))
    sys.stdout.write(render_yaml(cfg, with_help=False))
    return 0


def cmd_demo(args) -> int:
    from terascale.jobs.demo import run_demo

    return run_demo(args.workdir, args.rows)


# --- published models: a pointer file names the model in service; gate and publish ----------
# The Airflow DAG (conf/airflow/terascale_daily.py) runs train -> evaluate -> gate -> publish.
# gate and publish read JSON and write one small file: they start no Spark session, so running
# them through spark-submit stays cheap.


def _model_path(path: str) -> str:
    """A model directory unchanged; a pointer file (terascale publish) -> the model it names;
    checked complete (metadata and weights readable) here, before any Spark session starts."""
    from terascale.pipeline.modeldir import ModelError
    from terascale.pipeline.pointer import check_complete, resolve_model

    model = resolve_model(path)
    if model != path:
        log.info("model pointer %s -> %s", path, model)
    try:
        check_complete(model)
    except ModelError as e:
        if model == path:
            raise
        raise ModelError(f"model pointer {path} -> {e}") from None
    return model


def _warm_start(cfg, optional: str | None):
    """train.init_model with pointers followed; --init-model-if-exists only when the path exists."""
    import dataclasses

    from terascale.pipeline import fsutil

    path = cfg.train.init_model
    if optional:
        if path:
            raise UsageError("give either --init-model-if-exists or train.init_model, not both")
        if not fsutil.exists(optional):
            log.warning("no model at %s (nothing published yet?): training from scratch", optional)
            _say(f"no model at {optional}: training from scratch")
            return cfg
        path = optional
    if not path:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_model=_model_path(path)))


def _refuse_served_model(model: str, init_model: str) -> None:
    """A re-run must not overwrite the model it warm-starts from: when that is the published
    model, it would be in service before any gate ran. Write each run to a new directory."""
    from terascale.pipeline import fsutil

    if init_model and fsutil.normalize(init_model).rstrip("/") == fsutil.normalize(model).rstrip("/"):
        raise UsageError(f"--model {model} is the model training warm-starts from (train.init_model "
                         f"or the published pointer): refusing to overwrite it; train into a new directory")


def cmd_gate(args) -> int:
    import math

    from terascale.jobs.quality_gate import run_gate

    if not (math.isfinite(args.max_regression) and args.max_regression >= 0):
        raise UsageError(f"--max-regression {args.max_regression}: must be a finite number >= 0")
    _say(run_gate(args.metrics, args.baseline, args.metric, args.max_regression, args.margin))
    return 0


def cmd_publish(args) -> int:
    from terascale.jobs.quality_gate import metric_value, read_json
    from terascale.pipeline.pointer import publish

    metrics = None
    if args.metrics:
        metrics = read_json(args.metrics, "metrics")
        metric_value(metrics, "logloss", f"metrics {args.metrics}")
    p = publish(args.model, args.pointer, metrics)
    _say(f"published {p['model']} -> {args.pointer} (previous: {p['previous'] or 'none'})")
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from terascale.jobs.quality_gate import MARGINS, METRICS

    p = argparse.ArgumentParser(prog="terascale", description="Large-scale linear learning for click logs on Spark.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="write realistic synthetic click logs (Criteo TSV, or an ad-log table)")
    g.add_argument("--kind", choices=("criteo", "adlog"), default="criteo",
                   help="criteo: Criteo TSV lines; adlog: an ad-log table of its own schema (Parquet and JSON lines, "
                        "rows in time order, with adlog.yaml, a featurize configuration for it)")
    g.add_argument("--rows", type=int, required=True, metavar="N", help="number of lines to write")
    g.add_argument("--out", required=True, metavar="DIR", help="output directory")
    g.add_argument("--files", type=int, default=1, metavar="N", help="number of files, written in parallel")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="random seed: the same seed gives the same lines, whatever --files")
    g.add_argument("--malformed-rate", type=float, default=0.0, metavar="R", help="fraction of malformed lines of every kind")
    g.add_argument("--with-prob", action="store_true", help="also write each line's true click probability")
    g.add_argument("--gzip", action="store_true", help="gzip the files")
    g.add_argument("--positive-rate", type=float, default=None, metavar="P",
                   help="click rate of the planted model (default 0.25 for criteo, as Criteo's public sample; "
                        "0.05 for adlog; raw logs: 0.003-0.03)")
    g.set_defaults(fn=cmd_generate)

    f = sub.add_parser("featurize", help="parse and hash raw click logs into Parquet (on Spark)")
    f.add_argument("--input", nargs="+", metavar="PATH", help="files, directories or globs (local, hdfs://, s3://)")
    f.add_argument("--table", metavar="DB.NAME", help="featurize.format=table: a catalog table instead of --input files")
    f.add_argument("--spec-from", metavar="DIR", help="featurize with the feature spec of this dataset or model "
                   "(learned quantile boundaries included), e.g. the test set with its training set's")
    f.add_argument("--where", metavar="SQL", help="featurize.format=table: a Spark SQL filter of the rows, e.g. \"dt = '2026-11-27'\"")
    f.add_argument("--output", required=True, metavar="DIR", help="dataset directory (new, empty, or a dataset with --overwrite)")
    _add_overwrite_arg(f, "a dataset", "featurize.overwrite")
    _add_conf_args(f)
    _add_remote_arg(f)
    f.set_defaults(fn=cmd_featurize)

    t = sub.add_parser("train", help="train a model on a featurized dataset (Spark barrier stage)")
    t.add_argument("--input", required=True, metavar="DATA_DIR", help="featurized dataset")
    t.add_argument("--model", required=True, metavar="MODEL_DIR", help="model directory to write (new, empty, or a model with --overwrite)")
    _add_overwrite_arg(t, "a model", "train.overwrite")
    t.add_argument("--init-model-if-exists", metavar="PATH",
                   help="warm-start from this model directory or pointer if it exists; train from scratch if not (the first day)")
    _add_conf_args(t)
    _add_remote_arg(t)
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("evaluate", help="logloss, auROC, auPRC, normalized entropy, calibration")
    e.add_argument("--input", required=True, metavar="DATA_DIR", help="featurized dataset to score (a test set with every row)")
    e.add_argument("--model", required=True, metavar="MODEL_DIR", help="model directory or pointer")
    e.add_argument("--out", metavar="FILE", help="also write the metrics as JSON")
    _add_overwrite_arg(e, "the metrics file of --out", None)
    _add_conf_args(e)
    _add_remote_arg(e)
    e.set_defaults(fn=cmd_evaluate)

    pr = sub.add_parser("predict", help="score a featurized dataset into Parquet")
    pr.add_argument("--input", required=True, metavar="DATA_DIR", help="featurized dataset to score")
    pr.add_argument("--model", required=True, metavar="MODEL_DIR", help="model directory or pointer")
    pr.add_argument("--output", required=True, metavar="DIR", help="predictions directory (new, empty, or predictions with --overwrite)")
    _add_overwrite_arg(pr, "predictions", "predict.overwrite")
    _add_conf_args(pr)
    _add_remote_arg(pr)
    pr.set_defaults(fn=cmd_predict)

    sc = sub.add_parser("score", help="score raw TSV/LibSVM lines from stdin, one score per line on stdout (no Spark)")
    sc.add_argument("--model", required=True, metavar="MODEL_DIR", help="model directory or pointer")
    sc.add_argument("--skip-bad", action="store_true",
                    help="write nan for a malformed line and go on (default: stop with an error naming the line, exit 1)")
    sc.add_argument("--no-label", action="store_true",
                    help="lines carry no label field (serving logs): each line is scored as if it began with label 0")
    sc.add_argument("--chunk-mb", type=int, default=8, metavar="MIB", help="stdin is read and scored this many MiB at a time")
    _add_conf_args(sc, "predict.calibration=raw")
    sc.set_defaults(fn=cmd_score)

    ins = sub.add_parser("inspect", help="a model's heaviest features by |weight|, named by its token dictionary")
    ins.add_argument("model", metavar="MODEL_DIR", help="model directory or pointer")
    ins.add_argument("--top", type=int, default=50, metavar="N", help="how many features (default 50)")
    nm = ins.add_mutually_exclusive_group()
    nm.add_argument("--names", action="store_true", default=None,
                    help="require token names (fails when the model has no token dictionary)")
    nm.add_argument("--no-names", action="store_false", dest="names", help="buckets and weights only")
    ins.add_argument("--json", action="store_true", help="print JSON")
    ins.set_defaults(fn=cmd_inspect)

    rp = sub.add_parser("report", help="an HTML page with plots of a training run (and its evaluation)")
    rp.add_argument("model", metavar="MODEL_DIR", help="the trained model directory")
    rp.add_argument("--eval", metavar="METRICS_JSON", help="metrics written by `terascale evaluate --out`")
    rp.add_argument("--out", metavar="DIR", help="where to write (default: the model directory)")
    rp.set_defaults(fn=cmd_report)

    c = sub.add_parser("config", help="print the resolved configuration (or the documented defaults)")
    c.add_argument("--defaults", action="store_true", help="print conf/defaults.yaml with help text")
    _add_conf_args(c)
    c.set_defaults(fn=cmd_config)

    # --- gate and publish: no Spark session; see _model_path above
    gt = sub.add_parser("gate", help="fail (exit 1) when the new model's metrics regress against the published model's")
    gt.add_argument("--metrics", required=True, metavar="FILE", help="the new model's metrics (terascale evaluate --out)")
    gt.add_argument("--baseline", required=True, metavar="FILE",
                    help="the published model's pointer (its recorded metrics) or a metrics file; missing = nothing published yet: pass")
    gt.add_argument("--metric", choices=METRICS, default="logloss", help="lower is better (default logloss)")
    gt.add_argument("--max-regression", type=float, default=0.01, metavar="X", help="allowed increase (default 0.01)")
    gt.add_argument("--margin", choices=MARGINS, default="relative",
                    help="relative: new <= baseline * (1 + X) (default); absolute: new <= baseline + X")
    gt.set_defaults(fn=cmd_gate)

    pb = sub.add_parser("publish", help="atomically point a model pointer at a complete model directory")
    pb.add_argument("--model", required=True, metavar="MODEL_DIR", help="the model to publish (a directory, or a pointer to follow)")
    pb.add_argument("--pointer", required=True, metavar="FILE", help="the pointer file to (re)write, e.g. models/ctr/current")
    pb.add_argument("--metrics", metavar="FILE", help="the model's metrics, recorded in the pointer for later gates")
    pb.set_defaults(fn=cmd_publish)

    d = sub.add_parser("demo", help="run the main pipeline end to end on generated data and print the results")
    d.add_argument("--workdir", default="demo-output", help="where the demo writes its data")
    d.add_argument("--rows", type=int, default=200_000, help="rows of generated click logs")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    t0 = time.perf_counter()
    try:
        rc = args.fn(args)
    except (ConfigError, UsageError, OutputError) as e:
        print(redact_text(f"terascale {args.command}: error: {e}"), file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - the CLI reports every failure as one clear line
        from terascale.pipeline.fsutil import InputError

        log.debug("failure", exc_info=True)
        from terascale.pipeline.spark_errors import lost_server

        kind = "input error" if isinstance(e, InputError) else "failed"
        print(redact_text(f"terascale {args.command}: {kind}: {lost_server(e) or e}"), file=sys.stderr)
        return EXIT_FAILED
    log.info("%s finished in %.1f s", args.command, time.perf_counter() - t0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
