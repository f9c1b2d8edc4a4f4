"""The train / evaluate / predict jobs on a real Spark session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.scoring import evaluate, predict
from terascale.jobs.train_job import TrainError, run_train
from terascale.pipeline.dataset import plan_shards
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.manifest import read_manifest
from terascale.pipeline.modeldir import ModelError, load_model
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]
EXACT = ["train.solver=lbfgs", "train.holdout_period=0", "train.early_stop_passes=0", "train.passes=200",
         "train.tol=1e-10", "train.l2=1e-3", "spark.master=local[2]"]


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    generate_clicklogs(d / "raw", 8000, files=2, seed=3, processes=1)
    generate_clicklogs(d / "rawt", 2000, files=1, seed=4, processes=1)
    for bits, name, raw in ((16, "tr", "raw"), (16, "te", "rawt"), (17, "tr17", "raw")):
        spec = FeatureSpec(fields=CRITEO_FIELDS, bits=bits, seed=0)
        run_featurize(spark, [str(d / raw)], str(d / name), spec, load_config([], ["featurize.partitions=2"]).featurize)
    return d


def _cfg(*sets):
    return load_config([], ["train.l2=1e-6", *sets])  # l2 pinned: these tests are about other things than train.l2 = auto


def test_k1_and_k2_reach_the_same_optimum_and_write_a_complete_model(spark, data, tmp_path):
    m1 = run_train(spark, _cfg(*EXACT, "train.workers=1"), str(data / "tr"), str(tmp_path / "m1"))
    m2 = run_train(spark, _cfg(*EXACT, "train.workers=2"), str(data / "tr"), str(tmp_path / "m2"))
    assert m2["objective"] == pytest.approx(m1["objective"], rel=1e-7)
    w1, b1, meta = load_model(str(tmp_path / "m1"))
    w2, b2, _ = load_model(str(tmp_path / "m2"))
    assert w1.shape == (1 << 16,) and np.all(np.isfinite(w2))
    assert np.max(np.abs(w1 - w2)) < 1e-3 and b1 == pytest.approx(b2, abs=1e-3)
    assert meta["spec"]["bits"] == 16 and meta["config"]["train"]["workers"] == 1
    assert meta["data"]["train_rows"] == meta["data"]["rows"] == 8000
    h = m2["history"]
    assert [x["pass"] for x in h] == list(range(1, len(h) + 1))
    # the dataset's group map reached the tasks: L-BFGS ran with the 39 fields' coarse correction
    assert h[0]["coarse_groups"] == 39 and m1["history"][0]["coarse_groups"] == 39
    assert all("coarse_groups" not in x for x in h[1:])
    assert all(len(x["compute_s"]) == 2 and len(x["stall_s"]) == 2 and len(x["transfer_s"]) == 2 for x in h)
    assert {r["rank"] for r in m2["per_rank"]} == {0, 1} and sum(r["rows"] for r in m2["per_rank"]) == 8000
    # the executors' environment of jobs.session reached the Python workers (local mode too)
    assert {r["numpy_madvise_hugepage"] for r in m2["per_rank"]} == {"0"}
    assert not list(tmp_path.glob(".*.tmp-*")) and not list(tmp_path.glob("*.checkpoint"))

    r = evaluate(spark, str(data / "te"), str(tmp_path / "m2"))
    assert r["rows"] == 2000 and 0.3 < r["logloss"] < 0.7 and 0.6 < r["auroc"] < 1.0
    p = predict(spark, str(data / "te"), str(tmp_path / "m2"), str(tmp_path / "pred"), ("label",))
    t = pq.read_table(tmp_path / "pred" / p["files"][0]["path"])
    assert p["rows"] == 2000 and set(t.column_names) == {"probability", "label"}
    probs = np.concatenate([pq.read_table(tmp_path / "pred" / f["path"])["probability"].to_numpy() for f in p["files"]])
    labels = np.concatenate([pq.read_table(tmp_path / "pred" / f["path"])["label"].to_numpy() for f in p["files"]])
    ll = -np.mean(labels * np.log(probs) + (1 - labels) * np.log1p(-probs))
    assert ll == pytest.approx(r["logloss"], rel=1e-9)  # predict and evaluate score identically
    # evaluate's objective is the catalogue's f with the model's l2: on the training rows (no
    # held-out split here) it is the objective the train job reports (float32 weights: ~1e-7)
    on_train = evaluate(spark, str(data / "tr"), str(tmp_path / "m2"))
    assert on_train["objective"] == pytest.approx(m2["objective"], rel=1e-6)
    assert "b unpenalized" in on_train["objective_definition"]


def test_cocoa_reports_the_one_objective_and_its_intercept_penalty_vanishes_as_the_scale_grows(
        spark, data, tmp_path):
    """CoCoA penalizes its constant feature's coefficient: it minimises f + (l2/2)(b/s)^2. The
    model's reported objective is f itself (evaluate agrees), within that penalty of L-BFGS's
    optimum of f, and closer to it with a larger train.intercept_scale s."""
    exact = run_train(spark, _cfg(*EXACT, "train.workers=2"), str(data / "tr"), str(tmp_path / "lbfgs"))
    gaps = []
    for scale in (1.0, 4.0):
        sets = ["train.solver=cocoa", "train.l2=1e-3", "train.passes=300", "train.tol=1e-9", "train.workers=2",
                f"train.intercept_scale={scale}", "spark.master=local[2]"]
        cocoa = run_train(spark, _cfg(*sets), str(data / "tr"), str(tmp_path / f"cocoa{scale}"))
        assert evaluate(spark, str(data / "tr"), str(tmp_path / f"cocoa{scale}"))["objective"] == pytest.approx(
            cocoa["objective"], rel=1e-6)
        gap = cocoa["objective"] - exact["objective"]
        b = load_model(str(tmp_path / f"cocoa{scale}"))[1]
        assert -1e-7 < gap <= 0.5e-3 * (b / scale) ** 2 + 1e-6
        gaps.append(gap)
    assert gaps[1] < gaps[0] / 4


HOLDOUT_APP = """
import json, sys
from terascale.jobs.config import load_config
from terascale.jobs.session import get_spark
from terascale.jobs.train_job import run_train

data, out = sys.argv[1], sys.argv[2]
base = ["train.solver=lbfgs", "train.holdout_period=10", "train.passes=200", "train.tol=1e-10", "train.l2=1e-3",
        "spark.master=local[3]"]
spark = get_spark(load_config([], base).spark)
res = {}
for stop in (0, 3):
    for k in (1, 3):
        cfg = load_config([], [*base, f"train.early_stop_passes={stop}", f"train.workers={k}"])
        m = run_train(spark, cfg, data, f"{out}/m{stop}-{k}")
        res[f"{stop}/{k}"] = {key: m[key] for key in ("objective", "stop_reason", "history", "data", "per_rank")}
print(json.dumps(res))
"""


def test_k1_and_k3_hold_out_the_same_rows_and_reach_the_same_optimum(data, tmp_path):
    """Held-out rows by row identity (solvers.holdout): 1 and 3 workers train on the same rows.
    The files are rewritten in row groups of 333 rows, so 3 shards split files at row-group
    boundaries that are no multiple of the period (a split by position in the shard would differ).
    In a subprocess: 3 barrier tasks need local[3]."""
    ds = tmp_path / "tr333"
    shutil.copytree(data / "tr", ds)
    manifest = read_manifest(str(ds))
    for f in manifest["files"]:
        pq.write_table(pq.read_table(ds / f["path"]), ds / f["path"], row_group_size=333, write_page_checksum=True)
    shards = plan_shards(str(ds), 3, manifest)
    assert max(len({i for i, s in enumerate(shards) for p in s if p.name == f["path"]}) for f in manifest["files"]) > 1
    r = subprocess.run([sys.executable, "-c", HOLDOUT_APP, str(ds), str(tmp_path)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for stop in (0, 3):
        one, three = res[f"{stop}/1"], res[f"{stop}/3"]
        assert one["data"]["holdout_rows"] == three["data"]["holdout_rows"]
        assert one["data"]["train_rows"] == three["data"]["train_rows"] == 8000 - one["data"]["holdout_rows"]
        assert abs(one["data"]["holdout_rows"] - 800) < 5 * 27  # binomial(8000, 1/10): sd 27
        assert sum(x["rows"] for x in three["per_rank"]) == three["data"]["train_rows"]
        assert three["objective"] == pytest.approx(one["objective"], rel=1e-7)
        assert three["stop_reason"] == one["stop_reason"]
        # the same held-out rows: the same held-out loss at every pass both made
        n = min(len(one["history"]), len(three["history"]))
        np.testing.assert_allclose([h["holdout_loss"] for h in three["history"][:n]],
                                   [h["holdout_loss"] for h in one["history"][:n]], rtol=1e-7)
    assert res["0/1"]["stop_reason"] != "early_stop" and res["3/1"]["stop_reason"] == "early_stop"
    assert len(res["3/1"]["history"]) == len(res["3/3"]["history"])  # early stopping stops at the same pass


def test_a_rank_far_behind_in_a_late_pass_is_waited_for_with_the_same_model(spark, data, tmp_path):
    """Shard 1 pauses 3 x allreduce.io_timeout_s after pass 2, alive: its neighbours wait on its
    heartbeats; one attempt, and the model equals the undisturbed run's bit for bit."""
    base = [*EXACT, "train.workers=2", "train.passes=5", "allreduce.io_timeout_s=1"]
    clean = run_train(spark, _cfg(*base), str(data / "tr"), str(tmp_path / "clean"))
    late = run_train(spark, _cfg(*base, "train.inject.late_shard=1", "train.inject.late_pass=2",
                                 "train.inject.late_s=3"), str(data / "tr"), str(tmp_path / "late"))
    assert [a["outcome"] for a in late["attempts"]] == ["succeeded"]
    assert late["history"][2]["elapsed_s"] - late["history"][1]["elapsed_s"] > 3.0  # pass 3 waited for shard 1
    w0, b0, _ = load_model(str(tmp_path / "clean"))
    w1, b1, _ = load_model(str(tmp_path / "late"))
    assert np.array_equal(w0.view(np.uint32), w1.view(np.uint32)) and b0 == b1
    assert late["objective"] == clean["objective"]


def test_killed_attempt_resumes_from_checkpoint(spark, data, tmp_path):
    base = ["train.workers=2", "train.passes=8", "train.holdout_period=0", "train.early_stop_passes=0",
            "train.checkpoint_interval_s=0", "spark.master=local[2]"]
    clean = run_train(spark, _cfg(*base), str(data / "tr"), str(tmp_path / "clean"))
    hurt = run_train(spark, _cfg(*base, "train.inject.fail_shard=1", "train.inject.fail_pass=4",
                                 "train.inject.fail_mode=kill"), str(data / "tr"), str(tmp_path / "hurt"))
    assert [a["outcome"] for a in hurt["attempts"]] == ["failed", "succeeded"]
    assert "crashed" in hurt["attempts"][0]["error"] or "PeerLost" in hurt["attempts"][0]["error"]
    # shard 1 dies at the end of pass 4, after that pass's collective: rank 0 may or may not have
    # checkpointed pass 4 before Spark stopped the stage; both are complete checkpoints
    resumed = {r["resumed_from_pass"] for r in hurt["per_rank"]}
    assert resumed in ({3}, {4})
    assert hurt["objective"] == pytest.approx(clean["objective"], rel=1e-12)
    assert len(hurt["history"]) == len(clean["history"])


@pytest.mark.parametrize("damage", ["truncate", "drop_json"])
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(spark, data, tmp_path, damage):
    base = ["train.workers=2", "train.passes=6", "train.holdout_period=0", "train.early_stop_passes=0",
            "train.checkpoint_interval_s=0", "spark.master=local[2]"]
    clean = run_train(spark, _cfg(*base), str(data / "tr"), str(tmp_path / "clean"))
    # rank 0 fails at the end of pass 4 before checkpointing it, having damaged pass 3's checkpoint
    hurt = run_train(spark, _cfg(*base, "train.inject.fail_shard=0", "train.inject.fail_pass=4",
                                 f"train.inject.corrupt_checkpoint={damage}"), str(data / "tr"), str(tmp_path / "hurt"))
    assert [a["outcome"] for a in hurt["attempts"]] == ["failed", "succeeded"]
    assert {r["resumed_from_pass"] for r in hurt["per_rank"]} == {2}
    assert hurt["objective"] == pytest.approx(clean["objective"], rel=1e-12)
    assert len(hurt["history"]) == len(clean["history"])
    assert not (tmp_path / "hurt.checkpoint").exists()


def test_no_usable_checkpoint_fails_at_once_with_a_checkpoint_error(spark, data, tmp_path):
    cfg = _cfg("train.workers=2", "train.passes=4", "train.checkpoint_interval_s=0", "train.inject.fail_shard=0",
               "train.inject.fail_pass=2", "train.inject.corrupt_checkpoint=flip", "spark.master=local[2]")
    with pytest.raises(TrainError, match=r"CheckpointError: no usable checkpoint to resume from: checkpoint \S+pass-000001\.a00\.npz"):
        run_train(spark, cfg, str(data / "tr"), str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()


def test_divergence_stops_with_a_clear_error_and_no_model(spark, data, tmp_path):
    cfg = _cfg("train.solver=online", "train.loss=squared", "train.invariant=false", "train.learning_rate=1e6",
               "train.workers=2", "spark.master=local[2]")
    with pytest.raises(TrainError, match="DivergenceError"):
        run_train(spark, cfg, str(data / "tr"), str(tmp_path / "m"))
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.tmp-*")) and not list(tmp_path.glob(".m.old-*"))


def test_init_model_must_share_the_feature_spec(spark, data, tmp_path):
    cfg = _cfg("train.workers=1", "train.passes=3", "spark.master=local[2]")
    run_train(spark, cfg, str(data / "tr"), str(tmp_path / "m"))
    with pytest.raises(ModelError, match=r"feature spec differs from the data's \(bits: model 16 vs data 17\)"):
        run_train(spark, _cfg("train.workers=1", f"train.init_model={tmp_path / 'm'}"), str(data / "tr17"), str(tmp_path / "m2"))
    warm = run_train(spark, _cfg("train.workers=1", "train.passes=3", f"train.init_model={tmp_path / 'm'}",
                                 "train.holdout_period=0", "train.early_stop_passes=0"),
                     str(data / "tr"), str(tmp_path / "m3"))
    assert warm["history"][0]["pass"] == 1 and np.isfinite(warm["objective"])


@pytest.mark.slow
def test_train_on_local_cluster_through_the_cli(data, tmp_path):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    r = subprocess.run([sys.executable, "-m", "terascale.jobs.cli", "train", "--input", str(data / "tr"), "--model",
                        str(tmp_path / "m"), "--set", "spark.master=local-cluster[2,1,1024]", "--set", "train.workers=2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((tmp_path / "m" / "metadata.json").read_text())
    assert len(meta["per_rank"]) == 2 and np.isfinite(meta["objective"])
    assert meta["regularization"]["penalty"] == "l2"  # the default train.l2 = auto fits a path


def test_cocoa_through_the_job_and_resume_from_per_rank_checkpoints(spark, data, tmp_path):
    base = ["train.solver=cocoa", "train.l2=1e-2", "train.passes=300", "train.tol=1e-8",
            "train.checkpoint_interval_s=0", "spark.master=local[2]"]
    one = run_train(spark, _cfg(*base, "train.workers=1"), str(data / "tr"), str(tmp_path / "c1"))
    two = run_train(spark, _cfg(*base, "train.workers=2"), str(data / "tr"), str(tmp_path / "c2"))
    assert one["data"]["train_rows"] == two["data"]["train_rows"] == 8000  # no held-out rows for cocoa
    assert two["history"][-1]["gap"] < 1e-6 and one["history"][-1]["gap"] < 1e-6
    assert two["objective"] == pytest.approx(one["objective"], rel=1e-6)
    hurt = run_train(spark, _cfg(*base, "train.workers=2", "train.inject.fail_shard=1", "train.inject.fail_pass=3",
                                 "train.inject.fail_mode=raise"), str(data / "tr"), str(tmp_path / "c3"))
    assert [a["outcome"] for a in hurt["attempts"]] == ["failed", "succeeded"]
    assert {r["resumed_from_pass"] for r in hurt["per_rank"]} in ({2}, {3})
    assert hurt["objective"] == pytest.approx(two["objective"], rel=1e-12)
    # rows re-dealt every round: the same optimum, and a failed attempt resumes too
    redeal = run_train(spark, _cfg(*base, "train.workers=2", "train.partition=redeal", "train.inject.fail_shard=0",
                                   "train.inject.fail_pass=3", "train.inject.fail_mode=raise"),
                       str(data / "tr"), str(tmp_path / "c4"))
    assert [a["outcome"] for a in redeal["attempts"]] == ["failed", "succeeded"]
    assert redeal["history"][-1]["gap"] < 1e-6
    assert redeal["objective"] == pytest.approx(one["objective"], rel=1e-6)
    r = evaluate(spark, str(data / "te"), str(tmp_path / "c2"))
    assert 0.3 < r["logloss"] < 0.7


def test_ranks_holding_different_checkpoints_agree_on_one_resume_pass(spark, data, tmp_path):
    base = ["train.solver=cocoa", "train.l2=1e-2", "train.passes=8", "train.tol=0", "train.workers=2",
            "train.checkpoint_interval_s=0", "spark.master=local[2]"]
    clean = run_train(spark, _cfg(*base), str(data / "tr"), str(tmp_path / "clean"))
    # per-rank checkpoints: both ranks hold passes 2 and 3; shard 1 fails at pass 4 after
    # flipping a byte of its pass-3 checkpoint, so rank 0 starts the next attempt from pass 3,
    # rank 1 from pass 2; the first collective finds it out and both restart from pass 2
    hurt = run_train(spark, _cfg(*base, "train.inject.fail_shard=1", "train.inject.fail_pass=4",
                                 "train.inject.corrupt_checkpoint=flip"), str(data / "tr"), str(tmp_path / "hurt"))
    assert [a["outcome"] for a in hurt["attempts"]] == ["failed", "succeeded"]
    assert [(r["rank"], r["resumed_from_pass"]) for r in hurt["per_rank"]] == [(0, 2), (1, 2)]
    assert hurt["objective"] == pytest.approx(clean["objective"], rel=1e-12)
    assert [h["pass"] for h in hurt["history"]] == [h["pass"] for h in clean["history"]]


def test_cocoa_device_auto_falls_back_and_gpu_fails_clearly_without_a_gpu(spark, data, tmp_path):
    from terascale.solvers.scd.gpu import gpu_available

    if gpu_available()[0]:
        pytest.skip("this machine has a GPU")
    base = ["train.solver=cocoa", "train.l2=1e-2", "train.passes=50", "train.workers=2", "spark.master=local[2]"]
    cpu = run_train(spark, _cfg(*base), str(data / "tr"), str(tmp_path / "cpu"))
    auto = run_train(spark, _cfg(*base, "train.device=auto"), str(data / "tr"), str(tmp_path / "auto"))
    assert auto["objective"] == cpu["objective"]  # the same CPU solver ran
    with pytest.raises(TrainError, match=r"train.device = 'gpu' but this task has no usable GPU") as e:
        run_train(spark, _cfg(*base, "train.device=gpu"), str(data / "tr"), str(tmp_path / "gpu"))
    assert "all 3 attempts" not in str(e.value)  # not retried: a retry would only repeat it
    assert not (tmp_path / "gpu").exists()


def test_report_of_a_real_run(spark, data, tmp_path):
    import struct
    from html.parser import HTMLParser

    from terascale.jobs.cli import main as cli

    meta = run_train(spark, _cfg("train.workers=2", "train.passes=4", "spark.master=local[2]"), str(data / "tr"),
                     str(tmp_path / "m"))
    metrics = evaluate(spark, str(data / "te"), str(tmp_path / "m"))
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    # a published pointer serves wherever a model directory does
    from terascale.pipeline.pointer import publish

    publish(str(tmp_path / "m"), str(tmp_path / "current"))
    via = evaluate(spark, str(data / "te"), str(tmp_path / "current"))
    assert via["model"] == metrics["model"] and via["logloss"] == metrics["logloss"]
    assert cli(["report", str(tmp_path / "m"), "--eval", str(tmp_path / "metrics.json"), "--out", str(tmp_path / "r")]) == 0
    names = ["objective_by_pass", "objective_by_time", "rank_timings", "memory", "roc", "precision_recall", "calibration"]
    # the report beside the model (as make demo writes it) is the
    # model directory's own: a later run may replace the directory (demo's second run did not)
    from terascale.pipeline import artifacts

    assert cli(["report", str(tmp_path / "m"), "--eval", str(tmp_path / "metrics.json"), "--out", str(tmp_path / "m")]) == 0
    found = artifacts.inspect(str(tmp_path / "m"))
    assert found.kind == artifacts.MODEL and found.foreign == [], found
    assert {f"{n}.png" for n in names} <= {p.name for p in (tmp_path / "m").iterdir()}
    for n in names:
        png = (tmp_path / "r" / f"{n}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        w, h = struct.unpack(">II", png[16:24])
        assert 200 < w < 3000 and 200 < h < 3000, n

    class Collect(HTMLParser):
        imgs, tags = [], []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            if tag == "img":
                self.imgs.append(dict(attrs))

    page = (tmp_path / "r" / "report.html").read_text()
    c = Collect()
    c.feed(page)
    assert sorted(i["alt"] for i in c.imgs) == sorted(names)
    assert all(i["src"].startswith("data:image/png;base64,iVBORw0KGgo") for i in c.imgs)  # embedded PNGs
    assert f"{meta['objective']:.6f}" in page and f"{metrics['auroc']:.6f}" in page
    assert "rank 1" in page
