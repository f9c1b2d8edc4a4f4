"""Negative downsampling (``featurize.negative_rate = 0.1``) against training on all rows, in one run.

The same generated training logs are featurized twice (every row; negatives kept at rate 0.1
and weighted 10), the test logs once with every row (the test split is never downsampled).
Twice: on logs at the generator's default click rate 0.25 (3 negatives per click: rate 0.1
keeps 1 in 3 rows) and at 0.03 (33 negatives per click, as raw click logs: it keeps 1 in 8).
Both datasets are trained with the default settings (the sampled one is then recalibrated on its
held-out rows: ``train.recalibrate``'s auto) and evaluated on the same test set; the sampled
model's calibration is reported recalibrated and as σ(margin) alone (``raw_calibration``).
Targets: test logloss within 0.002 of the all-rows model, calibration in [0.98, 1.02], training
time (``train_seconds``, the job's own clock; the median of REPEATS runs of each, interleaved
all, sampled, all, ...; every repeat must reach the same objective bits) <= 0.35x. A short run
first fills the executors' numba cache, so neither measured run pays for compilation.

:data:`CASES`: both click rates at ``ROWS`` = 500k (a few minutes on a small machine) and the 33
negatives per click again at the 2M rows of the training benchmark, where the held-out rows hold
enough clicks (about 6,000) for the recalibration's noise to fall inside the calibration target:
that case (:data:`HEADLINE`) is the one the targets are judged on, the others are context (at 3
negatives per click r = 0.1 discards two thirds of all rows, which no estimator gets back);
set TERASCALE_BENCH_DOWNSAMPLING_ROWS to change ``ROWS``, and TERASCALE_BENCH_DOWNSAMPLING_L2 to
train both with another ``train.l2`` than the default.
"""

from __future__ import annotations

import json
import os
import statistics

from tests.benchmarks.common import RESULTS, generated_logs

ROWS = int(os.environ.get("TERASCALE_BENCH_DOWNSAMPLING_ROWS", 500_000))
#: the generator's default click rate, 0.25 (Criteo's public sample, itself downsampled: 3
#: negatives per click), and 0.03 (33 negatives per click, inside the 30-300 of raw click logs
#: that issue 22 names as the reason teams downsample)
REPEATS = int(os.environ.get("TERASCALE_BENCH_DOWNSAMPLING_REPEATS", 3))
TEST_ROWS, BITS, RATE = 200_000, 22, 0.1
if os.environ.get("TERASCALE_BENCH_SMALL"):
    ROWS, TEST_ROWS = 100_000, 20_000
#: (click rate, training rows, repeats): None = the generator's default click rate, 0.25
CASES = ((None, ROWS, REPEATS), (0.03, ROWS, REPEATS), (0.03, max(ROWS, 2_000_000), 2))


#: the case the issue's targets are judged on: raw click logs (33 negatives per click, inside the
#: 30-300 the practice exists for) at the training benchmark's 2M rows; the others are context
HEADLINE = "ctr_0.03_rows_2000000"


def main() -> dict:
    """The cases of :data:`CASES` (module docstring), one Spark session."""
    out = {f"ctr_{0.25 if ctr is None else ctr:g}_rows_{rows}": compare(ctr, rows, reps) for ctr, rows, reps in CASES}
    if HEADLINE in out:
        out["headline"] = {"case": HEADLINE, "targets_met": all(out[HEADLINE]["targets"].values())}
    print(json.dumps(out, indent=2))
    return out


def compare(ctr: float | None, rows: int = ROWS, repeats: int = REPEATS) -> dict:
    """All rows against negatives kept at RATE, on ``rows`` lines of logs generated with click rate
    ``ctr`` (None: the generator's default, 0.25); each model trained ``repeats`` times."""
    from terascale.jobs.config import feature_spec, load_config
    from terascale.jobs.scoring import evaluate
    from terascale.jobs.session import get_spark
    from terascale.jobs.train_job import run_train
    from terascale.pipeline import fsutil
    from terascale.pipeline.spark_featurize import run_featurize

    train_raw = generated_logs(rows, 2, 41, ctr)
    test_raw = generated_logs(TEST_ROWS, 1, 42, ctr)
    work = RESULTS / "downsampling-work"
    base = [f"featurize.bits={BITS}", "spark.master=local[2]"]
    if os.environ.get("TERASCALE_BENCH_DOWNSAMPLING_L2"):
        base.append(f"train.l2={os.environ['TERASCALE_BENCH_DOWNSAMPLING_L2']}")
    cfg = load_config([], base)
    spark = get_spark(cfg.spark)
    spec = feature_spec(cfg)
    tsv = lambda d: [str(p) for p in sorted(d.glob("*.tsv"))]  # noqa: E731
    m_all = run_featurize(spark, tsv(train_raw), str(work / "all"), spec, cfg.featurize)
    m_s = run_featurize(spark, tsv(train_raw), str(work / "sampled"), spec,
                        load_config([], [*base, f"featurize.negative_rate={RATE}"]).featurize)
    run_featurize(spark, tsv(test_raw), str(work / "test"), spec, cfg.featurize)
    run_train(spark, load_config([], [*base, "train.passes=2"]), str(work / "sampled"), str(work / "warm"))
    out = {"rows": rows, "test_rows": TEST_ROWS, "bits": BITS, "l2": cfg.train.l2, "negative_rate": RATE,
           "click_rate": m_all["label_mean"],
           "sampling": m_s["sampling"]}
    seconds: dict[str, list[float]] = {"all": [], "sampled": []}
    for rep in range(repeats):  # interleaved: the machine's drift falls on both alike
        for name in ("all", "sampled"):
            model = work / f"model-{name}-{rep}"
            meta = run_train(spark, cfg, str(work / name), str(model))
            seconds[name].append(meta["train_seconds"])
            if rep == 0:
                r = evaluate(spark, str(work / "test"), str(model))
                out[name] = {"train_rows": meta["data"]["train_rows"], "passes": len(meta["history"]),
                             "stop_reason": meta["stop_reason"], "objective": meta["objective"],
                             "recalibration": meta.get("recalibration"),
                             **{k: r[k] for k in ("logloss", "normalized_entropy", "auroc", "calibration",
                                                  "raw_calibration") if k in r}}
            elif meta["objective"] != out[name]["objective"]:  # the same data and settings: the same bits
                raise AssertionError(f"{name}: repeat {rep} reached {meta['objective']!r}, "
                                     f"repeat 0 {out[name]['objective']!r}")
    for name, s in seconds.items():
        out[name]["train_seconds"] = s
        out[name]["train_seconds_median"] = statistics.median(s)
    out["rows_kept"] = m_s["rows"] / m_all["rows"]
    out["logloss_delta"] = out["sampled"]["logloss"] - out["all"]["logloss"]
    out["time_ratio"] = out["sampled"]["train_seconds_median"] / out["all"]["train_seconds_median"]
    out["time_ratios_per_repeat"] = [a / b for a, b in zip(seconds["sampled"], seconds["all"], strict=True)]
    out["targets"] = {"logloss_within_0.002": abs(out["logloss_delta"]) <= 0.002,
                      "calibration_in_0.98_1.02": 0.98 <= out["sampled"]["calibration"] <= 1.02,
                      "time_ratio_le_0.35": out["time_ratio"] <= 0.35}
    fsutil.delete(str(work))
    return out
