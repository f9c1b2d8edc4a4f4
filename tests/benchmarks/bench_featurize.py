"""Featurize throughput: terascale against Spark MLlib's FeatureHasher, both on local[2].

The same 2,000,000 generated rows (bits 22). MLlib reads the TSV with Spark's CSV reader,
builds the same tokens with column expressions (bucketed integers, raw categoricals; its
FeatureHasher hashes ``column=value``, which is exactly terascale's token text) and writes
label + hashed vector to Parquet. Each side gets one warm-up on a small file first (numba's
compile cache, the JVM's JIT), then one measured run. Target: terascale >= 3x MLlib's rows/s.
"""

from __future__ import annotations

import shutil
import time

from tests.benchmarks.common import RESULTS, PeakMemory, generated_logs

ROWS, FILES, BITS = 2_000_000, 4, 22


def _mllib(spark, inputs: str, out: str, bits: int) -> None:
    from pyspark.ml.feature import FeatureHasher
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    ints = [f"I{k}" for k in range(1, 14)]
    cats = [f"C{k}" for k in range(1, 27)]
    schema = StructType([StructField(c, StringType()) for c in ["label", *ints, *cats]])
    df = spark.read.csv(inputs, sep="\t", schema=schema, mode="DROPMALFORMED")
    cols = [F.col("label").cast("float").alias("label")]
    for c in ints:
        v = F.col(c).cast("long")
        b = F.when(v <= 2, v).otherwise(F.floor(F.log(v) * F.log(v)))
        cols.append(b.cast("string").alias(c))  # null when missing: FeatureHasher skips it
    cols += [F.col(c) for c in cats]
    tokens = df.select(*cols)
    hasher = FeatureHasher(inputCols=ints + cats, outputCol="features", numFeatures=1 << bits, categoricalCols=ints + cats)
    hasher.transform(tokens).select("label", "features").write.mode("overwrite").parquet(out)


def main() -> dict:
    from pyspark.sql import SparkSession

    from terascale.jobs.config import feature_spec, load_config
    from terascale.jobs.session import EXECUTOR_ENV
    from terascale.pipeline.spark_featurize import run_featurize

    data = generated_logs(ROWS, FILES, seed=11)
    warm = generated_logs(20_000, 1, seed=12)
    work = RESULTS / "work-featurize"
    shutil.rmtree(work, ignore_errors=True)
    spark = (SparkSession.builder.master("local[2]").appName("bench-featurize")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.memory", "4g")
             .config(map=EXECUTOR_ENV).getOrCreate())  # the executor environment of terascale's jobs
    spark.sparkContext.setLogLevel("ERROR")
    cfg = load_config([], [f"featurize.bits={BITS}"])
    spec = feature_spec(cfg)
    figures: dict = {"rows": ROWS, "bits": BITS, "master": "local[2]"}
    try:
        run_featurize(spark, [str(warm / "*.tsv")], str(work / "warm-ts"), spec, cfg.featurize)
        _mllib(spark, str(warm / "*.tsv"), str(work / "warm-ml"), BITS)

        with PeakMemory() as mem:
            t = time.perf_counter()
            m = run_featurize(spark, [str(data / "*.tsv")], str(work / "terascale"), spec, cfg.featurize)
            ts = time.perf_counter() - t
        assert m["rows"] == ROWS
        figures["terascale"] = {"seconds": ts, "rows_per_s": ROWS / ts, "peak_rss_bytes": mem.peak,
                                "files": len(m["files"]), "bytes": m["bytes"]}

        with PeakMemory() as mem:
            t = time.perf_counter()
            _mllib(spark, str(data / "*.tsv"), str(work / "mllib"), BITS)
            ml = time.perf_counter() - t
        assert spark.read.parquet(str(work / "mllib")).count() == ROWS
        figures["mllib"] = {"seconds": ml, "rows_per_s": ROWS / ml, "peak_rss_bytes": mem.peak}
        figures["ratio_rows_per_s"] = figures["terascale"]["rows_per_s"] / figures["mllib"]["rows_per_s"]
        figures["target_ratio"] = 3.0
        figures["meets_target"] = figures["ratio_rows_per_s"] >= 3.0
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"featurize {ROWS:,} rows, bits {BITS}, local[2]:")
    for k in ("terascale", "mllib"):
        f = figures[k]
        print(f"  {k:10s} {f['seconds']:7.2f} s  {f['rows_per_s']:>12,.0f} rows/s  peak RSS {f['peak_rss_bytes'] / 2**30:.2f} GiB")
    print(f"  ratio      {figures['ratio_rows_per_s']:.2f}x (target >= 3x)")
    return figures
