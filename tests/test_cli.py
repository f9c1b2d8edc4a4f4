"""The terascale command line and the spark-submit entry point, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from terascale.jobs.cli import main

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_config_errors_exit_2_and_name_the_key(capsys):
    assert main(["config", "--set", "featurize.bits=40"]) == 2
    err = capsys.readouterr().err
    assert "terascale config: error: featurize.bits = 40: must be an integer in [1, 30]" in err


def test_config_defaults_prints_the_documented_file(capsys):
    assert main(["config", "--defaults"]) == 0
    assert capsys.readouterr().out == (ROOT / "conf" / "defaults.yaml").read_text()


def test_featurize_validates_before_spark_starts(tmp_path):
    # an unusable master would fail inside Spark; the configuration error must come first
    r = subprocess.run(
        [sys.executable, "-m", "terascale.jobs.cli", "featurize", "--input", str(tmp_path), "--output", str(tmp_path / "o"),
         "--set", "spark.master=bogus://nowhere", "--set", "featurize.bitz=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    assert "unknown configuration key 'featurize.bitz' (did you mean 'featurize.bits'?)" in r.stderr
    assert "SparkContext" not in r.stderr and "Exception" not in r.stderr


def test_generate_rejects_bad_arguments(capsys, tmp_path):
    assert main(["generate", "--rows", "10", "--out", str(tmp_path), "--malformed-rate", "1.5"]) == 2
    assert "--malformed-rate 1.5: must be in [0, 1]" in capsys.readouterr().err


@pytest.mark.spark
@pytest.mark.slow
def test_spark_submit_line_from_the_docstring(tmp_path):
    """generate, then featurize through spark-submit exactly as jobs/submit/featurize.py documents."""
    raw = tmp_path / "raw"
    assert main(["generate", "--rows", "3000", "--out", str(raw), "--files", "2", "--malformed-rate", "0.01"]) == 0
    conf = tmp_path / "f.yaml"
    conf.write_text("featurize:\n  bits: 20\n  conjunctions: [[C6, C9]]\n")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    r = subprocess.run(
        [str(BIN / "spark-submit"), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
         "--conf", "spark.driver.host=127.0.0.1", str(ROOT / "jobs" / "submit" / "featurize.py"),
         "--input", str(raw / "*.tsv"), "--output", str(tmp_path / "ds"), "--conf", str(conf),
         "--set", "featurize.seed=3"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rows quarantined   30 (" in r.stdout
    m = json.loads((tmp_path / "ds" / "_manifest.json").read_text())
    assert (m["rows"], m["spec"]["bits"], m["spec"]["seed"], m["spec"]["conjunctions"]) == (2970, 20, 3, [["C6", "C9"]])
    assert "resolved configuration" in r.stdout + r.stderr  # spark-submit merges the driver's stderr into stdout


def test_featurize_job_failure_exits_1(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "terascale.jobs.cli", "featurize", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o"),
         "--set", "spark.master=local[1]"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 1
    assert f"terascale featurize: input error: input '{tmp_path / 'missing'}': no such file or directory" in r.stderr


def test_sessions_terascale_starts_get_its_executor_environment():
    """jobs.session.local_settings: the config's Spark settings win; terascale adds loopback,
    Arrow and the executor environment (numpy's huge-page advice off) where they are unset."""
    from terascale.jobs.config import load_config
    from terascale.jobs.session import EXECUTOR_ENV, local_settings

    cfg = load_config([], ["spark.master=local[2]"])
    got = local_settings(cfg.spark)
    assert got["spark.executorEnv.NUMPY_MADVISE_HUGEPAGE"] == "0" and EXECUTOR_ENV.items() <= got.items()
    assert got["spark.driver.host"] == "127.0.0.1"
    mine = load_config([], ["spark.master=yarn", 'spark.conf={"spark.executorEnv.NUMPY_MADVISE_HUGEPAGE": "1"}'])
    got = local_settings(mine.spark)
    assert got["spark.executorEnv.NUMPY_MADVISE_HUGEPAGE"] == "1" and "spark.driver.host" not in got
