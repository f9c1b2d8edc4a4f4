"""The scale benchmark (issue 32, item 1): the whole pipeline at N rows, every stage measured.

    python -m tests.benchmarks scale [--rows N] [--test-rows T] [--keep] [--set KEY=VALUE ...]
    make bench-scale [ROWS=N]

It generates N rows of Criteo-style click logs (``terascale generate --gzip``: files of
``--rows-per-file`` rows, 1,000,000 by default, written in parallel on every core) and a test set
of T rows with their true probabilities (another seed; T = min(5,000,000, N / 2) by default:
the issue's 5M at 10M rows and more, proportionally fewer below, so a small run is not dominated
by its test set; the excess logloss over the Bayes loss of the same rows compares across N).
Then, through the installed ``terascale`` command, each in its own process as a user runs it,
on ``--master`` (``local[2]``):

    featurize (training logs) -> featurize_test -> train (the defaults, with
    train.data_cache=auto, train.rank_memory_mb=2048) -> evaluate (the test set) ->
    predict (the test set) -> score (``terascale score`` on min(1,000,000, T) raw test lines,
    after ``score_first``, a cold run on 1,000 of them: the numba kernels' load or compile)

Every stage (the two generate runs too) is measured by :func:`tests.benchmarks.measured.run_measured`:
wall and CPU seconds, rows per second (its input rows over its wall time), the peak RSS of every
process of its tree by kind (the ``terascale`` driver, the JVM, the Python daemon and workers),
the bytes its tree read and wrote (``io_wrap.py``: exact, whoever exited when), and the lowest
free disk of the work folder's volume. Train adds its passes and the seconds per row-pass (the
model's history), its ranks' own peak RSS and the progress lines' ETAs against the time it
took; evaluate adds the test logloss, auROC and calibration beside the generator's Bayes loss.

Disk: the estimate (``scale_disk``) is checked against ``df`` first; a run that does not fit is
refused before anything is written. The work folder (``--workdir``, default
``bench-results/scale-work-N``) must be new, empty, or an earlier run of this benchmark (its
marker file ``_scale_bench.json`` lists what that run wrote, which is then removed). After the
run (also a failed one) the raw logs, both datasets, the predictions and the score files are
removed unless ``--keep``; the model, the metrics and the logs (``logs/<stage>.out|.err``) stay.

``--fault`` (issue 32 item 5) trains a second time into ``model-fault`` while
:mod:`tests.benchmarks.scale_fault` SIGKILLs one rank's Python process in the middle of a late
pass (after two thirds of the undisturbed run's passes, ``--fault-pass`` to choose): the job
must resume from its last checkpoint and end with the undisturbed model, bit for bit; the run's
``fault`` entry holds the comparison and the time lost against the pass time.

Results: ``bench-results/scale.json``, ``{"benchmark": "scale", "runs": {"<N>": run}}``: a run
replaces the earlier run of the same N and leaves the others, so the runs of the scale curve
(item 2) accumulate in one file; a run cut short by ``--stop-after STAGE`` goes under
``"<N>:STAGE"`` and never replaces a whole run. A failed stage is recorded in its run (``failed``) and exits 1.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import sys
import time
from pathlib import Path

from tests.benchmarks import scale_disk
from tests.benchmarks.common import RESULTS, ROOT, terascale_cli, write_result
from tests.benchmarks.measured import run_measured
from tests.benchmarks.scale_fault import Killer, compare
from tests.benchmarks.scale_figures import (
    cli_seconds,
    dir_bytes,
    eta_figures,
    featurize_figures,
    machine,
    merge_run,
    quality_figures,
    train_figures,
)

EXPLICIT_ONLY = True  # `make bench` without names skips it: `make bench-scale`
DEFAULT_ROWS = 100_000_000
STAGES = ("generate", "featurize", "train", "evaluate", "predict", "score")
TRAIN_SETS = ("train.data_cache=auto", "train.rank_memory_mb=2048")
MARKER = "_scale_bench.json"
#: what a run writes in its work folder; DATA is removed after the run unless --keep
ENTRIES = ("raw", "data", "model", "metrics.json", "pred", "score-input.tsv", "scores.txt", "logs",
           "model-fault", "ckpt-fault")
DATA = ("raw", "data", "pred", "score-input.tsv", "scores.txt", "ckpt-fault")


class StageFailed(RuntimeError):
    pass


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks scale", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="training rows N (default 100,000,000)")
    p.add_argument("--test-rows", type=int, help="test rows (default min(5,000,000, N / 2))")
    p.add_argument("--score-lines", type=int, help="raw lines for terascale score (default min(1,000,000, test rows))")
    p.add_argument("--rows-per-file", type=int, default=1_000_000, help="rows per generated gzip file")
    p.add_argument("--seed", type=int, default=0, help="the training logs' seed (the test set: seed + 1)")
    p.add_argument("--master", default="local[2]", help="Spark master of every job")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                   help="one more --set for every Spark job (after the benchmark's own)")
    p.add_argument("--workdir", type=Path, help="work folder (default bench-results/scale-work-N)")
    p.add_argument("--keep", action="store_true", help="keep the raw logs, datasets, predictions and score files")
    p.add_argument("--stop-after", choices=STAGES, default="score", help="the last stage to run")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between /proc samples")
    p.add_argument("--fault", action="store_true", help="also train once more, SIGKILLing a rank in a late pass")
    p.add_argument("--fault-pass", type=int, help="kill after this pass (default: 2/3 of the undisturbed run's)")
    a = p.parse_args(argv)
    a.test_rows = min(5_000_000, a.rows // 2) if a.test_rows is None else a.test_rows
    a.score_lines = min(1_000_000, a.test_rows) if a.score_lines is None else a.score_lines
    if a.rows < 1 or a.test_rows < 1 or a.rows_per_file < 1 or not 0 < a.score_lines <= a.test_rows:
        p.error("--rows, --test-rows, --rows-per-file must be >= 1 and 0 < --score-lines <= --test-rows")
    a.workdir = (a.workdir or RESULTS / f"scale-work-{a.rows}").resolve()
    return a


def prepare_workdir(work: Path) -> None:
    """``work`` new, empty, or an earlier run's (whose entries are removed); else refuse."""
    if work.exists() and any(work.iterdir()):
        names = {p.name for p in work.iterdir()}
        ours = set(ENTRIES) | {MARKER}
        if MARKER not in names or not names <= ours:
            raise SystemExit(f"scale: {work} holds {sorted(names - ours) or sorted(names)}, which this benchmark "
                             "did not write: pass another --workdir or empty it")
        for name in names - {MARKER}:
            _remove(work / name)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text(json.dumps({"entries": list(ENTRIES)}) + "\n")
    (work / "logs").mkdir()


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


class Runner:
    """Runs the stages of one benchmark run in ``work`` and collects their figures."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.work, self.stages = a, a.workdir, {}
        self.cli = terascale_cli()
        self.spark_sets = [f"spark.master={a.master}"]
        self.fault: dict | None = None

    def _sets(self, extra=()) -> list[str]:
        return [x for s in (*self.spark_sets, *extra, *self.a.sets) for x in ("--set", s)]

    def stage(self, name: str, args: list[str], rows: int, stdin: Path | None = None,
              stdout: Path | None = None) -> tuple[dict, str, str]:
        """Run ``terascale ARGS``; its figures (stored under ``name``), stdout and stderr."""
        logs = self.work / "logs"
        out_path, err_path = stdout or logs / f"{name}.out", logs / f"{name}.err"
        with open(out_path, "wb") as out, open(err_path, "wb") as err, \
                (open(stdin, "rb") if stdin else open("/dev/null", "rb")) as inp:
            r = run_measured(self.cli + args, disk_path=str(self.work), io_json=logs / f"{name}.io.json",
                             stdin=inp, stdout=out, stderr=err, cwd=str(ROOT), interval=self.a.interval)
        err_text = err_path.read_text(errors="replace")
        out_text = out_path.read_text(errors="replace") if stdout is None else ""
        r.update({"command": ["terascale", *args], "rows": rows, "rows_per_s": rows / r["wall_s"],
                  "cli_seconds": cli_seconds(err_text)})
        self.stages[name] = r
        if r["returncode"] != 0:
            raise StageFailed(f"stage {name}: terascale {args[0]} exited {r['returncode']}: {err_text[-3000:]}")
        peaks = ", ".join(f"{k} {v['max'] / 2**20:,.0f} MiB" for k, v in r["rss_peak_bytes"].items())
        print(f"scale: {name:15s} {r['wall_s']:8.1f} s  {r['rows_per_s']:>12,.0f} rows/s  peak RSS: {peaks}", flush=True)
        return r, out_text, err_text

    # --- the stages

    def generate(self) -> dict:
        a, raw = self.a, self.work / "raw"
        for name, rows, seed, out, extra in (("generate", a.rows, a.seed, raw / "train", []),
                                             ("generate_test", a.test_rows, a.seed + 1, raw / "test", ["--with-prob"])):
            files = math.ceil(rows / a.rows_per_file)
            r, stdout, _ = self.stage(name, ["generate", "--rows", str(rows), "--files", str(files), "--gzip",
                                             "--seed", str(seed), "--out", str(out), *extra], rows)
            s = json.loads(stdout[stdout.index("{"):])
            r.update({"files": files, "gzip_bytes": s["bytes"], "processes": s["processes"],
                      "generator_seconds": s["seconds"]})
        return json.loads((raw / "test" / "_truth.json").read_text())

    def featurize(self) -> None:
        for name, src, dst, lines in (("featurize", "train", "train", self.a.rows),
                                      ("featurize_test", "test", "test", self.a.test_rows)):
            r, _, _ = self.stage(name, ["featurize", "--input", str(self.work / "raw" / src / "*.tsv.gz"),
                                        "--output", str(self.work / "data" / dst), *self._sets()], lines)
            r.update(featurize_figures(self.work / "data" / dst))

    def train(self) -> None:
        rows = self.stages["featurize"]["rows"]
        r, _, err = self.stage("train", ["train", "--input", str(self.work / "data" / "train"), "--model",
                                         str(self.work / "model"), *self._sets(TRAIN_SETS)], rows)
        r.update(train_figures(self.work / "model", rows))
        r["eta"] = eta_figures(err, r["train_seconds"])
        if self.a.fault:
            self.fault = self.train_fault(rows, r["passes"])

    def train_fault(self, rows: int, passes: int) -> dict:
        """The same training once more, a rank killed after pass ``--fault-pass`` (scale_fault)."""
        at = self.a.fault_pass or max(1, math.ceil(2 * passes / 3))
        ckpt = self.work / "ckpt-fault"
        with Killer(ckpt, at) as killer:
            self.stage("train_fault", ["train", "--input", str(self.work / "data" / "train"), "--model",
                                       str(self.work / "model-fault"),
                                       *self._sets((*TRAIN_SETS, f"train.checkpoint_dir={ckpt}"))], rows)
        out = compare(self.work / "model", self.work / "model-fault", killer.record)
        print(f"scale: fault after pass {out.get('pass_done')}: {out['attempts']} attempts, same bits: "
              f"{out['same_bits']}, lost {out['time_lost_s']:.1f} s = {out['time_lost_passes'] or 0:.1f} passes", flush=True)
        return out

    def evaluate(self, truth: dict) -> dict:
        rows = self.stages["featurize_test"]["rows"]
        r, _, _ = self.stage("evaluate", ["evaluate", "--input", str(self.work / "data" / "test"), "--model",
                                          str(self.work / "model"), "--out", str(self.work / "metrics.json"),
                                          *self._sets()], rows)
        metrics = json.loads((self.work / "metrics.json").read_text())
        r["job_seconds"] = metrics.get("seconds")
        return quality_figures(metrics, truth)

    def predict(self) -> None:
        rows = self.stages["featurize_test"]["rows"]
        r, _, _ = self.stage("predict", ["predict", "--input", str(self.work / "data" / "test"), "--model",
                                         str(self.work / "model"), "--output", str(self.work / "pred"),
                                         *self._sets()], rows)
        m = json.loads((self.work / "pred" / "_manifest.json").read_text())
        r.update({"rows_written": m["rows"], "output_files": len(m["files"]), "job_seconds": m.get("seconds"),
                  "parquet_bytes": dir_bytes(self.work / "pred")})

    def score(self) -> None:
        src, lines = self.work / "score-input.tsv", self.a.score_lines
        t0 = time.perf_counter()
        _head_lines(sorted((self.work / "raw" / "test").glob("*.tsv.gz")), lines, src)
        prepare_s = time.perf_counter() - t0
        out = self.work / "scores.txt"
        # a first, cold run on a few lines: loading (or compiling, after an upgrade) the numba
        # kernels costs seconds once per machine, which the rate of the run after it leaves out
        few = self.work / "scores-first.txt"
        _head_lines(sorted((self.work / "raw" / "test").glob("*.tsv.gz")), min(1000, lines), few)
        self.stage("score_first", ["score", "--model", str(self.work / "model")], min(1000, lines), stdin=few,
                   stdout=self.work / "scores.txt")
        few.unlink()
        r, _, _ = self.stage("score", ["score", "--model", str(self.work / "model")], lines, stdin=src, stdout=out)
        r.update({"input_bytes": src.stat().st_size, "scores_written": _count_lines(out),
                  "input_prepare_s": prepare_s})


def _head_lines(files: list[Path], n: int, dst: Path) -> None:
    """The first ``n`` lines of the gzip'd ``files``, in order, uncompressed into ``dst``."""
    left = n
    with open(dst, "wb") as out:
        for f in files:
            with gzip.open(f, "rb") as g:
                for line in g:
                    out.write(line)
                    left -= 1
                    if left == 0:
                        return
    raise StageFailed(f"score: the test logs hold {n - left:,} lines, fewer than {n:,}")


def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
    return n


def run(a: argparse.Namespace) -> dict:
    """One run: its figures (also on failure, with ``failed``)."""
    volume = next(p for p in (a.workdir, *a.workdir.parents) if p.exists())
    try:
        disk = scale_disk.check(str(volume), a.rows, a.test_rows, a.score_lines)
    except scale_disk.DiskRefused as e:
        raise SystemExit(f"scale: refused: {e}") from None
    prepare_workdir(a.workdir)
    started = time.time()
    runner = Runner(a)
    rec = {"rows": a.rows, "test_rows": a.test_rows, "score_lines": a.score_lines, "rows_per_file": a.rows_per_file,
           "seed": a.seed, "master": a.master, "train_sets": list(TRAIN_SETS), "sets": a.sets,
           "stop_after": a.stop_after, "workdir": str(a.workdir), "machine": machine(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)), "stages": runner.stages}
    try:
        truth = runner.generate()
        steps = {"featurize": runner.featurize, "train": runner.train, "evaluate": lambda: rec.update(quality=runner.evaluate(truth)),
                 "predict": runner.predict, "score": runner.score}
        for name in STAGES[1:STAGES.index(a.stop_after) + 1]:
            steps[name]()
        rec["bayes_logloss"] = truth.get("bayes_logloss")
        if runner.fault is not None:
            rec["fault"] = runner.fault
    except StageFailed as e:
        rec["failed"] = str(e)
    finally:
        disk["raw_gzip_bytes"] = dir_bytes(a.workdir / "raw")
        disk["featurized_bytes"] = dir_bytes(a.workdir / "data")
        disk["min_free_bytes"] = min([s["min_free_disk_bytes"] for s in runner.stages.values()] or [disk["free_at_start_bytes"]])
        disk["peak_extra_bytes"] = disk["free_at_start_bytes"] - disk["min_free_bytes"]
        rec["disk"] = disk
        rec["removed"] = [] if a.keep else [n for n in DATA if (a.workdir / n).exists()]
        for n in rec["removed"]:
            _remove(a.workdir / n)
        rec["total_wall_s"] = time.time() - started
    return rec


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(list(argv or []))
    r = run(a)
    merged = merge_run(RESULTS / "scale.json", r)
    if "failed" in r:
        write_result("scale", merged)
        print(f"scale: {r['failed']}", file=sys.stderr)
        raise SystemExit(1)
    return merged
