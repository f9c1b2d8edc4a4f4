"""Quality on the generated ad-log table (issue 42 item 7): terascale's defaults against Vowpal
Wabbit's plain runs and MLlib's LogisticRegression at its best of a few λ, on the same tokens.

``ROWS`` ad-log rows (``pipeline.gen_adlog``, 5% clicks, seed 0) in two files of time order: the
earlier half trains, the later half tests (CTR teams validate on later traffic). The table is
featurized once with ``adlog.yaml`` (without the sampling weight, so that every learner sees the
same unweighted rows), the test half with the training half's spec (``--spec-from``). Then:

- terascale: ``terascale train`` with every setting at its default, ``terascale evaluate``;
- VW: its plain runs on the same hashed features (``vw_io.vw_plain_runs``: one pass, + bfgs with
  its holdout, + bfgs with l2);
- MLlib: ``LogisticRegression`` (``MLLIB_ITERATIONS`` = 50 iterations, standardization off) on the same features, for
  each λ of ``MLLIB_L2``; the test logloss of each from its weights.

Targets: terascale <= the best VW run + 0.001, and <= MLlib's best. Also the generator's Bayes
logloss of the test half (the floor).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import numpy as np

from tests.benchmarks.common import RESULTS, ROOT, terascale_cli

ROWS, BITS = 2_000_000, 20
if os.environ.get("TERASCALE_BENCH_SMALL"):
    ROWS = 200_000
MLLIB_L2 = (1e-4, 1e-5, 1e-6)
MLLIB_ITERATIONS = 50
MARGIN = 0.001


def _cli(*args: str) -> None:
    r = subprocess.run(terascale_cli() + list(args) + ["--set", "spark.master=local[2]"], capture_output=True,
                       text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"terascale {args[0]} failed: {r.stderr[-3000:]}")


def _logloss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-15, 1 - 1e-15)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _mllib(test_dir, train_dir) -> dict:
    from terascale.pipeline.dataset import read_dataset
    from terascale.solvers.predict import decision_function, sigmoid
    from tests.benchmarks.bench_train import _mllib as fit
    from tests.benchmarks.bench_train import _session

    csr, _ = read_dataset(str(test_dir))
    spark = _session("bench-adlog-mllib")
    out = {}
    try:
        for lam in MLLIB_L2:
            t = time.perf_counter()
            _, w, b = fit(spark, train_dir, lam, BITS, max_iter=MLLIB_ITERATIONS)
            out[f"{lam:g}"] = {"test_logloss": _logloss(csr.labels.astype(np.float64),
                                                         sigmoid(decision_function(csr, w.astype(np.float32), b))),
                               "seconds": time.perf_counter() - t}
    finally:
        spark.stop()
    return out


def main() -> dict:
    from terascale.pipeline.gen_adlog import ADLOG_SPEC_YAML, generate_adlog, truth_of, write_adlog
    from tests.benchmarks.vw_io import vw_plain_runs

    work = RESULTS / "adlog-quality-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        write_adlog(work / "raw", ROWS, seed=0, files=2, formats=("parquet",))
        conf = work / "adlog.yaml"
        conf.write_text("\n".join(x for x in ADLOG_SPEC_YAML.splitlines() if not x.strip().startswith("weight:")))
        train, test = work / "train", work / "test"
        _cli("featurize", "--input", str(work / "raw/parquet/part-00000.parquet"), "--output", str(train),
             "--conf", str(conf), "--set", f"featurize.bits={BITS}")
        _cli("featurize", "--input", str(work / "raw/parquet/part-00001.parquet"), "--output", str(test),
             "--conf", str(conf), "--spec-from", str(train))
        t = time.perf_counter()
        _cli("train", "--input", str(train), "--model", str(work / "model"))
        train_s = time.perf_counter() - t
        _cli("evaluate", "--input", str(test), "--model", str(work / "model"), "--out", str(work / "metrics.json"))
        m = json.loads((work / "metrics.json").read_text())
        meta = json.loads((work / "model" / "metadata.json").read_text())
        table, p = generate_adlog(ROWS, seed=0)
        half = ROWS // 2
        bayes = truth_of(table.column("clicked").to_numpy()[half:], p[half:])
        fig: dict = {"rows": ROWS, "bits": BITS, "bayes_test_logloss": bayes["bayes_logloss"],
                     "terascale": {"test_logloss": m["logloss"], "auroc": m["auroc"], "calibration": m["calibration"],
                                   "l2_chosen": (meta.get("regularization") or {}).get("value"),
                                   "train_end_to_end_s": train_s}}
        fig["vw"] = vw_plain_runs(str(train), str(test), BITS, str(work), (ROWS // 2) * 1e-6)
        fig["mllib"] = _mllib(test, train)
        best_vw = min(v["test_logloss"] for k, v in fig["vw"].items() if isinstance(v, dict))
        best_ml = min(v["test_logloss"] for v in fig["mllib"].values())
        ts = fig["terascale"]["test_logloss"]
        fig["margin_vs_vw"], fig["margin_vs_mllib"] = ts - best_vw, ts - best_ml
        fig["targets"] = {"vw_plus_0.001": ts <= best_vw + MARGIN, "mllib_best": ts <= best_ml}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"ad-log table, {ROWS:,} rows (earlier half trains, later half tests), 2^{BITS}: Bayes "
          f"{fig['bayes_test_logloss']:.5f}")
    print(f"  terascale defaults  {ts:.5f} (auROC {fig['terascale']['auroc']:.4f}, calibration "
          f"{fig['terascale']['calibration']:.4f}, l2 {fig['terascale']['l2_chosen']})")
    print("  VW                  " + ", ".join(f"{k} {v['test_logloss']:.5f}" for k, v in fig["vw"].items()
                                              if isinstance(v, dict)))
    print("  MLlib               " + ", ".join(f"l2 {k} {v['test_logloss']:.5f}" for k, v in fig["mllib"].items()))
    print(f"  margin vs best VW {fig['margin_vs_vw']:+.5f}, vs best MLlib {fig['margin_vs_mllib']:+.5f}")
    return fig
