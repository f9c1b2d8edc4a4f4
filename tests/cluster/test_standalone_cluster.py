"""terascale on a real Spark standalone cluster (a master and two workers on 127.0.0.1),
submitted with ``spark-submit`` and the ``make dist`` artifacts exactly as docs/pages/how-to/cluster.md shows:
featurize -> train -> evaluate, with one executor's JVM killed mid-training: the driver retries
the barrier stage, the new attempt resumes from the last checkpoint and ends at the objective of
the same training run undisturbed (in local mode, same shards), and the cluster's evaluation
equals local mode's.

Run by ``make test`` / ``make test-cluster``, which build ``dist/`` and set TERASCALE_DIST.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cluster.standalone import Dist, StandaloneCluster, spark_submit, wait

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.spark]

DIST = os.environ.get("TERASCALE_DIST", "")
TRAIN = ["--set", "train.workers=2", "--set", "train.spares=0", "--set", "train.passes=8", "--set", "train.l2=1e-6",
         "--set", "train.checkpoint_interval_s=0"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not DIST:
        pytest.skip("needs the make dist artifacts: run through `make test` or `make test-cluster`")
    from terascale.pipeline.generate import generate_clicklogs

    work = tmp_path_factory.mktemp("standalone")
    dist = Dist(Path(DIST), tmp_path_factory.getbasetemp())  # one unpacked env per session
    generate_clicklogs(str(work / "raw"), 60_000, files=2, seed=11, malformed_rate=0.01)
    with StandaloneCluster(work / "cluster", workers=2, cores=1) as cluster:
        yield SimpleNamespace(work=work, dist=dist, cluster=cluster)


def _run(site, job: str, args: list[str], name: str, **kw) -> str:
    rc, log = wait(spark_submit(site.cluster, site.dist, job, args, site.work / f"{name}.log", **kw))
    assert rc == 0, f"spark-submit {job} exited {rc}:\n{log[-6000:]}"
    return log


@pytest.fixture(scope="module")
def featurized(site) -> Path:
    out = site.work / "data"
    log = _run(site, "featurize", ["--input", str(site.work / "raw"), "--output", str(out)], "featurize")
    assert f"master={site.cluster.master_url}" in log  # really on the cluster, not local mode
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["quarantine"]["rows"] > 0  # the generator's malformed lines
    for f in manifest["per_input"]:  # rows in = rows featurized + rows quarantined, per file
        assert f["lines"] == f["rows"] + f["quarantined"], f
    assert manifest["rows"] + manifest["quarantine"]["rows"] == manifest["lines"]
    return out


@pytest.fixture(scope="module")
def reference(site, featurized, spark, tmp_path_factory) -> dict:
    """The same training, undisturbed, in local mode (the same shards and solver)."""
    from terascale.jobs.config import load_config
    from terascale.jobs.train_job import run_train

    sets = [a for a in TRAIN if a != "--set"]
    return run_train(spark, load_config(sets=sets), str(featurized), str(tmp_path_factory.mktemp("ref") / "m"))


@pytest.fixture(scope="module")
def faulted(site, featurized) -> tuple[dict, str]:
    """Training on the cluster with one executor's JVM killed mid-training."""
    model = site.work / "model"
    ckpt = Path(str(model) + ".checkpoint")
    p = spark_submit(site.cluster, site.dist, "train",
                     ["--input", str(featurized), "--model", str(model), *TRAIN,
                      # every pass lasts at least 1 s: the kill, as soon as pass 2's checkpoint is
                      # seen (polled every 0.2 s), lands with at least 6 passes (6 s) still to run
                      "--set", "train.inject.pass_delay_s=1"], site.work / "train.log")
    deadline = time.monotonic() + 400
    # a checkpoint is complete when its manifest (run-RUN/pass-PPPPPP.aAA.json, written last) lands
    while not any(ckpt.glob("run-*/pass-000002.a*.json")):
        assert p.poll() is None, f"training ended before the fault:\n{Path(p.log.name).read_text()[-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint of pass 2 within 400 s"
        time.sleep(0.2)
    victims = site.cluster.executor_pids()
    assert len(victims) == 2, victims
    os.kill(victims[0], signal.SIGKILL)  # the executor JVM dies mid-training, as a lost node would
    rc, log = wait(p)
    assert rc == 0, log[-6000:]
    assert f"master={site.cluster.master_url}" in log
    assert not ckpt.exists()  # checkpoints are removed once the model is committed
    return json.loads((model / "metadata.json").read_text()), log


def test_killed_executor_is_retried_and_resumes_from_checkpoint(faulted, reference):
    meta, log = faulted
    assert [a["outcome"] for a in meta["attempts"]] == ["failed", "succeeded"]
    why = meta["attempts"][0]["error"]
    assert re.search(r"ExecutorLostFailure|executor \S+ exited|lost", why), why
    # the log says what failed and that it was retried
    assert f"attempt 1 failed: {why}" in log and "attempt 2 of 3" in log
    resumed = {r["resumed_from_pass"] for r in meta["per_rank"]}
    assert resumed and all(r is not None and r >= 2 for r in resumed), resumed
    assert {r["shard"] for r in meta["per_rank"]} == {0, 1}
    # the driver's console progress (which passes it shows depends on when it polls)
    assert re.search(r"progress: pass [1-8]/8 done, rows [\d,]+/pass", log), log[-3000:]
    # the same run as an undisturbed one
    assert [h["pass"] for h in meta["history"]] == [h["pass"] for h in reference["history"]]
    assert meta["objective"] == pytest.approx(reference["objective"], rel=1e-6)
    assert meta["data"]["train_rows"] == reference["data"]["train_rows"]


def test_evaluate_on_cluster_matches_local_mode(site, featurized, faulted, spark):
    from terascale.jobs.scoring import evaluate

    model = site.work / "model"
    out = site.work / "metrics.json"
    _run(site, "evaluate", ["--input", str(featurized), "--model", str(model), "--out", str(out)], "evaluate")
    on_cluster = json.loads(out.read_text())
    local = evaluate(spark, str(featurized), str(model))  # the same job in local mode
    assert on_cluster["rows"] == local["rows"] == faulted[0]["data"]["rows"]
    for k in ("logloss", "auroc", "auprc", "normalized_entropy", "calibration"):
        assert on_cluster[k] == pytest.approx(local[k], rel=1e-9, abs=1e-12), k
    assert on_cluster["logloss"] < 0.7
