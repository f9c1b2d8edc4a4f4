"""The train job's memory preflight: exact arithmetic, the memory a rank may use, and a
2^30-feature run refused before any Spark job starts (and a normal one recorded)."""

from __future__ import annotations

import json

import pytest

from terascale.jobs import preflight
from terascale.jobs.cli import main
from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.preflight import (
    BASELINE_BYTES,
    MIB,
    PreflightError,
    ShardSize,
    available,
    check,
    estimate,
    parse_size,
)
from terascale.jobs.train_job import run_train
from terascale.pipeline.dataset import plan_shards
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.manifest import read_manifest
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

GIB = 1 << 30


def _train(*sets):
    return load_config([], ["train.l2=1e-6", *sets]).train  # l2 pinned: these tests are about other things than train.l2 = auto


def test_estimate_exact_for_every_solver():
    shard = ShardSize(rows=1000, nnz=39_000, nnz_values=3_900)
    D, n, z, d = 1 << 20, 1000, 39_000, 20_000  # d: active features; the shard's own: min(d, z)
    csr = 8 * (n + 1) + 4 * z + min(12 * 3_900, 4 * z) + 8 * n  # values: 12 B per possible exception
    base = BASELINE_BYTES + csr
    chunk = 3 * (1 << 20)

    def lbfgs(d, f):
        return 8 * 15 * (d + 1) + 80 * (d + 1) + 32 * (d + 1) + 16 * (D + 1) + 8 * D + 32 * (f + 1) + 4 * D + chunk

    online = 12 * (D + 1) + 24 * (D + 1) + 5 * D + 24 * (d + 1) + 4 * D + chunk
    cocoa = 40 * (D + 1) + 4 * z + 4 * z + 48 * n + 16 * 1 * (d + 1) + 24 * (d + 1) + 4 * D + 8 * D + chunk
    assert online > lbfgs(d, d)  # 2^20 features, 20k of them active: the hybrid peaks in its online passes
    for solver, state, phase in (("online", online, "online passes"), ("lbfgs", lbfgs(d, d), "L-BFGS"),
                                 ("hybrid", online, "online passes"), ("cocoa", cocoa, "CoCoA rounds")):
        e = estimate(_train(f"train.solver={solver}"), D, shard, d, 2, 1 << 20)
        assert (e.needed, e.phase) == (base + state, phase), solver
        assert sum(e.terms.values()) == e.needed
    # with every feature active the hybrid peaks in L-BFGS (its pairs and vectors)
    e = estimate(_train("train.solver=hybrid"), D, shard, D, 2, 1 << 20)
    assert (e.phase, e.needed) == ("L-BFGS", base + lbfgs(D, z))
    # a warm start counts every feature as active
    e = estimate(_train("train.solver=lbfgs"), D, shard, d, 2, 1 << 20, warm_start=True)
    assert e.needed == base + lbfgs(D, d)
    # a big shard over few features peaks while reading: the CSR and one record batch in flight;
    # held-out rows are split off as the batches arrive (no second CSR)
    big = ShardSize(rows=10_000_000, nnz=390_000_000, nnz_values=0)
    csr = 8 * (10_000_001) + 4 * 390_000_000 + 8 * 10_000_000  # binary: no values
    batch = int(65536 * (13 * 39.0 + 24))
    for period in (0, 10):
        e = estimate(_train("train.solver=online", f"train.holdout_period={period}"), 1 << 10, big, 390_000_000, 2, 1 << 20)
        assert (e.phase, e.needed) == ("read", BASELINE_BYTES + csr + batch)
    # explicit values cost 12 bytes per exception, at most 4 per non-zero
    valued = ShardSize(rows=10_000_000, nnz=390_000_000, nnz_values=390_000_000)
    e = estimate(_train("train.solver=online", "train.holdout_period=0"), 1 << 10, valued, 390_000_000, 2, 1 << 20)
    assert e.needed == BASELINE_BYTES + csr + 4 * 390_000_000 + batch


def test_memory_a_rank_may_use():
    assert parse_size("4g") == 4 * GIB and parse_size("512m") == 512 * MIB and parse_size("1024") == GIB
    assert parse_size("1.5g") == 3 * GIB // 2 and parse_size("2GB") == 2 * GIB
    assert available({}, "yarn", 2, rank_memory_mb=4096) == (4 * GIB, "train.rank_memory_mb")
    got, why = available({"spark.executor.pyspark.memory": "8g", "spark.executor.cores": "4"}, "yarn", 2)
    assert got == 2 * GIB and "spark.executor.pyspark.memory=8g / 4 executor cores" in why
    assert available({"spark.executor.memory": "8g"}, "yarn", 2)[0] == int(0.1 * 8 * GIB)
    assert available({"spark.executor.memory": "2g"}, "k8s://x", 2)[0] == 384 * MIB
    assert available({"spark.executor.memoryOverhead": "4g", "spark.executor.cores": "2"}, "yarn", 2)[0] == 2 * GIB
    got, why = available({}, "local[2]", 2, machine_bytes=16 * GIB)
    assert got == (15 * GIB) // 2 and why.startswith("local mode")
    assert available({"spark.driver.memory": "3g"}, "local[*]", 3, machine_bytes=16 * GIB)[0] == 13 * GIB // 3
    assert available({}, "spark://127.0.0.1:7077", 2)[0] is None


def test_check_fail_warn_off():
    e = estimate(_train("train.solver=online"), 1 << 30, ShardSize(20, 700, 0), 1400, 2, 1 << 20)
    e.available, e.source = 4 * GIB, "train.rank_memory_mb"
    with pytest.raises(PreflightError) as err:
        check(e, "fail", 2, 30)
    msg = str(err.value)
    assert f"one rank needs about {e.needed / GIB:.1f} GiB at its online passes peak but may use 4.0 GiB (train.rank_memory_mb)" in msg
    assert "float64 weights, start, current and best (24 B x 2^bits) 24.0 GiB" in msg
    assert "online table w, G, s (12 B x 2^bits) 12.0 GiB" in msg
    assert "fewer feature bits (featurize.bits=30" in msg and "spark.executor.pyspark.memory" in msg
    assert check(e, "warn", 2, 30) == msg
    assert check(e, "off", 2, 30) is None
    e.available = None  # nothing known: the estimate is only logged
    assert check(e, "fail", 2, 30) is None


@pytest.fixture(scope="module")
def tiny(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    generate_clicklogs(d / "raw", 20, files=1, seed=2, processes=1)
    for bits in (12, 30):
        run_featurize(spark, [str(d / "raw")], str(d / f"b{bits}"), FeatureSpec(fields=CRITEO_FIELDS, bits=bits),
                      load_config([], ["featurize.partitions=1"]).featurize)
    return d


@pytest.mark.spark
def test_2_to_the_30_features_are_refused_before_any_spark_job(spark, tiny, tmp_path, capsys):
    sc = spark.sparkContext
    jobs_before = len(sc.statusTracker().getJobIdsForGroup(None))
    sets = ["train.workers=2", "train.l2=1e-6", "train.rank_memory_mb=16384", "spark.master=local[2]"]
    with pytest.raises(PreflightError) as e:
        run_train(spark, load_config([], sets), str(tiny / "b30"), str(tmp_path / "m"))
    m = read_manifest(str(tiny / "b30"))
    shard = max(preflight.shard_sizes(plan_shards(str(tiny / "b30"), 2, m), m), key=lambda s: 16 * s.rows + 8 * s.nnz)
    want = estimate(load_config([], sets).train, 1 << 30, shard, preflight.active_bound(m, 1 << 30), 2, 1 << 20)
    assert want.phase == "online passes" and want.needed > 45 * GIB
    assert (f"memory preflight: one rank needs about {want.needed / GIB:.1f} GiB at its {want.phase} peak but may use "
            "16.0 GiB (train.rank_memory_mb)") in str(e.value)
    assert "float64 weights, start, current and best (24 B x 2^bits) 24.0 GiB" in str(e.value)
    assert main(["train", "--input", str(tiny / "b30"), "--model", str(tmp_path / "m"),
                 *[x for s in sets for x in ("--set", s)]]) == 2
    assert "terascale train: error: memory preflight: one rank needs about" in capsys.readouterr().err
    assert len(sc.statusTracker().getJobIdsForGroup(None)) == jobs_before  # no Spark job ran
    assert not (tmp_path / "m").exists()


@pytest.mark.spark
def test_a_normal_run_passes_and_records_its_estimate(spark, tiny, tmp_path):
    sets = ["train.workers=2", "train.l2=1e-6", "train.passes=2", "train.holdout_period=0", "spark.master=local[2]"]
    meta = run_train(spark, load_config([], sets), str(tiny / "b12"), str(tmp_path / "m"))
    est = meta["memory_estimate"]
    m = read_manifest(str(tiny / "b12"))
    shard = max(preflight.shard_sizes(plan_shards(str(tiny / "b12"), 2, m), m), key=lambda s: 16 * s.rows + 8 * s.nnz)
    want = estimate(load_config([], sets).train, 1 << 12, shard, preflight.active_bound(m, 1 << 12), 2, 1 << 20)
    assert est["needed_bytes"] == want.needed and est["terms"] == want.terms
    assert est["available_from"].startswith("local mode") and est["available_bytes"] > est["needed_bytes"]
    assert json.loads((tmp_path / "m" / "metadata.json").read_text())["memory_estimate"] == est


def test_active_features_bound():
    assert preflight.active_bound({"distinct_features": 593_299, "nnz": 13_398_759}, 1 << 24) == 593_299
    assert preflight.active_bound({"distinct_features": None, "nnz": 780}, 1 << 30) == 780
    assert preflight.active_bound({"distinct_features": None, "nnz": 1 << 40}, 1 << 30) == 1 << 30
