"""predict's output on Spark: only its own files are ever replaced, atomically, crash or not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import feature_spec, load_config
from terascale.jobs.scoring import predict
from terascale.pipeline import artifacts, modeldir
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.manifest import read_manifest
from terascale.pipeline.spark_featurize import run_featurize

pytestmark = pytest.mark.spark
STEPS = ("staged", "aside", "placed", "cleaned")


class Crash(BaseException):
    """A crash at a commit step (no except-Exception clean-up runs after it)."""


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("outputs")
    generate_clicklogs(d / "raw", 600, files=1, seed=5, processes=1)
    cfg = load_config([], ["featurize.partitions=2", "featurize.bits=10"])
    run_featurize(spark, [str(d / "raw")], str(d / "ds"), feature_spec(cfg), cfg.featurize)
    spec = read_manifest(str(d / "ds"))["spec"]
    for name, b in (("m_old", 0.0), ("m_new", 1.0)):
        staging = modeldir.staging_dir(str(d / name))
        modeldir.write_weights(staging, np.zeros(1 << 10, np.float32))
        modeldir.commit(staging, str(d / name), {"spec": spec, "config": {"train": {"loss": "logistic"}}, "intercept": b})
    return d


def _version(out) -> str | None:
    """'old' (intercept 0: every probability 0.5) or 'new' (sigmoid(1)) when whole, else None."""
    try:
        m = json.loads((out / "_manifest.json").read_text())
        p = np.concatenate([pq.read_table(out / f["path"])["probability"].to_numpy() for f in m["files"]])
    except FileNotFoundError:
        return None
    if len(p) != m["rows"] or m["rows"] != 600:
        return None
    for tag, v in (("old", 0.5), ("new", 1 / (1 + np.exp(-1.0)))):
        if np.allclose(p, v):
            return tag
    return None


def test_predict_replaces_its_output_atomically_at_every_step(spark, data, tmp_path, monkeypatch):
    (tmp_path / "sibling.txt").write_text("the user's")
    ds = str(data / "ds")
    for step in STEPS:
        out = tmp_path / f"pred-{step}"
        predict(spark, ds, str(data / "m_old"), str(out), ("label",))
        assert _version(out) == "old"
        assert json.loads((out / artifacts.PREDICTIONS_MARKER).read_text())["kind"] == "predictions"
        with pytest.raises(artifacts.OutputError, match="pass --overwrite"):
            predict(spark, ds, str(data / "m_new"), str(out), ("label",))

        def fault(name, step=step):
            if name == step:
                raise Crash(step)

        monkeypatch.setattr(artifacts, "FAULT", fault)
        with pytest.raises(Crash):
            predict(spark, ds, str(data / "m_new"), str(out), ("label",), overwrite=True)
        monkeypatch.setattr(artifacts, "FAULT", None)
        expect = {"staged": "old", "aside": None, "placed": "new", "cleaned": "new"}[step]
        assert _version(out) == expect, step
        if expect is None:  # between the renames: the old predictions are whole at the aside
            assert [_version(Path(a)) for a in artifacts.asides(str(out))] == ["old"]
        # the next run recovers whatever the crash left and replaces the output
        predict(spark, ds, str(data / "m_new"), str(out), ("label",), overwrite=True)
        assert _version(out) == "new" and artifacts.asides(str(out)) == []
    assert (tmp_path / "sibling.txt").read_text() == "the user's"


def test_predict_never_touches_files_it_did_not_write(spark, data, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "part-00000").write_bytes(b"raw click log\n")
    (logs / "_manifest.json").write_text('{"mine": true}')  # not terascale's: no format, no kind
    before = {p.name: p.read_bytes() for p in logs.iterdir()}
    with pytest.raises(artifacts.OutputError, match=r"holds 2 files that terascale did not write \(_manifest.json, "
                                                    r"part-00000\)"):
        predict(spark, str(data / "ds"), str(data / "m_old"), str(logs), ("label",), overwrite=True)
    with pytest.raises(artifacts.OutputError, match=f"--output {data / 'ds'}: is the input dataset"):
        predict(spark, str(data / "ds"), str(data / "m_old"), str(data / "ds"), ("label",), overwrite=True)
    assert {p.name: p.read_bytes() for p in logs.iterdir()} == before
    assert read_manifest(str(data / "ds"))["rows"] == 600
