"""The scale benchmark harness (tests/benchmarks/bench_scale.py) end to end at 20,000 rows, and
its measuring parts on processes whose figures are known.

The end-to-end run is the user's command (``python -m tests.benchmarks scale``) with real Spark
jobs in real subprocesses; the assertions are on its JSON against facts the test knows (rows
generated, bytes on disk, the ranks' own peak RSS) and never on wall-clock times.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.benchmarks import scale_disk
from tests.benchmarks.__main__ import available, split_argv
from tests.benchmarks.measured import run_measured
from tests.benchmarks.proc_watch import classify

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
ROWS, TEST_ROWS, PER_FILE = 20_000, 4_000, 10_000
SPARK_STAGES = ("featurize", "featurize_test", "train", "evaluate", "predict")


def test_arguments_after_a_name_go_to_that_benchmark():
    assert split_argv([]) == []
    assert split_argv(["featurize", "train"]) == [("featurize", []), ("train", [])]
    assert split_argv(["train", "scale", "--rows", "5", "--stop-after", "train"]) == [
        ("train", []), ("scale", ["--rows", "5", "--stop-after", "train"])]
    with pytest.raises(ValueError):
        split_argv(["--rows", "5"])
    from tests.benchmarks import bench_scale

    assert "scale" in available() and bench_scale.EXPLICIT_ONLY  # `make bench` alone skips it


def test_processes_are_classified_by_command_line_and_parent():
    py = "/v/bin/python"
    assert classify([py, "/v/bin/terascale", "train", "--input", "x"], None) == "python_driver"
    assert classify(["/usr/lib/jvm/java-17/bin/java", "-cp", "x", "org.apache.spark.deploy.SparkSubmit"], "python_driver") == "jvm"
    assert classify(["java", "-cp", "x", "org.apache.spark.launcher.Main"], "other") == "other"
    assert classify([py, "-m", "pyspark.daemon", "pyspark.worker"], "jvm") == "python_daemon"
    assert classify([py, "-m", "pyspark.daemon", "pyspark.worker"], "python_daemon") == "python_worker"
    assert classify([py, "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"], "python_driver") == "python_pool"
    assert classify([py, "/r/tests/benchmarks/io_wrap.py", "o.json", "terascale"], None) == "wrapper"
    assert classify(["bash", "spark-class"], "python_driver") == "other"


def test_a_tree_is_measured_whole_orphans_and_short_lived_processes_included(tmp_path):
    """A child writes 1 MiB and starts two grandchildren: one lives a second, writes 2 MiB and is
    waited for, one holds 96 MiB for two seconds, writes 3 MiB and outlives its parent (an orphan).
    The wrapper's counts hold every byte once (exact, whatever the timing); the watcher, which
    samples every 50 ms, sees every process (each lives a second: 20 samples) and the orphan's
    peak."""
    grandchild = "import sys, time; b = bytearray({hold} << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep({s}); open(sys.argv[1], 'wb').write(b'z' * ({mib} << 20))"
    child = textwrap.dedent(f"""
        import subprocess, sys
        open({str(tmp_path / 'c')!r}, 'wb').write(b'y' * (1 << 20))
        subprocess.Popen([sys.executable, '-c', {grandchild.format(hold=96, s=2.0, mib=3)!r}, {str(tmp_path / 'orphan')!r}])
        subprocess.run([sys.executable, '-c', {grandchild.format(hold=0, s=1.0, mib=2)!r}, {str(tmp_path / 'waited')!r}])
    """)  # exits without waiting for the first grandchild
    with open(tmp_path / "out", "wb") as out:
        r = run_measured([sys.executable, "-c", child], disk_path=str(tmp_path), io_json=tmp_path / "io.json",
                         stdout=out, stderr=out, interval=0.05)
    assert r["returncode"] == 0 and r["unreaped"] == [] and r["orphans_reaped"] == 1
    assert (tmp_path / "orphan").stat().st_size == 3 << 20  # it finished after its parent
    assert 6 * MiB <= r["io"]["wchar"] < 6 * MiB + 256 * 1024
    assert 96 * MiB <= r["rss_peak_bytes"]["python_pool"]["max"] < 160 * MiB
    assert r["rss_peak_bytes"]["python_pool"]["processes"] == 3
    assert r["cpu_s"] > 0 and r["command_s"] < r["wall_s"]
    assert r["min_free_disk_bytes"] <= r["free_disk_before_bytes"]


def test_a_partial_run_never_replaces_a_whole_one(tmp_path):
    from tests.benchmarks.scale_figures import merge_run

    path = tmp_path / "scale.json"
    for run in ({"rows": 30, "stop_after": "score", "v": 1}, {"rows": 4, "stop_after": "score", "v": 2},
                {"rows": 30, "stop_after": "train", "v": 3}, {"rows": 4, "stop_after": "score", "v": 4}):
        path.write_text(json.dumps(merge_run(path, run)))
    runs = json.loads(path.read_text())["runs"]
    assert list(runs) == ["4", "30", "30:train"] and [r["v"] for r in runs.values()] == [4, 1, 3]


def test_a_run_that_does_not_fit_the_disk_is_refused_before_anything_is_written(tmp_path):
    free, _ = scale_disk.free_and_total(str(tmp_path))
    rows = free // scale_disk.PER_TRAIN_ROW + 1
    with pytest.raises(scale_disk.DiskRefused, match="GB free"):
        scale_disk.check(str(tmp_path), rows, 1, 1)
    r = _bench(tmp_path, "--rows", str(rows), "--workdir", str(tmp_path / "w"))
    assert r.returncode != 0 and "refused" in r.stderr and "GB free" in r.stderr
    assert not (tmp_path / "w").exists()


def test_a_work_folder_holding_anything_else_is_refused_and_left_alone(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    (w / "notes.txt").write_text("mine")
    r = _bench(tmp_path, "--rows", "100", "--workdir", str(w))
    assert r.returncode != 0 and "notes.txt" in r.stderr
    assert sorted(p.name for p in w.iterdir()) == ["notes.txt"]


def _bench(results: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TERASCALE_BENCH_RESULTS": str(results), "PYTHONHASHSEED": "0"}
    return subprocess.run([sys.executable, "-m", "tests.benchmarks", "scale", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    """One full run at ROWS with the fault drill (data removed after it; what it left is listed;
    every pass slowed by 0.25 s and checkpointed: the last third of the passes lasts more than
    twice rank 0's 2 s progress-file interval, so the drill sees a late pass and its kill lands
    inside one, however fast the machine), then a generate-only run at 3,000 rows with --keep in the same work folder (which replaces the
    first run's files there, and adds a run of another N to the results)."""
    results = tmp_path_factory.mktemp("scale")
    work = results / "work"
    full = _bench(results, "--rows", str(ROWS), "--rows-per-file", str(PER_FILE), "--test-rows", str(TEST_ROWS),
                  "--set", "featurize.bits=18", "--workdir", str(work), "--fault",
                  "--set", "train.inject.pass_delay_s=0.25", "--set", "train.checkpoint_interval_s=0")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-5000:]
    left = sorted(p.name for p in work.iterdir())
    kept = _bench(results, "--rows", "3000", "--rows-per-file", "1000", "--keep", "--stop-after", "generate",
                  "--workdir", str(work))
    assert kept.returncode == 0, kept.stderr[-5000:]
    return results, json.loads((results / "scale.json").read_text()), left


@pytest.mark.spark
@pytest.mark.slow
def test_every_stage_is_measured_and_rows_are_conserved(scale_run):
    _, res, _ = scale_run
    run = res["runs"][str(ROWS)]
    st = run["stages"]
    assert "failed" not in run and set(st) == {"generate", "generate_test", *SPARK_STAGES, "train_fault", "score_first", "score"}
    assert st["generate"]["files"] == ROWS // PER_FILE and st["generate"]["processes"] == min(2, os.cpu_count())
    f = st["featurize"]
    assert f["lines"] == ROWS and f["rows"] + f["quarantined"] + f["dropped"] == f["lines"] and f["conserved"]
    assert f["input_files"] == ROWS // PER_FILE
    assert st["featurize_test"]["rows"] == TEST_ROWS == st["predict"]["rows_written"]
    assert st["score"]["scores_written"] == TEST_ROWS == run["score_lines"]
    assert st["score_first"]["rows"] == 1000  # the cold run before it
    for name, s in st.items():
        assert s["returncode"] == 0 and s["rows"] > 0 and s["rows_per_s"] > 0 and s["cpu_s"] > 0, name
        assert s["unreaped"] == [], name
        assert s["io"]["rchar"] > 0 and s["io"]["wchar"] > 0, name
        assert 0 < s["min_free_disk_bytes"] <= s["free_disk_before_bytes"] + (1 << 30), name
    for name in SPARK_STAGES:  # the driver, the JVM, the daemon and its workers, each with a peak
        peaks = st[name]["rss_peak_bytes"]
        assert {"python_driver", "jvm", "python_daemon", "python_worker"} <= set(peaks), (name, peaks)
        assert peaks["jvm"]["max"] > 100 * MiB and peaks["python_worker"]["max"] > 50 * MiB, (name, peaks)
    assert st["score"]["rss_peak_bytes"]["python_driver"]["max"] > 50 * MiB
    # featurize read its gzip'd input and wrote its Parquet: the tree's I/O holds both
    assert f["io"]["rchar"] >= st["generate"]["gzip_bytes"] and f["io"]["wchar"] >= f["parquet_bytes"]


@pytest.mark.spark
@pytest.mark.slow
def test_train_figures_agree_with_the_ranks_own_measures(scale_run):
    _, res, _ = scale_run
    t = res["runs"][str(ROWS)]["stages"]["train"]
    assert t["passes"] >= 1 and t["seconds_per_row_pass"] > 0 and t["train_rows"] + t["holdout_rows"] == ROWS
    workers = t["rss_peak_bytes"]["python_worker"]
    # the watcher's peak of each worker process is at least what each rank measured of itself
    assert workers["processes"] >= 2
    for own in t["rank_peak_rss_bytes"]:
        assert workers["max"] >= 0.95 * own
    assert t["eta"]["actual_s"] == t["train_seconds"] > 0


@pytest.mark.spark
@pytest.mark.slow
def test_quality_is_against_the_bayes_loss_of_the_same_rows(scale_run):
    _, res, _ = scale_run
    q = res["runs"][str(ROWS)]["quality"]
    assert q["rows"] == TEST_ROWS and math.isfinite(q["logloss"]) and 0.5 < q["auroc"] < 1
    assert 0.3 < q["bayes_logloss"] < 0.6 and q["logloss"] > q["bayes_logloss"] - 0.02
    assert q["excess_logloss"] == pytest.approx(q["logloss"] - q["bayes_logloss"])


@pytest.mark.spark
@pytest.mark.slow
def test_data_is_removed_unless_kept_and_runs_of_each_size_accumulate(scale_run):
    results, res, left = scale_run
    assert list(res["runs"]) == ["3000:generate", str(ROWS)]  # merged, ordered by N
    assert res["runs"][str(ROWS)]["removed"] == ["raw", "data", "pred", "score-input.tsv", "scores.txt"]
    assert left == ["_scale_bench.json", "logs", "metrics.json", "model", "model-fault"]
    d = res["runs"][str(ROWS)]["disk"]
    assert d["raw_gzip_bytes"] > 0 and d["featurized_bytes"] > 0 and d["estimate_bytes"] > d["raw_gzip_bytes"]
    kept = res["runs"]["3000:generate"]
    assert kept["removed"] == [] and set(kept["stages"]) == {"generate", "generate_test"}
    work = results / "work"
    assert sorted(p.name for p in work.iterdir()) == ["_scale_bench.json", "logs", "raw"]
    assert sorted(p.name for p in (work / "raw" / "train").glob("*.tsv.gz")) == [f"part-0000{i}.tsv.gz" for i in range(3)]
    assert (work / "raw" / "test" / "_truth.json").exists()


@pytest.mark.spark
@pytest.mark.slow
def test_the_curve_draws_the_complete_runs_only(scale_run, tmp_path):
    from tests.benchmarks import scale_plot

    _, res, _ = scale_run
    runs = scale_plot.complete_runs(res)
    assert [r["rows"] for r in runs] == [ROWS]  # the generate-only run at 3,000 rows is left out
    out = scale_plot.plot(runs, tmp_path / "scale.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = scale_plot.table(runs).splitlines()
    assert len(lines) == 3 and lines[2].startswith(f"| {ROWS:,} |")
    st = runs[0]["stages"]
    assert scale_plot.seconds_per_million(runs[0], "train") == pytest.approx(st["train"]["wall_s"] / st["train"]["rows"] * 1e6)
    assert scale_plot.peak_rss(runs[0], "jvm") == max(s["rss_peak_bytes"].get("jvm", {}).get("max", 0) for s in st.values())


@pytest.mark.spark
@pytest.mark.slow
def test_a_rank_killed_in_a_late_pass_resumes_to_the_same_bits(scale_run):
    _, res, _ = scale_run
    run = res["runs"][str(ROWS)]
    f = run["fault"]
    passes = run["stages"]["train"]["passes"]
    assert f["killed"] and f["at_pass"] == -(-2 * passes // 3) and f["at_pass"] <= f["pass_done"] < passes, f
    assert f["rss_bytes"] > 50 * MiB  # a rank (its shard and model), not an idle worker
    assert f["attempts"] == 2 and f["same_bits"] and f["same_history_length"], f
    assert f["objective"][0] == f["objective"][1]
    assert f["median_pass_s"] > 0.1 and f["time_lost_passes"] == pytest.approx(f["time_lost_s"] / f["median_pass_s"])
