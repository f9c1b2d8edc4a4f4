"""The peers-at-scale benchmark's arithmetic (tests/benchmarks/bench_scale_peers.py): its streamed
objective is the in-memory one of the training benchmark, row group by row group, and its
targets read the histories as they should. The 30-minute run itself is ``make bench``'s."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.pipeline.dataset import read_dataset
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec
from tests.benchmarks import bench_scale_peers as peers
from tests.benchmarks.bench_train import objective as in_memory_objective


@pytest.mark.spark
def test_the_streamed_objective_is_the_in_memory_one(spark, tmp_path):
    generate_clicklogs(tmp_path / "raw", 3000, files=1, seed=3, processes=1)
    run_featurize(spark, [str(tmp_path / "raw")], str(tmp_path / "ds"), FeatureSpec(fields=CRITEO_FIELDS, bits=12, seed=0),
                  load_config([], ["featurize.partitions=3"]).featurize)
    csr, _ = read_dataset(str(tmp_path / "ds"))
    x, y = csr.to_scipy().astype(np.float64), csr.labels.astype(np.float64)
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, 1 << 12)
    got = peers.objective(str(tmp_path / "ds"), w, -1.1, 1e-3)
    assert got == pytest.approx(in_memory_objective(x, y, w, -1.1, 1e-3), rel=1e-12)
    # a penalty over another vector (VW's: its constant's slot left out) changes only the penalty
    pen = w.copy()
    pen[7] = 0.0
    assert peers.objective(str(tmp_path / "ds"), w, -1.1, 1e-3, pen) == pytest.approx(got - 0.5e-3 * w[7] ** 2, rel=1e-12)


def _run(history, peer, peer_s, peer_obj):
    ts = {"history": history}
    return {"terascale": ts, peer: {"versus": peers._versus(ts, peer_s, peer_obj)}}


def test_targets_read_the_first_pass_at_or_below_the_peers_objective():
    h = [{"objective": 0.50, "elapsed_s": 2.0, "elapsed_all_s": 1.0},
         {"objective": 0.45, "elapsed_s": 4.0, "elapsed_all_s": 3.0},
         {"objective": 0.44, "elapsed_s": 5.0, "elapsed_all_s": 4.0}]
    runs = {"2000000": _run(h, "mllib", 60.0, 0.45),   # reached at 4 s: 15x
            "10000000": _run(h, "mllib", 80.0, 0.44),  # at 5 s: 16x, holds
            "30000000": _run(h, "vw", 100.0, 0.445)}   # at 5 s: 0.05 of VW's
    out = peers.summary(runs, [2_000_000, 10_000_000], [30_000_000])
    assert out["mllib_ratio"] == {"2000000": 15.0, "10000000": 16.0}
    assert out["mllib_ratio_since_all_loaded"] == {"2000000": 20.0, "10000000": 20.0}
    assert out["mllib_target_met"] is True
    assert out["vw_time_fraction"] == {"30000000": pytest.approx(0.05)} and out["vw_target_met"] is True
    h[1].update(start_objective=0.446, start_objective_s=0.5)  # inside pass 2, 0.5 s after pass 1 ended
    out = peers.summary({"30000000": _run(h, "vw", 100.0, 0.446)}, [], [30_000_000])
    assert out["vw_time_fraction"] == {"30000000": pytest.approx(0.025)}  # known at 2.5 s, not 4 s
    assert peers._versus({"history": h}, 100.0, 0.446)["elapsed_all_s"]["time_to_peer_objective_s"] == 1.5
    runs["10000000"] = _run(h, "mllib", 70.0, 0.44)  # 14x < 15x
    runs["30000000"] = _run(h, "vw", 100.0, 0.40)    # never reached
    out = peers.summary(runs, [2_000_000, 10_000_000], [30_000_000])
    assert out["mllib_target_met"] is False
    assert out["vw_time_fraction"] == {"30000000": None} and out["vw_target_met"] is False
