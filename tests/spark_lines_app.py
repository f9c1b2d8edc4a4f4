"""One pass of the user's pipeline through the CLI, in one process, on whatever pyspark this
interpreter imports; prints a JSON summary of everything it produced, as decoded values and
hashes of bytes, for tests/test_spark_lines.py to compare between Spark lines:

    python -m tests.spark_lines_app WORKDIR SUMMARY_JSON [SPARK_CONNECT_URL]

With a Spark Connect URL every Spark job runs on that server (its master has 3 task slots, as
``local[3]``) instead of a local session (tests/test_spark_connect.py): the Criteo-style jobs
with only ``SPARK_REMOTE`` set, the ad-log table's with ``--remote``.

Criteo TSV: featurize -> train (hybrid, 2 workers + 1 spare, shard 1 failing in pass 2 of the
first attempt: the retry resumes from the checkpoint) -> evaluate -> predict -> score (stdin).
The ad-log table (issue 42, through Spark: a --where filter): featurize -> train -> evaluate.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REMOTE = sys.argv[3] if __name__ == "__main__" and len(sys.argv) > 3 else ""
LOCAL = [] if REMOTE else ["--set", "spark.master=local[3]", "--set", "spark.log_level=ERROR"]  # REMOTE: SPARK_REMOTE
TRAIN = ["--set", "train.workers=2", "--set", "train.passes=8", "--set", "train.l2=1e-5",
         "--set", "train.checkpoint_interval_s=0"]


def _cli(*args: str) -> None:
    from terascale.jobs.cli import main

    rc = main(list(args))
    if rc != 0:
        raise SystemExit(f"terascale {' '.join(args[:1])} exited {rc}")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dataset(d: Path) -> dict:
    """The dataset's rows (decoded, in file and row order) and manifest counts: the same values
    whatever the Parquet encoding (it differs between lines: featurize.parquet_encoding auto)."""
    m = json.loads((d / "_manifest.json").read_text())
    rows = pa.concat_tables([pq.read_table(d / f["path"]) for f in m["files"]])
    cols = {c: _digest(json.dumps(rows.column(c).to_pylist()).encode()) for c in rows.column_names}
    return {"rows": m["rows"], "nnz": m["nnz"], "quarantined": m["quarantine"]["rows"], "columns": cols,
            "spec": m["spec"], "encoding": m["options"].get("parquet_encoding")}


def _model(d: Path) -> dict:
    meta = json.loads((d / "metadata.json").read_text())
    w = np.load(d / "weights.npy") if (d / "weights.npy").exists() else None
    files = {p.name: _digest(p.read_bytes()) for p in sorted(d.glob("weights*"))}
    return {"weights": files, "nonzero": int(np.count_nonzero(w)) if w is not None else None,
            "intercept": meta["intercept"], "objective": meta["objective"],
            "history": [h.get("objective") for h in meta["history"]],
            "attempts": [a["outcome"] for a in meta["attempts"]]}


def _metrics(path: Path) -> dict:
    """The metrics less what names the run (its time, its paths)."""
    m = json.loads(path.read_text())
    return {k: v for k, v in m.items() if k not in ("seconds", "dataset", "model")}


def _predictions(d: Path) -> str:
    t = pa.concat_tables([pq.read_table(p) for p in sorted(d.glob("part-*.parquet"))])
    return _digest(json.dumps({c: t.column(c).to_pylist() for c in sorted(t.column_names)}).encode())


def main(work: Path) -> dict:
    from terascale.pipeline.gen_adlog import ADLOG_SPEC_YAML

    out: dict = {}
    _cli("generate", "--rows", "30000", "--out", str(work / "raw"), "--files", "2", "--seed", "3",
         "--malformed-rate", "0.01")
    _cli("generate", "--rows", "6000", "--out", str(work / "raw-test"), "--seed", "4")
    for name, raw in (("train", "raw"), ("test", "raw-test")):
        _cli("featurize", "--input", str(work / raw), "--output", str(work / name), "--set", "featurize.bits=18",
             "--set", "featurize.partitions=3", *LOCAL)
        out[f"criteo {name} dataset"] = _dataset(work / name)
    _cli("train", "--input", str(work / "train"), "--model", str(work / "model"), *TRAIN, *LOCAL,
         "--set", "train.spares=1", "--set", "train.inject.fail_shard=1", "--set", "train.inject.fail_pass=2")
    out["criteo model"] = _model(work / "model")
    _cli("evaluate", "--input", str(work / "test"), "--model", str(work / "model"),
         "--out", str(work / "metrics.json"), *LOCAL)
    out["criteo metrics"] = _metrics(work / "metrics.json")
    _cli("predict", "--input", str(work / "test"), "--model", str(work / "model"), "--output",
         str(work / "predictions"), *LOCAL)
    out["criteo predictions"] = _predictions(work / "predictions")
    lines = b"".join(sorted((work / "raw-test").glob("part-*.tsv"))[0].read_bytes().splitlines(True)[:500])
    scored = subprocess.run([sys.executable, "-m", "terascale.jobs.cli", "score", "--model", str(work / "model")],
                            input=lines, capture_output=True, check=True, timeout=300)
    out["criteo score"] = _digest(scored.stdout)

    if REMOTE:  # the ad-log table's jobs name the server on their command line instead
        del os.environ["SPARK_REMOTE"]
        LOCAL[:] = ["--remote", REMOTE]
    _cli("generate", "--kind", "adlog", "--rows", "20000", "--out", str(work / "adlog"), "--seed", "5")
    conf = work / "adlog.yaml"
    conf.write_text(ADLOG_SPEC_YAML.replace("bits: 20", "bits: 16"), encoding="utf-8")
    _cli("featurize", "--input", str(work / "adlog" / "parquet"), "--output", str(work / "adlog-data"),
         "--conf", str(conf), "--where", "weight > 0", "--set", "featurize.partitions=2", *LOCAL)
    out["adlog dataset"] = _dataset(work / "adlog-data")
    _cli("train", "--input", str(work / "adlog-data"), "--model", str(work / "adlog-model"), *TRAIN, *LOCAL)
    out["adlog model"] = _model(work / "adlog-model")
    _cli("evaluate", "--input", str(work / "adlog-data"), "--model", str(work / "adlog-model"),
         "--out", str(work / "adlog-metrics.json"), *LOCAL)
    out["adlog metrics"] = _metrics(work / "adlog-metrics.json")
    return out


if __name__ == "__main__":
    import pyspark

    if REMOTE:
        os.environ["SPARK_REMOTE"] = REMOTE
    summary = main(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps({"pyspark": pyspark.__version__, "summary": summary}, indent=1))
