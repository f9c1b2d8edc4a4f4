"""MLflow tracking (jobs/tracking.py) and the pyfunc model (jobs/mlflow_model.py), for real.

A real tracking store (SQLite in a temporary directory, artifacts beside it) and model registry;
``terascale train`` / ``evaluate`` run in this process on the session's Spark; what they logged is
read back through MLflow's client and compared with the model's metadata and the metrics file.
The registered pyfunc model scores raw lines and DataFrames of fields to the bits of
``terascale score``, loaded with ``mlflow.pyfunc.load_model`` and served by
``mlflow models serve --env-manager local`` on 127.0.0.1. A tracking server that cannot be
reached, and mlflow missing, are warnings; the model is written all the same.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'terascale[mlflow]')")

from terascale.jobs.cli import main  # noqa: E402
from terascale.jobs.config import CRITEO_FIELDS, load_config  # noqa: E402
from terascale.pipeline.generate import generate_clicklogs  # noqa: E402
from terascale.pipeline.modeldir import load_metadata  # noqa: E402

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]
SECRET = "SEKRET-4e1f-in-the-config"
REGISTERED = "ctr-test"
BIN = Path(sys.executable).parent  # terascale, mlflow and uvicorn of this venv


class Collect(logging.Handler):
    """The records of one logger (terascale's loggers do not propagate to pytest's caplog)."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger(name)

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


def flat(d: dict, prefix: str = "") -> dict[str, str]:
    """The test's own flattening of a nested configuration into MLflow's string params."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list | dict | bool) else str(v)
    return out


def score_bits(model: str, lines: list[str], *flags: str) -> list[str]:
    """``terascale score``'s answers for the lines, as the hex of their float64 bits."""
    r = subprocess.run([str(BIN / "terascale"), "score", "--model", model, *flags], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [float(x).hex() for x in r.stdout.split()]


def hexes(a) -> list[str]:
    return [float(x).hex() for x in np.asarray(a, dtype=np.float64)]


def fields_frame(lines: list[str], label: bool = True):
    """The Criteo fields of the lines as a DataFrame: integers with gaps (floats with NaN in pandas),
    None for a missing categorical value."""
    import pandas as pd

    rows = [ln.split("\t") for ln in lines]
    cols = {}
    if label:
        cols["label"] = [int(r[0]) for r in rows]
    for j, name in enumerate(CRITEO_FIELDS, 1):
        if name.startswith("I"):
            cols[name] = [float(r[j]) if r[j] else np.nan for r in rows]
        else:
            cols[name] = [r[j] or None for r in rows]
    return pd.DataFrame(cols)


@pytest.fixture(scope="module")
def tracked(spark, tmp_path_factory):
    """A tracked train and evaluate: generated logs, featurized, trained with train.l2 = auto and a
    secret in the configuration, evaluated; the store is SQLite, the artifacts beside it."""
    d = tmp_path_factory.mktemp("mlflow")
    generate_clicklogs(d / "raw", 12000, files=2, seed=11, processes=1)
    generate_clicklogs(d / "rawt", 3000, files=1, seed=12, processes=1)
    uri = f"sqlite:///{d}/mlflow.db"
    common = ["--set", "featurize.bits=16", "--set", "featurize.partitions=2"]
    cwd = os.getcwd()
    os.chdir(d)  # the SQLite store keeps artifacts in ./mlruns
    try:
        assert main(["featurize", "--input", str(d / "raw"), "--output", str(d / "tr"), *common]) == 0
        assert main(["featurize", "--input", str(d / "rawt"), "--output", str(d / "te"), *common]) == 0
        track = ["--set", f"tracking.mlflow_uri={uri}", "--set", "tracking.experiment=ctr-daily"]
        with Collect("terascale") as logs:
            assert main(["train", "--input", str(d / "tr"), "--model", str(d / "model"), *track,
                         "--set", f"tracking.registered_model={REGISTERED}", "--set", "train.passes=8",
                         "--set", f"spark.conf={{spark.hadoop.fs.s3a.secret.key: {SECRET}}}"]) == 0
            assert main(["evaluate", "--input", str(d / "te"), "--model", str(d / "model"), "--out",
                         str(d / "metrics.json"), *track]) == 0
    finally:
        os.chdir(cwd)
    assert logs.warnings() == []
    lines = (d / "rawt" / "part-00000.tsv").read_text().splitlines()[:300]
    return {"dir": d, "uri": uri, "model": str(d / "model"), "meta": load_metadata(str(d / "model")),
            "metrics": json.loads((d / "metrics.json").read_text()), "lines": lines,
            "scores": score_bits(str(d / "model"), lines)}  # terascale score's answers


@pytest.fixture(scope="module")
def client(tracked):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracked["uri"])


def test_the_model_records_its_run(tracked, client):
    m = tracked["meta"]["tracking"]["mlflow"]
    run = client.get_run(m["run_id"])
    assert m["tracking_uri"] == tracked["uri"]
    assert run.info.status == "FINISHED" and run.info.run_name == "model"
    assert client.get_experiment(m["experiment_id"]).name == "ctr-daily" == client.get_experiment(run.info.experiment_id).name
    assert run.data.tags["terascale/model_dir"] == tracked["model"]
    assert run.data.tags["terascale/stop_reason"] == tracked["meta"]["stop_reason"]


def test_params_are_the_redacted_configuration(tracked, client):
    meta = tracked["meta"]
    params = client.get_run(meta["tracking"]["mlflow"]["run_id"]).data.params
    # and the logged pyfunc model's own configuration (MLflow logs a model's model_config as params)
    assert params == {**flat(meta["config"]), **flat({"spec": meta["spec"]}), "calibration": "population",
                      "labeled": "True", "skip_bad": "False"}
    assert params["train.l2"] == "auto" and params["train.passes"] == "8" and params["spec.bits"] == "16"
    assert params["spark.conf.spark.hadoop.fs.s3a.secret.key"] == "***"
    assert params["tracking.mlflow_uri"] == tracked["uri"]


def test_metrics_are_the_history_the_lambda_and_the_ranks(tracked, client):
    meta = tracked["meta"]
    run_id = meta["tracking"]["mlflow"]["run_id"]
    h = meta["history"]

    def history(name):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]

    assert len(h) > 8  # a path of several steps, 8 passes at most each
    assert history("objective") == [(x["pass"], x["objective"]) for x in h if x["objective"] is not None]
    assert h[0]["objective"] is None and h[0]["phase"] == "online"  # an online pass has none: not logged
    assert history("holdout_loss") == [(x["pass"], x["holdout_loss"]) for x in h]
    assert history("l2") == [(x["pass"], x["l2"]) for x in h]  # the path's λ at each pass
    for rank in (0, 1):
        for k in ("compute_s", "stall_s", "transfer_s"):
            assert history(f"rank{rank}/{k}") == [(x["pass"], x[k][rank]) for x in h]
    got = client.get_run(run_id).data.metrics
    reg = meta["regularization"]
    assert got["chosen_l2"] == reg["value"] == reg["steps"][reg["chosen_step"]]["l2"]
    assert got["chosen_l1"] == 0.0
    assert got["passes"] == len(h) and got["returned_objective"] == meta["objective"]
    assert got["train_rows"] == meta["data"]["train_rows"] and got["holdout_rows"] == meta["data"]["holdout_rows"]
    assert got["nonzeros"] == meta["weights"]["nonzeros"]
    for r in meta["per_rank"]:
        assert got[f"rank{r['rank']}/seconds"] == r["seconds"] and got[f"rank{r['rank']}/rows"] == r["rows"]
        assert got[f"rank{r['rank']}/peak_rss_mb"] == r["peak_rss_bytes"] / 2**20
    assert got["memory/estimate_mb"] == meta["memory_estimate"]["needed_bytes"] / 2**20


def test_evaluate_logs_its_metrics_to_the_same_run(tracked, client):
    run_id = tracked["meta"]["tracking"]["mlflow"]["run_id"]
    got = client.get_run(run_id).data.metrics
    m = tracked["metrics"]
    for k in ("logloss", "auroc", "auprc", "normalized_entropy", "calibration", "rows", "objective"):
        assert got[f"eval/{k}"] == m[k]
    assert 0.3 < got["eval/logloss"] < 0.7 and got["eval/rows"] == 3000
    logged = json.loads(Path(client.download_artifacts(run_id, "evaluation/metrics.json", str(tracked["dir"] / "dl-eval")))
                        .read_text())
    assert logged["logloss"] == m["logloss"] and logged["model"] == tracked["model"]


def test_artifacts_are_the_model_directory_and_the_report(tracked, client):
    run_id = tracked["meta"]["tracking"]["mlflow"]["run_id"]
    model = Path(tracked["model"])
    assert sorted(Path(a.path).name for a in client.list_artifacts(run_id, "model_dir")) == sorted(os.listdir(model))
    got = Path(client.download_artifacts(run_id, "model_dir", str(tracked["dir"] / "dl")))
    for f in os.listdir(model):
        assert (got / f).read_bytes() == (model / f).read_bytes(), f
    report = {Path(a.path).name for a in client.list_artifacts(run_id, "report")}
    # evaluate rebuilt it with the evaluation's curves
    assert {"report.html", "objective_by_pass.png", "rank_timings.png", "roc.png", "calibration.png"} <= report


def test_no_secret_reaches_the_tracking_store(tracked):
    files = [p for p in tracked["dir"].rglob("*") if p.is_file() and (p.name == "mlflow.db" or "mlruns" in p.parts)]
    assert any(p.name == "mlflow.db" for p in files) and len(files) > 10
    assert [str(p) for p in files if SECRET.encode() in p.read_bytes()] == []


def test_the_registered_pyfunc_scores_as_terascale_score(tracked):
    import mlflow.pyfunc

    lines, expected = tracked["lines"], tracked["scores"]
    uri = f"models:/{REGISTERED}/1"
    mlflow.set_tracking_uri(tracked["uri"])
    try:
        model = mlflow.pyfunc.load_model(uri)
        assert hexes(model.predict(lines)) == expected
        assert hexes(model.predict(fields_frame(lines))) == expected
        assert hexes(model.predict(fields_frame(lines, label=False))) == expected  # the label does not score
        import pandas as pd

        assert hexes(model.predict(pd.DataFrame({"line": lines}))) == expected
        unlabeled = [ln.split("\t", 1)[1] for ln in lines]
        assert hexes(mlflow.pyfunc.load_model(uri, model_config={"labeled": False}).predict(unlabeled)) == \
            score_bits(tracked["model"], unlabeled, "--no-label") == expected
        raw = mlflow.pyfunc.load_model(uri, model_config={"calibration": "raw"}).predict(lines[:20])
        assert hexes(raw) == score_bits(tracked["model"], lines[:20], "--set", "predict.calibration=raw")
        from terascale.pipeline.scorer import MalformedLine

        with pytest.raises(MalformedLine, match="line 2: malformed"):
            model.predict([lines[0], "not a criteo line"])
        skip = mlflow.pyfunc.load_model(uri, model_config={"skip_bad": True}).predict([lines[0], "x"])
        assert hexes(skip[:1]) == expected[:1] and np.isnan(skip[1])
    finally:
        mlflow.set_tracking_uri(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_mlflow_models_serve_answers_as_terascale_score(tracked):
    lines, expected = tracked["lines"][:50], tracked["scores"][:50]
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracked["uri"], "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    log = open(tracked["dir"] / "serve.log", "wb")  # noqa: SIM115 - closed below
    p = subprocess.Popen([str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{REGISTERED}/1", "--env-manager",
                          "local", "-h", "127.0.0.1", "-p", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert p.poll() is None, (tracked["dir"] / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "the server did not answer /ping in 180 s"
            time.sleep(0.5)
        assert hexes(_post(port, {"inputs": lines})["predictions"]) == expected
        frame = fields_frame(lines)
        split = {"columns": list(frame.columns),
                 "data": [[None if isinstance(v, float) and np.isnan(v) else v for v in row]
                          for row in frame.astype(object).values.tolist()]}
        assert hexes(_post(port, {"dataframe_split": split})["predictions"]) == expected
        assert hexes(_post(port, {"dataframe_split": {"columns": ["line"], "data": [[x] for x in lines]}})
                     ["predictions"]) == expected
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()


def test_an_unreachable_tracking_server_is_a_warning_and_the_model_is_good(tracked, tmp_path):
    port = _free_port()  # nothing listens there
    uri = f"http://user:pw-{SECRET}@127.0.0.1:{port}"
    data = str(tracked["dir"] / "tr")
    with Collect("terascale") as logs:
        assert main(["train", "--input", data, "--model", str(tmp_path / "m"), "--set", "train.l2=1e-4",
                     "--set", f"tracking.mlflow_uri={uri}", "--set", "tracking.timeout_s=5"]) == 0
        assert main(["evaluate", "--input", str(tracked["dir"] / "te"), "--model", str(tmp_path / "m"),
                     "--set", f"tracking.mlflow_uri={uri}"]) == 0
    meta = load_metadata(str(tmp_path / "m"))
    assert "tracking" not in meta and meta["history"]
    assert len(score_bits(str(tmp_path / "m"), tracked["lines"][:5])) == 5  # a complete model that scores
    warned = logs.warnings()
    assert any(f"MLflow tracking at http://***@127.0.0.1:{port}: cannot create a run" in w for w in warned), warned
    assert any("records no MLflow run" in w for w in warned), warned
    assert not any(SECRET in w or "pw-" in w for w in warned)


def test_without_mlflow_tracking_is_a_warning(monkeypatch):
    from terascale.jobs import tracking

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if the extra were not installed
    with Collect("terascale.tracking") as logs:
        assert tracking.start_train(load_config([], ["tracking.mlflow_uri=sqlite:///x.db"]), "data", "model") is None
    assert any("mlflow is not installed (pip install 'terascale[mlflow]')" in w for w in logs.warnings())


def test_the_tracking_uri_comes_from_the_config_or_the_environment(monkeypatch):
    from terascale.jobs.tracking import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(load_config().tracking) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri(load_config().tracking) == "http://127.0.0.1:5000"
    assert tracking_uri(load_config([], ["tracking.mlflow_uri=sqlite:///a.db"]).tracking) == "sqlite:///a.db"
    assert tracking_uri(load_config([], ["tracking.mlflow_uri=off"]).tracking) is None
