"""Secrets stay secret (GUIDE invariant 8): a whole pipeline run with credentials in its
configuration writes and logs none of them (tests/secrets_app.py drives it)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# distinctive values, one per carrier; none may appear anywhere
MARKERS = {
    "spark.hadoop.fs.s3a.access.key": "AKIAMARKERQ7ACCESS",
    "spark.hadoop.fs.s3a.secret.key": "mArKeR/s3cr3t+Key7",
    "spark.hadoop.fs.s3a.session.token": "MARKERsessionTOKEN99",
    "spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net": "MARKERazureACCOUNTkey==",
    "spark.hadoop.fs.gs.auth.service.account.private.key": "MARKERgcsPRIVATEkey",
    "spark.executorEnv.AWS_SECRET_ACCESS_KEY": "MARKERenvSECRET",
    "spark.terascale.test.endpoint": "https://probe:MARKERuriPASS@127.0.0.1:9/x",  # a URI with user-info
}
# the same keys set again through --set spark.conf=... for train and config, other values
SET_MARKERS = {k: v.replace("MARKER", "SETMARK").replace("mArKeR", "sEtMaRk") for k, v in MARKERS.items()}
NEEDLES = [v.split("probe:")[-1].split("@")[0] for v in (*MARKERS.values(), *SET_MARKERS.values())]


def _yaml_map(d: dict) -> str:
    return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in d.items()) + "}"


@pytest.mark.spark
@pytest.mark.slow
def test_no_secret_reaches_a_log_or_a_file(tmp_path):
    run, logs = tmp_path / "run", tmp_path / "logs"
    run.mkdir()
    logs.mkdir()
    events = run / "eventlog"
    events.mkdir()
    plain = {
        "spark.sql.shuffle.partitions": "3",  # innocuous: shown as it is
        "spark.eventLog.enabled": "true", "spark.eventLog.dir": events.as_uri(),  # Spark's own record,
        "spark.eventLog.compress": "false",  # in plain text, for the scan
        "spark.logConf": "true",  # Spark logs its configuration at INFO
        "spark.local.dir": str(run / "spark-local"),
    }
    conf = run / "job.yaml"
    conf.write_text(
        "spark:\n  master: 'local[2]'\n  log_level: INFO\n"
        f"  conf: {_yaml_map({**plain, **MARKERS})}\n"
        "featurize: {bits: 14, partitions: 2}\n"
        "train: {passes: 3, solver: hybrid, l2: 1.0e-6, checkpoint_interval_s: 0, holdout_period: 0, progress: log}\n"
    )
    keys_file = logs / "attempt_keys.txt"
    # Spark's log4j output at INFO into logs/spark.log: a pyspark JVM filters its console down to
    # WARN (the shell's filter), a file appender is left alone
    (logs / "log4j2.properties").write_text(
        "rootLogger.level = info\nrootLogger.appenderRef.file.ref = file\nappender.file.type = File\n"
        f"appender.file.name = file\nappender.file.fileName = {logs / 'spark.log'}\n"
        "appender.file.layout.type = PatternLayout\nappender.file.layout.pattern = %p %c{1}: %m%n%ex\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_CONF_DIR=str(logs))
    r = subprocess.run(
        [sys.executable, "-m", "tests.secrets_app", str(run), str(conf), _yaml_map({**plain, **SET_MARKERS}),
         str(keys_file)],
        capture_output=True, timeout=600, env=env, cwd=run,  # Spark's cwd files (derby.log, ...) land in run/
    )
    out, err = r.stdout, r.stderr
    assert r.returncode == 0, err.decode(errors="replace")[-4000:]
    text = err.decode(errors="replace")

    # the capture holds what it should: terascale's log, Spark's INFO log, the executors' stderr
    assert "resolved configuration" in text and "terascale-executor-probe" in text
    spark_log = (logs / "spark.log").read_text()
    assert "INFO SparkContext: Spark configuration:" in spark_log  # spark.logConf
    assert "spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net=*********(redacted)" in spark_log
    jvm_cmdline = (logs / "jvm_cmdline").read_bytes()
    assert b"spark.sql.shuffle.partitions=3" in jvm_cmdline and b"secret.key" not in jvm_cmdline
    # the retried attempt resumed from a checkpoint the watcher saw (and scanned below)
    seen = sorted(p.name for p in (run / "_seen").iterdir())
    assert any(n.endswith(".npz") for n in seen) and any(n.endswith("_progress.json") for n in seen)
    meta = json.loads((run / "model" / "metadata.json").read_text())
    assert [a["outcome"] for a in meta["attempts"]] == ["failed", "succeeded"]

    # where a key is shown, its value is ***
    for k in MARKERS:
        if k != "spark.terascale.test.endpoint":
            assert f"{k}: '***'" in text, k
    assert "spark.terascale.test.endpoint: 'https://***@127.0.0.1:9/x'" in text
    assert meta["config"]["spark"]["conf"] == {**plain, **dict.fromkeys(SET_MARKERS, "***")} | {
        "spark.terascale.test.endpoint": "https://***@127.0.0.1:9/x"}
    assert "spark.hadoop.fs.s3a.secret.key: '***'" in out.decode()  # terascale config
    # Spark's event log: terascale's regex covers what Spark's default misses (an account key)
    spark_env = next(json.loads(line) for p in events.rglob("*") if p.is_file() for line in p.read_text().splitlines()
                     if '"SparkListenerEnvironmentUpdate"' in line)
    props = dict(spark_env["Spark Properties"])
    for k in MARKERS:
        assert props[k] == "*********(redacted)", k
    assert props["spark.sql.shuffle.partitions"] == "3"

    # and no value anywhere: every file the run wrote, every byte logged, the attempt keys
    keys = [bytes.fromhex(h) for h in keys_file.read_text().split()]
    assert len(keys) == 2  # one per attempt
    needles = [n.encode() for n in NEEDLES]
    needles += [x for k in keys for x in (k, k.hex().encode(), base64.b64encode(k), base64.b64encode(k).rstrip(b"="))]
    blobs = {"stdout": out, "stderr": err, "spark.log": spark_log.encode(), "jvm_cmdline": jvm_cmdline}
    files = [p for p in run.rglob("*") if p.is_file()]
    assert len(files) > 20
    blobs.update({str(p.relative_to(run)): p.read_bytes() for p in files if p != conf})
    leaks = [(name, n) for name, blob in blobs.items() for n in needles if n in blob]
    assert leaks == []
