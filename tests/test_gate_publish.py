"""terascale gate / publish, the model pointer, and every job entry point's exit code on failure."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from terascale.jobs.cli import _model_path, _warm_start, main
from terascale.jobs.config import load_config
from terascale.pipeline import modeldir
from terascale.pipeline.pointer import POINTER_FORMAT, read_pointer

ROOT = Path(__file__).resolve().parents[1]


def make_model(path: Path, bits: int = 4, fill: float = 0.0) -> str:
    staging = modeldir.staging_dir(str(path))
    modeldir.write_weights(staging, np.full(1 << bits, fill, np.float32), storage="dense")
    modeldir.commit(staging, str(path), {"spec": {"bits": bits}, "intercept": 0.0})
    return str(path)


def write_json(path: Path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def gate(new: str, base: str, *extra: str) -> int:
    return main(["gate", "--metrics", new, "--baseline", base, *extra])


# --------------------------------------------------------------------------------------- gate


@pytest.mark.parametrize("new, extra, rc", [
    (0.4545, [], 0),                                               # 0.45 * 1.01 = 0.4545 allowed
    (0.4546, [], 1),
    (0.40, [], 0),                                                 # an improvement passes
    (0.46, ["--max-regression", "0.05"], 0),
    (0.46, ["--margin", "absolute", "--max-regression", "0.02"], 0),
    (0.4701, ["--margin", "absolute", "--max-regression", "0.02"], 1),
])
def test_gate_margin(tmp_path, capsys, new, extra, rc):
    base = write_json(tmp_path / "base.json", {"logloss": 0.45})
    assert gate(write_json(tmp_path / "new.json", {"logloss": new}), base, *extra) == rc
    out, err = capsys.readouterr()
    if rc == 0:
        assert out.startswith("gate passed: logloss") and "failed" not in err
    else:
        assert f"terascale gate: failed: logloss regressed: {new:.6f} > " in err
        assert "; not publishing" in err


def test_gate_on_normalized_entropy(tmp_path, capsys):
    base = write_json(tmp_path / "base.json", {"logloss": 0.9, "normalized_entropy": 0.80})
    new = write_json(tmp_path / "new.json", {"logloss": 0.1, "normalized_entropy": 0.85})
    assert gate(new, base, "--metric", "normalized_entropy") == 1
    assert "normalized_entropy regressed: 0.850000 > 0.808000 allowed" in capsys.readouterr().err


def test_gate_against_the_published_pointer(tmp_path, capsys):
    ptr = str(tmp_path / "current")
    metrics = write_json(tmp_path / "m1.json", {"logloss": 0.45})
    assert main(["publish", "--model", make_model(tmp_path / "m1"), "--pointer", ptr, "--metrics", metrics]) == 0
    assert gate(write_json(tmp_path / "new.json", {"logloss": 0.44}), ptr) == 0
    assert f"(published model {tmp_path / 'm1'}: 0.450000, margin +1.00% relative)" in capsys.readouterr().out
    assert gate(write_json(tmp_path / "worse.json", {"logloss": 0.50}), ptr) == 1


def test_gate_without_baseline_passes_and_says_so(tmp_path, capsys):
    new = write_json(tmp_path / "new.json", {"logloss": 0.7})
    assert gate(new, str(tmp_path / "current")) == 0
    assert "gate passed: no baseline at" in capsys.readouterr().out


@pytest.mark.parametrize("which, content, message", [
    ("new", "{not json", "metrics {new}: not valid JSON"),
    ("new", None, "metrics {new}: no such file"),
    ("new", "[0.45]", "metrics {new}: want a JSON object, found list"),
    ("new", '{"auroc": 0.7}', "metrics {new}: no finite 'logloss' (found None)"),
    ("new", '{"logloss": NaN}', "metrics {new}: no finite 'logloss' (found nan)"),
    ("new", '{"logloss": "0.4"}', "no finite 'logloss' (found '0.4')"),
    ("base", "", "baseline {base}: not valid JSON"),
    ("base", '{"rows": 5}', "baseline {base}: no finite 'logloss'"),
    ("base", json.dumps({"pointer_format": POINTER_FORMAT, "model": "/m", "metrics": None}),
     "baseline pointer {base}: the published model /m has no recorded metrics"),
])
def test_gate_fails_on_unreadable_metrics(tmp_path, capsys, which, content, message):
    paths = {"new": tmp_path / "new.json", "base": tmp_path / "base.json"}
    paths["new"].write_text('{"logloss": 0.4}')
    paths["base"].write_text('{"logloss": 0.4}')
    if content is None:
        paths[which].unlink()
    else:
        paths[which].write_text(content)
    assert gate(str(paths["new"]), str(paths["base"])) == 1
    err = capsys.readouterr().err
    assert err.startswith("terascale gate: failed: ")
    assert message.format(new=paths["new"], base=paths["base"]) in err


def test_gate_rejects_a_negative_margin(tmp_path, capsys):
    m = write_json(tmp_path / "m.json", {"logloss": 0.4})
    assert gate(m, m, "--max-regression", "-0.1") == 2
    assert "--max-regression -0.1: must be a finite number >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ publish


def test_publish_replaces_the_pointer(tmp_path, capsys):
    ptr = tmp_path / "current"
    m1, m2 = make_model(tmp_path / "m1"), make_model(tmp_path / "m2")
    assert main(["publish", "--model", m1, "--pointer", str(ptr)]) == 0
    metrics = write_json(tmp_path / "m2.json", {"logloss": 0.41, "auroc": 0.75})
    assert main(["publish", "--model", m2, "--pointer", str(ptr), "--metrics", metrics]) == 0
    assert f"published {m2} -> {ptr} (previous: {m1})" in capsys.readouterr().out
    p = read_pointer(str(ptr))
    assert (p["model"], p["previous"], p["metrics"]) == (m2, m1, {"logloss": 0.41, "auroc": 0.75})
    # a re-run publishing the same model keeps the one it replaced as previous
    assert main(["publish", "--model", m2, "--pointer", str(ptr)]) == 0
    assert read_pointer(str(ptr))["previous"] == m1
    assert sorted(x.name for x in tmp_path.iterdir()) == ["current", "m1", "m2", "m2.json"]  # no temp files


def test_publish_follows_a_pointer_given_as_the_model(tmp_path):
    m1 = make_model(tmp_path / "m1")
    assert main(["publish", "--model", m1, "--pointer", str(tmp_path / "staging")]) == 0
    assert main(["publish", "--model", str(tmp_path / "staging"), "--pointer", str(tmp_path / "prod")]) == 0
    assert read_pointer(str(tmp_path / "prod"))["model"] == m1


def _break(kind: str, d: Path) -> None:
    if kind == "missing":
        return
    if kind == "empty":
        d.mkdir()
    elif kind == "staging":  # weights written, metadata (the commit) not yet
        modeldir.write_weights(str(d), np.zeros(16, np.float32))
    else:
        make_model(d)
        if kind == "no_weights":
            (d / "weights.npy").unlink()
        elif kind == "short_weights":
            np.save(d / "weights.npy", np.zeros(8, np.float32))
        elif kind == "bad_metadata":
            (d / "metadata.json").write_text("{")
        elif kind == "truncated_sparse":  # the sparse storage, cut short (a zip without its directory)
            (d / "weights.npy").unlink()
            modeldir.write_weights(str(d), np.zeros(16, np.float32), storage="sparse")
            data = (d / "weights_sparse.npz").read_bytes()
            (d / "weights_sparse.npz").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("kind, message", [
    ("missing", "bad: no such model directory or pointer file"), ("empty", "no metadata.json"),
    ("staging", "no metadata.json"), ("no_weights", "no weights.npy"), ("short_weights", "the spec wants float32 (16,)"),
    ("bad_metadata", "bad/metadata.json: not valid JSON"),
    ("truncated_sparse", "bad/weights_sparse.npz: not a sparse weights file"),
])
def test_publish_refuses_an_incomplete_model(tmp_path, capsys, kind, message):
    ptr = tmp_path / "current"
    assert main(["publish", "--model", make_model(tmp_path / "good"), "--pointer", str(ptr)]) == 0
    before = ptr.read_bytes()
    _break(kind, tmp_path / "bad")
    assert main(["publish", "--model", str(tmp_path / "bad"), "--pointer", str(ptr)]) == 1
    err = capsys.readouterr().err
    assert "terascale publish: failed: refusing to publish: " in err and message in err
    assert ptr.read_bytes() == before


def test_publish_refuses_metrics_without_logloss(tmp_path, capsys):
    bad = write_json(tmp_path / "m.json", {"auroc": 0.7})
    assert main(["publish", "--model", make_model(tmp_path / "m"), "--pointer", str(tmp_path / "p"), "--metrics", bad]) == 1
    assert "no finite 'logloss'" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_readers_always_see_a_complete_pointer(tmp_path):
    """Publishing again and again while a reader polls: never a missing, partial or foreign pointer."""
    models = {make_model(tmp_path / "a", fill=1.0), make_model(tmp_path / "b", fill=2.0)}
    ptr = str(tmp_path / "current")
    assert main(["publish", "--model", sorted(models)[0], "--pointer", ptr]) == 0
    seen, errors, stop = [], [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                seen.append(read_pointer(ptr)["model"])
            except Exception as e:  # noqa: BLE001 - any failure to read is the bug under test
                errors.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(150):
            assert main(["publish", "--model", sorted(models)[i % 2], "--pointer", ptr]) == 0
    finally:
        stop.set()
        t.join(timeout=10)
    assert errors == [] and len(seen) > 10 and set(seen) <= models
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "current"]


# ------------------------------------------------------------------- pointers as model paths


def test_pointer_is_followed_as_a_model_path(tmp_path, capsys):
    m = make_model(tmp_path / "m")
    assert _model_path(m) == m
    assert main(["publish", "--model", m, "--pointer", str(tmp_path / "current")]) == 0
    assert _model_path(str(tmp_path / "current")) == m
    cfg = load_config([], [f"train.init_model={tmp_path / 'current'}"])
    assert _warm_start(cfg, None).train.init_model == m
    assert _warm_start(load_config(), str(tmp_path / "current")).train.init_model == m


def test_first_day_trains_from_scratch(tmp_path, capsys):
    cfg = load_config()
    assert _warm_start(cfg, str(tmp_path / "current")) is cfg
    assert f"no model at {tmp_path / 'current'}: training from scratch" in capsys.readouterr().out


def test_init_model_given_twice_is_a_usage_error(tmp_path, capsys):
    rc = main(["train", "--input", str(tmp_path), "--model", str(tmp_path / "m"), "--init-model-if-exists",
               str(tmp_path / "p"), "--set", f"train.init_model={tmp_path / 'x'}"])
    assert rc == 2
    assert "give either --init-model-if-exists or train.init_model, not both" in capsys.readouterr().err


def test_a_rerun_cannot_overwrite_the_served_model(tmp_path, capsys):
    m = make_model(tmp_path / "day1")
    assert main(["publish", "--model", m, "--pointer", str(tmp_path / "current")]) == 0
    before = (tmp_path / "day1" / "weights.npy").read_bytes()
    rc = main(["train", "--input", str(tmp_path / "data"), "--model", m + "/",
               "--init-model-if-exists", str(tmp_path / "current")])
    assert rc == 2
    assert f"--model {m}/ is the model training warm-starts from" in capsys.readouterr().err
    assert (tmp_path / "day1" / "weights.npy").read_bytes() == before
    rc = main(["train", "--input", str(tmp_path / "data"), "--model", m, "--set", f"train.init_model={m}"])
    assert rc == 2


def test_overwrite_cannot_replace_a_served_model_in_place(tmp_path, capsys):
    """train --overwrite into the directory a pointer serves is refused; once the pointer serves
    another model, the old directory may be replaced (the check runs before any Spark work)."""
    m = make_model(tmp_path / "day1")
    assert main(["publish", "--model", m, "--pointer", str(tmp_path / "current")]) == 0
    assert json.loads((tmp_path / "day1" / "_published.json").read_text())["pointers"] == [str(tmp_path / "current")]
    before = (tmp_path / "day1" / "weights.npy").read_bytes()
    rc = main(["train", "--input", str(tmp_path / "data"), "--model", m, "--overwrite"])
    assert rc == 2
    assert f"--model {m}: is the model served by the pointer {tmp_path / 'current'}" in capsys.readouterr().err
    assert (tmp_path / "day1" / "weights.npy").read_bytes() == before
    m2 = make_model(tmp_path / "day2")
    assert main(["publish", "--model", m2, "--pointer", str(tmp_path / "current")]) == 0
    from terascale.jobs.train_job import check_outputs

    check_outputs(load_config([], ["train.overwrite=true"]), str(tmp_path / "data"), m)  # served no more: allowed


# ------------------------------------------------------------- entry points as subprocesses


@pytest.fixture
def bad_inputs(tmp_path):
    (tmp_path / "badptr").write_text("not json")
    (tmp_path / "empty").mkdir()
    return tmp_path


# Each fails before any Spark session starts. test_cli.py covers `python -m jobs.cli featurize`
# with a missing input (exit 1, after Spark starts); here the script files themselves.
@pytest.mark.parametrize("job, args, rc, message", [
    ("featurize", ["--input", "missing", "--output", "o", "--set", "featurize.bits=99"], 2,
     "terascale featurize: error: featurize.bits = 99"),
    ("train", ["--input", "missing", "--model", "m", "--init-model-if-exists", "badptr"], 1,
     "terascale train: failed: pointer badptr: not valid JSON"),
    ("evaluate", ["--input", "missing", "--model", "badptr", "--out", "m.json"], 1,
     "terascale evaluate: failed: pointer badptr: not valid JSON"),
    ("predict", ["--input", "missing", "--model", "badptr", "--output", "o"], 1,
     "terascale predict: failed: pointer badptr: not valid JSON"),
    ("gate", ["--metrics", "missing.json", "--baseline", "current"], 1,
     "terascale gate: failed: metrics missing.json: no such file"),
    ("publish", ["--model", "empty", "--pointer", "current"], 1,
     "terascale publish: failed: refusing to publish: "),
])
def test_job_entry_point_exits_non_zero(bad_inputs, job, args, rc, message):
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "submit" / f"{job}.py"), *args],
                       capture_output=True, text=True, timeout=120, cwd=bad_inputs)
    assert r.returncode == rc, r.stderr[-2000:]
    assert message in r.stderr
    assert not (bad_inputs / "current").exists()


def test_gate_and_publish_never_import_spark(tmp_path):
    m = make_model(tmp_path / "m")
    metrics = write_json(tmp_path / "m.json", {"logloss": 0.4})
    code = ("import sys; from terascale.jobs.cli import main; "
            f"rc = main(['gate', '--metrics', {metrics!r}, '--baseline', 'current']) "
            f"+ main(['publish', '--model', {m!r}, '--pointer', 'current', '--metrics', {metrics!r}]); "
            "print(rc, 'pyspark' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.stdout.splitlines()[-1] == "0 False", r.stderr[-2000:]
    assert read_pointer(str(tmp_path / "current"))["metrics"] == {"logloss": 0.4}


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_evaluate_and_predict_refuse_a_broken_model_before_spark_starts(tmp_path, capsys, monkeypatch, command):
    import terascale.jobs.session as session

    def no_spark(*a, **k):
        raise AssertionError("a Spark session was asked for")

    monkeypatch.setattr(session, "get_spark", no_spark)
    _break("bad_metadata", tmp_path / "bad")
    extra = ["--output", str(tmp_path / "out")] if command == "predict" else []
    assert main([command, "--input", str(tmp_path / "data"), "--model", str(tmp_path / "bad"), *extra]) == 1
    assert f"{tmp_path / 'bad' / 'metadata.json'}: not valid JSON" in capsys.readouterr().err


def test_a_pointer_to_a_deleted_model_is_named_with_the_model(tmp_path, capsys, monkeypatch):
    import shutil

    import terascale.jobs.session as session

    monkeypatch.setattr(session, "get_spark", lambda *a, **k: pytest.fail("a Spark session was asked for"))
    m = make_model(tmp_path / "m")
    ptr = tmp_path / "current"
    assert main(["publish", "--model", m, "--pointer", str(ptr)]) == 0
    shutil.rmtree(m)
    capsys.readouterr()
    assert main(["evaluate", "--input", str(tmp_path / "data"), "--model", str(ptr)]) == 1
    assert f"model pointer {ptr} -> {m}: no such model directory or pointer file" in capsys.readouterr().err


def test_a_sparse_model_is_checked_without_its_dense_vector(tmp_path):
    from terascale.pipeline.pointer import check_complete

    staging = modeldir.staging_dir(str(tmp_path / "m"))
    w = np.zeros(1 << 10, np.float32)
    w[[3, 700]] = [0.5, -1.25]
    modeldir.write_weights(staging, w, storage="sparse")
    modeldir.commit(staging, str(tmp_path / "m"), {"spec": {"bits": 10}, "intercept": 0.0})
    assert check_complete(str(tmp_path / "m"))["spec"]["bits"] == 10
    idx, val = modeldir.sparse_weights(str(tmp_path / "m"), 1 << 10)
    assert idx.tolist() == [3, 700] and val.tolist() == [0.5, -1.25]
    with pytest.raises(modeldir.ModelError, match=r"weights_sparse\.npz: 1024 weights, the spec wants 2048"):
        modeldir.sparse_weights(str(tmp_path / "m"), 1 << 11)
