"""The train job with train.data_cache = disk (the local shard cache) on a real Spark session: the
model of memory mode bit for bit, a killed attempt resumed from its checkpoint, the cache
directories removed after success, failure and retry, and budgets refused before the stage."""

from __future__ import annotations

import os

import numpy as np
import pytest

from terascale.jobs.config import CRITEO_FIELDS, ConfigError, load_config
from terascale.jobs.train_job import TrainError, run_train
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.modeldir import load_model
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    generate_clicklogs(d / "raw", 6000, files=2, seed=13, processes=1)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=0)
    run_featurize(spark, [str(d / "raw")], str(d / "tr"), spec, load_config([], ["featurize.partitions=3"]).featurize)
    return str(d / "tr")


def _cfg(*sets):
    return load_config([], ["train.workers=2", "train.l2=1e-6", "spark.master=local[2]", *sets])  # l2 pinned: these tests are about other things than train.l2 = auto


def _disk(tmp_path) -> list[str]:
    return ["train.data_cache=disk", "train.memory_budget_mb=28", f"train.cache_dir={tmp_path / 'local'}"]


def _left(tmp_path) -> list[str]:
    """What the runs left under the cache directory (the cache root itself may stay)."""
    root = tmp_path / "local"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != "terascale-cache") if root.exists() else []


def _same_model(a: str, b: str) -> None:
    wa, ba, _ = load_model(a)
    wb, bb, _ = load_model(b)
    assert np.array_equal(wa.view(np.uint32), wb.view(np.uint32)) and ba == bb


@pytest.mark.parametrize("solver", ["hybrid", "cocoa"])
def test_disk_mode_gives_memory_modes_model_bit_for_bit_and_removes_its_cache(spark, data, tmp_path, solver):
    base = [f"train.solver={solver}", "train.passes=6", "train.l2=1e-3"]
    mem = run_train(spark, _cfg(*base), data, str(tmp_path / "mem"))
    disk = run_train(spark, _cfg(*base, *_disk(tmp_path)), data, str(tmp_path / "disk"))
    _same_model(str(tmp_path / "mem"), str(tmp_path / "disk"))
    assert disk["objective"] == mem["objective"]
    assert [h["objective"] for h in disk["history"]] == [h["objective"] for h in mem["history"]]
    assert [h.get("holdout_loss") for h in disk["history"]] == [h.get("holdout_loss") for h in mem["history"]]
    assert disk["data"]["holdout_rows"] == mem["data"]["holdout_rows"]
    assert (mem["data"]["holdout_rows"] > 0) == (solver != "cocoa")  # held-out rows from their own cache files
    assert disk["data_cache"]["mode"] == "disk" and disk["data_cache"]["budget_bytes"] == 28 << 20
    assert mem["data_cache"]["mode"] == "memory" and {r["data_cache"]["mode"] for r in mem["per_rank"]} == {"memory"}
    assert [r["data_cache"]["mode"] for r in disk["per_rank"]] == ["disk", "disk"]
    assert all(r["data_cache"]["chunk_rows"] > 0 for r in disk["per_rank"])
    assert disk["per_rank"][0]["csr_bytes"] == next(r["csr_bytes"] for r in mem["per_rank"]
                                                    if r["shard"] == disk["per_rank"][0]["shard"])
    assert (tmp_path / "local" / "terascale-cache").is_dir() and _left(tmp_path) == []


def test_a_killed_attempt_in_disk_mode_resumes_and_the_next_attempt_removes_its_stale_cache(spark, data, tmp_path):
    base = ["train.passes=8", "train.holdout_period=0", "train.early_stop_passes=0", "train.checkpoint_interval_s=0"]
    clean = run_train(spark, _cfg(*base), data, str(tmp_path / "clean"))
    # shard 1's process dies at the end of pass 4 without cleaning up (os._exit): its cache
    # directory stays until a task of the next attempt removes it
    hurt = run_train(spark, _cfg(*base, *_disk(tmp_path), "train.inject.fail_shard=1", "train.inject.fail_pass=4",
                                 "train.inject.fail_mode=kill"), data, str(tmp_path / "hurt"))
    assert [a["outcome"] for a in hurt["attempts"]] == ["failed", "succeeded"]
    assert {r["resumed_from_pass"] for r in hurt["per_rank"]} in ({3}, {4})
    assert sum(r["data_cache"]["stale_removed"] for r in hurt["per_rank"]) >= 1
    assert hurt["objective"] == pytest.approx(clean["objective"], rel=1e-12)
    assert len(hurt["history"]) == len(clean["history"])
    assert _left(tmp_path) == []


def test_a_failed_run_in_disk_mode_leaves_no_cache(spark, data, tmp_path):
    cfg = _cfg("train.solver=online", "train.loss=squared", "train.invariant=false", "train.learning_rate=1e6",
               *_disk(tmp_path))
    with pytest.raises(TrainError, match="DivergenceError"):
        run_train(spark, cfg, data, str(tmp_path / "m"))
    assert (tmp_path / "local" / "terascale-cache").is_dir() and _left(tmp_path) == []
    assert not (tmp_path / "m").exists()


def test_budgets_are_checked_before_the_stage_starts(spark, data, tmp_path):
    with pytest.raises(ConfigError, match=r"train.memory_budget_mb = 20: must be at least 28 with "
                                          r"train.data_cache = 'disk'"):
        run_train(spark, _cfg("train.data_cache=disk", "train.memory_budget_mb=20"), data, str(tmp_path / "m"))
    # derived from the rank's memory: 410 MiB leave less than one block after the rest of the peak (the baseline alone is 400)
    with pytest.raises(ConfigError, match=r"train.memory_budget_mb = 0: must be at least 28 .* here "
                                          r"train.memory_budget_mb = 0: the rank's 410 MiB \(train.rank_memory_mb\)"):
        run_train(spark, _cfg("train.data_cache=disk", "train.rank_memory_mb=410", "train.preflight=off",
                              f"train.cache_dir={tmp_path / 'local'}"), data, str(tmp_path / "m"))
    assert not (tmp_path / "m").exists() and not (tmp_path / "local").exists()  # no task ran
    # auto: the shard fits what the machine leaves a rank, so it stays in memory
    auto = run_train(spark, _cfg("train.data_cache=auto", "train.passes=2", f"train.cache_dir={tmp_path / 'local'}"),
                     data, str(tmp_path / "auto"))
    assert auto["data_cache"]["mode"] == "memory" and "fit" in auto["data_cache"]["why"]
    assert not os.path.exists(tmp_path / "local")
