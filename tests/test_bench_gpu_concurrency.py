"""bench_gpu_concurrency: the model's sweep on tiny data, and how it finds a device run to set
beside it."""

from __future__ import annotations

import json
import os

from tests.benchmarks import bench_gpu_concurrency as bench


def test_the_sweep_runs_every_tau_damped_and_not_on_tiny_data(monkeypatch):
    monkeypatch.setattr(bench, "ROWS", 600)
    monkeypatch.setattr(bench, "TAUS", (1, 8))
    monkeypatch.setattr(bench, "EPS", 1e-2)
    monkeypatch.setattr(bench, "MAX_ROUNDS", 40)
    monkeypatch.setattr(bench, "UNDAMPED_ROUNDS", 10)
    monkeypatch.setattr(bench, "HOT_TAUS", (8,))
    out = bench.main()
    assert out["rows"] == 600 and out["taus"] == [1, 8]
    assert set(out["problems"]) == {"squared_dual", "logistic_dual", "squared_dual_hot_block", "logistic_dual_hot_block"}
    for loss in ("squared", "logistic"):
        seq, hot, hot_max = out["problems"].pop(f"{loss}_dual_hot_block")
        assert (seq["tau"], seq["hot_features"], hot["tau"], hot_max["tau"]) == (1, 0, 8, 8)
        assert 1 <= hot["hot_features"] <= hot_max["hot_features"]  # theta 1 >= 8 / 4224
        assert seq["epochs_vs_sequential"] == 1.0 and hot["epochs_to_gap"] and hot_max["epochs_to_gap"]
    for runs in out["problems"].values():
        assert [(r["tau"], r["damped"]) for r in runs] == [(1, False), (8, True), (8, False)]
        first = runs[0]
        assert first["epochs_to_gap"] and first["epochs_vs_sequential"] == 1.0
        for r in runs:
            assert r["epochs_to_gap"] is None or r["final_gap_over_p0"] <= 1e-2


def test_the_device_epochs_come_from_the_newest_run_that_has_them(tmp_path, monkeypatch):
    def write(name, problems):
        (tmp_path / name).mkdir()
        (tmp_path / name / "gpu_scd.json").write_text(json.dumps({"device": name, "problems": problems}))

    def dual(gpu, seq):
        return {"gpu": {"epochs_to_gap": gpu, "concurrency": 4224}, "cpu_seq": {"epochs_to_gap": seq}}

    write("h100-b", {"squared_dual": dual(124, 4), "logistic_dual": dual(26, 3)})
    write("h100-a", {"squared_dual": dual(None, 4)})  # newer, but it never reached the gap
    os.utime(tmp_path / "h100-b" / "gpu_scd.json", (1_000_000, 1_000_000))
    os.utime(tmp_path / "h100-a" / "gpu_scd.json", (2_000_000, 2_000_000))
    monkeypatch.setattr(bench, "DEVICE_RESULTS", tmp_path)
    got = bench.device_epochs()
    assert got["run"] == "h100-b" and got["squared"]["epochs_to_gap"] == 124
    assert got["logistic"] == {"epochs_to_gap": 26, "cpu_seq_epochs": 3, "concurrency": 4224}
    monkeypatch.setattr(bench, "DEVICE_RESULTS", tmp_path / "none")
    assert bench.device_epochs() == {}


def test_make_bench_runs_it():
    from tests.benchmarks.__main__ import available

    assert "gpu_concurrency" in available() and not getattr(bench, "EXPLICIT_ONLY", False)
