"""The same pipeline on two Spark lines gives the same bits (issue 43): tests/spark_lines_app.py
(featurize -> train with a spare and a failing shard -> evaluate -> predict -> score, and the
ad-log table through Spark) run by this interpreter and by ``TERASCALE_REFERENCE_PYTHON``, a
Python with another pyspark (``make test-spark35`` runs the suite on pyspark 3.5 with the newest
as the reference). The datasets' decoded rows, the models' weight files, the metrics, the
predictions and the scores are equal; only the Parquet encoding of the indices differs, as
``featurize.parquet_encoding: auto`` picks it for each line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from terascale.pipeline.spark_compat import parquet_encoding

pytestmark = [pytest.mark.spark, pytest.mark.slow]
REFERENCE = os.environ.get("TERASCALE_REFERENCE_PYTHON", "")
ROOT = Path(__file__).resolve().parents[1]


def _run(python: str, work: Path) -> dict:
    out = work / "summary.json"
    env = dict(os.environ, PYSPARK_PYTHON=python, PYSPARK_DRIVER_PYTHON=python, PYTHONHASHSEED="0")
    r = subprocess.run([python, "-m", "tests.spark_lines_app", str(work / "w"), str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{python}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.skipif(not REFERENCE, reason="compares two Spark lines: make test-spark35 sets TERASCALE_REFERENCE_PYTHON")
def test_two_spark_lines_give_the_same_models_metrics_and_predictions(tmp_path):
    mine, ref = _run(sys.executable, tmp_path / "mine"), _run(REFERENCE, tmp_path / "ref")
    assert mine["pyspark"].split(".")[:2] != ref["pyspark"].split(".")[:2], (mine["pyspark"], ref["pyspark"])
    a, b = mine["summary"], ref["summary"]
    assert a.keys() == b.keys()
    for what in a:
        if what.endswith("dataset"):
            assert a[what].pop("encoding") == parquet_encoding("auto", mine["pyspark"])
            assert b[what].pop("encoding") == parquet_encoding("auto", ref["pyspark"])
        assert a[what] == b[what], f"{what}: pyspark {mine['pyspark']} and {ref['pyspark']} differ"
    assert a["criteo model"]["attempts"] == ["failed", "succeeded"]  # the injected fault, resumed
    print(f"pyspark {mine['pyspark']} and {ref['pyspark']}: equal datasets, models, metrics "
          f"(logloss {a['criteo metrics']['logloss']:.6f}, ad-log {a['adlog metrics']['logloss']:.6f}), "
          f"predictions and scores")
