"""Featurize under Spark's speculation: a straggling task gets a speculative copy; the dataset
has every row exactly once.

Spark launches no speculative copy in local mode (the speculation checks do not run there)
nor on a host that already runs an attempt of the task, so this starts a small standalone
cluster whose two workers bind two loopback addresses (127.0.0.1 and 127.0.0.2) and runs the
job in its own application (tests/speculation_app.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from terascale.pipeline.generate import generate_clicklogs
from tests.cluster.standalone import StandaloneCluster

pytestmark = [pytest.mark.spark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def _rows(out: Path, manifest: dict) -> Counter:
    got = Counter()
    for f in manifest["files"]:
        t = pq.read_table(out / f["path"])
        assert t.num_rows == f["rows"]  # the manifest's count is the file's
        assert sum(len(x) for x in t["indices"].to_pylist()) == f["nnz"]
        for row in zip(t["label"].to_pylist(), t["indices"].to_pylist(), t["values"].to_pylist(), strict=True):
            got[(row[0], tuple(row[1]), None if row[2] is None else tuple(row[2]))] += 1
    return got


def _attempts(events_dir: Path, output: str) -> list[dict]:
    """Task attempts (index, attempt, speculative, host, end reason, end time in epoch seconds)
    of the job writing ``output``."""
    (log,) = list(events_dir.iterdir())
    jobs, starts, ends, finished = {}, [], {}, {}
    for line in log.read_text().splitlines():
        e = json.loads(line)
        if e["Event"] == "SparkListenerJobStart":
            jobs[e["Job ID"]] = (e.get("Properties", {}).get("spark.job.description", ""), e["Stage IDs"])
        elif e["Event"] == "SparkListenerTaskStart":
            starts.append((e["Stage ID"], e["Task Info"]))
        elif e["Event"] == "SparkListenerTaskEnd":
            ends[e["Task Info"]["Task ID"]] = e["Task End Reason"]["Reason"]
            finished[e["Task Info"]["Task ID"]] = e["Task Info"]["Finish Time"] / 1000.0
    stages = {s for desc, ids in jobs.values() if desc.endswith(f"-> {output}") for s in ids}
    return [{"index": t["Index"], "attempt": t["Attempt"], "speculative": t["Speculative"], "host": t["Host"],
             "end": ends.get(t["Task ID"]), "finished": finished.get(t["Task ID"])} for s, t in starts if s in stages]


def test_a_speculative_copy_neither_duplicates_nor_loses_rows(spark, tmp_path):
    from terascale.jobs.config import load_config
    from terascale.pipeline.spark_featurize import run_featurize
    from tests.speculation_app import SPEC

    raw = tmp_path / "raw"
    generate_clicklogs(raw, 8000, files=2, seed=7, malformed_rate=0.02, processes=1)
    work = tmp_path / "work"
    work.mkdir()
    # the undisturbed reference: the same job in the tests' own local session
    ref = run_featurize(spark, [str(raw)], str(work / "ref"), SPEC, load_config([], ["featurize.partitions=4"]).featurize)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONHASHSEED="0", PYSPARK_PYTHON=sys.executable,
               PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    with StandaloneCluster(tmp_path / "cluster", workers=2, cores=1, memory="1G", hosts=("127.0.0.1", "127.0.0.2")) as c:
        r = subprocess.run([sys.executable, "-m", "tests.speculation_app", c.master_url, str(raw), str(work)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    spec = json.loads(r.stdout.strip().splitlines()[-1])

    # Spark did run a speculative copy of task 1, on the other host, and it won
    tasks = _attempts(work / "events", str(work / "spec"))
    copies = [t for t in tasks if t["speculative"]]
    assert [(t["index"], t["attempt"], t["end"]) for t in copies] == [(1, 1, "Success")]
    first = next(t for t in tasks if (t["index"], t["attempt"]) == (1, 0))
    assert first["host"] != copies[0]["host"] and first["end"] != "Success"
    # the job committed only once the beaten attempt had ended (Spark returns the job's result
    # first and kills the loser after): nothing wrote into the staging area after the commit
    assert first["finished"] is not None
    assert first["finished"] <= os.path.getmtime(work / "spec" / "_manifest.json") + 0.001

    # per input file: lines in = rows written + rows quarantined; the same counts as undisturbed
    for m in (ref, spec):
        assert m["lines"] == 8000 and m["rows"] + m["quarantine"]["rows"] == 8000
        for p in m["per_input"]:
            with open(p["path"], "rb") as f:
                assert p["lines"] == f.read().count(b"\n") == p["rows"] + p["quarantined"]
    assert [(p["rows"], p["quarantined"]) for p in spec["per_input"]] == [(p["rows"], p["quarantined"]) for p in ref["per_input"]]
    # the same multiset of rows as the undisturbed run: none twice, none lost
    rows = _rows(work / "spec", spec)
    assert sum(rows.values()) == spec["rows"] == ref["rows"] and rows == _rows(work / "ref", ref)
    assert sorted(os.listdir(work / "spec")) == sorted(os.listdir(work / "ref"))  # no _temporary left
