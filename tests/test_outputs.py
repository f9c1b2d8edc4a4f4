"""Outputs never destroy what terascale did not write (pipeline.artifacts and every job's target).

No Spark here: every refusal happens before the session starts (``jobs.session.get_spark`` is
made to fail the test if it is reached), and the commits run on real directories with a failure
injected after each step (``artifacts.FAULT``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from terascale.jobs import run_checkpoints, session
from terascale.jobs.cli import main
from terascale.jobs.config import load_config
from terascale.jobs.run_checkpoints import RunCheckpoints
from terascale.pipeline import artifacts, modeldir
from terascale.pipeline.manifest import DatasetError, read_manifest
from terascale.pipeline.pointer import publish
from terascale.pipeline.spark_featurize import _commit
from terascale.pipeline.spec import FeatureSpec

STEPS = ("staged", "aside", "placed", "cleaned")


class Crash(BaseException):
    """A crash at a commit step: no except-Exception clean-up runs after it, as after a kill."""


class SparkStarted(BaseException):  # not an Exception: the CLI does not turn it into exit 1
    pass


@pytest.fixture(autouse=True)
def no_spark(monkeypatch):
    def refuse(*_a, **_k):
        raise SparkStarted("a Spark session was requested")

    monkeypatch.setattr(session, "get_spark", refuse)


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (the user's bytes, compared after)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def make_model(path: Path, fill: float = 0.0) -> str:
    staging = modeldir.staging_dir(str(path))
    modeldir.write_weights(staging, np.full(16, fill, np.float32))
    modeldir.commit(staging, str(path), {"spec": {"bits": 4}, "intercept": float(fill)})
    return str(path)


def make_dataset(path: Path, tag: str = "old") -> str:
    path.mkdir(parents=True)
    (path / "part-00000.parquet").write_bytes(f"rows of {tag}".encode())
    (path / "_manifest.json").write_text(json.dumps({"format_version": 1, "tag": tag, "files": []}))
    return str(path)


def user_dir(path: Path, names=("notes.txt",)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for n in names:
        (path / n).write_text(f"the user's {n}\n")
    return path


def err_of(capsys) -> str:
    return capsys.readouterr().err


# ------------------------------------------------------------------ what a path holds


def test_inspect_names_every_kind(tmp_path):
    assert artifacts.inspect(str(tmp_path / "nothing")).kind == "missing"
    (tmp_path / "e").mkdir()
    assert artifacts.inspect(str(tmp_path / "e")).kind == "empty"
    assert artifacts.inspect(make_dataset(tmp_path / "d")).kind == "dataset"
    assert artifacts.inspect(make_model(tmp_path / "m")).kind == "model"
    f = artifacts.inspect(str(user_dir(tmp_path / "u", ("b.txt", "a.tsv"))))
    assert (f.kind, f.foreign) == ("foreign", ["a.tsv", "b.txt"])
    publish(str(tmp_path / "m"), str(tmp_path / "current"))
    assert artifacts.inspect(str(tmp_path / "current")).kind == "pointer"
    (tmp_path / "plain.txt").write_text("x")
    assert artifacts.inspect(str(tmp_path / "plain.txt")).kind == "file"
    artifacts.write_marker(str(tmp_path / "c"), artifacts.CHECKPOINTS, "r1")
    assert artifacts.inspect(str(tmp_path / "c")).kind == "checkpoints"
    # predictions of an older terascale: a manifest of kind predictions, no marker
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "_manifest.json").write_text(json.dumps({"kind": "predictions"}))
    assert artifacts.inspect(str(tmp_path / "p")).kind == "predictions"
    # a user's own _manifest.json / metadata.json (no terascale format marker) is no artifact
    u = user_dir(tmp_path / "u2", ("_manifest.json", "metadata.json"))
    assert artifacts.inspect(str(u)).kind == "foreign"
    # a model directory with the user's file in it
    (tmp_path / "m" / "notes.txt").write_text("mine")
    f = artifacts.inspect(str(tmp_path / "m"))
    assert (f.kind, f.foreign) == ("model", ["notes.txt"])


@pytest.mark.parametrize("kind", [artifacts.DATASET, artifacts.MODEL, artifacts.PREDICTIONS])
def test_guard_uses_missing_and_empty_targets(tmp_path, kind):
    assert artifacts.check_target(str(tmp_path / "new"), kind, False, "--x", "--overwrite").kind == "missing"
    (tmp_path / "e").mkdir()
    assert artifacts.check_target(str(tmp_path / "e"), kind, False, "--x", "--overwrite").kind == "empty"


def test_guard_refuses_and_names_what_it_found(tmp_path):
    d = make_dataset(tmp_path / "d")
    with pytest.raises(artifacts.OutputError) as e:
        artifacts.check_target(d, artifacts.MODEL, True, "--model", "--overwrite")
    assert str(e.value) == (f"--model {d}: exists and is a terascale dataset (_manifest.json), not a model; "
                            "refusing to replace it")
    u = user_dir(tmp_path / "u", ("notes.txt", "a", "b", "c", "d", "e", "f"))
    with pytest.raises(artifacts.OutputError, match=r"holds 7 files that terascale did not write \(a, b, c, d, e, "
                                                    r"\.\.\. \(2 more\)\)"):
        artifacts.check_target(str(u), artifacts.DATASET, True, "--output", "--overwrite")
    with pytest.raises(artifacts.OutputError, match="pass --overwrite to replace it"):
        artifacts.check_target(d, artifacts.DATASET, False, "--output", "--overwrite")
    # a foreign directory is named by its top level only (it may be huge: it is not walked)
    user_dir(tmp_path / "home" / "logs" / "2026", ("a.tsv",))
    (tmp_path / "home" / "notes.txt").write_text("x")
    with pytest.raises(artifacts.OutputError, match=r"holds 2 entries that terascale did not write \(logs/, notes.txt\)"):
        artifacts.check_target(str(tmp_path / "home"), artifacts.MODEL, True, "--model", "--overwrite")
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(artifacts.OutputError, match=r"also holds 1 file that terascale did not write \(notes.txt\)"):
        artifacts.check_target(d, artifacts.DATASET, True, "--output", "--overwrite")


def test_outputs_must_not_overlap_their_inputs(tmp_path):
    d = str(tmp_path / "d")
    for target, rel in ((d, "is"), (d + "/sub", "is inside"), (str(tmp_path), "contains")):
        with pytest.raises(artifacts.OutputError, match=f"--output {target}: {rel} the input dataset {d}"):
            artifacts.check_apart(target, "--output", {"the input dataset": d})
    artifacts.check_apart(str(tmp_path / "dd"), "--output", {"the input dataset": d})  # a sibling prefix is fine


# ------------------------------------------------------------------ every job refuses a user's directory, via the CLI


def _train(tmp_path, model, *extra):
    return main(["train", "--input", str(tmp_path / "data"), "--model", str(model), *extra])


@pytest.mark.parametrize("case", ["dataset", "user_dir", "user_file"])
def test_train_refuses_a_model_target_that_is_not_a_model(tmp_path, capsys, case):
    target = {"dataset": lambda: Path(make_dataset(tmp_path / "t")),
              "user_dir": lambda: user_dir(tmp_path / "t"),
              "user_file": lambda: (tmp_path / "t").write_text("mine") and tmp_path / "t"}[case]()
    if case == "dataset":
        (target / "notes.txt").write_text("the user's notes")
    before = snapshot(tmp_path)
    assert _train(tmp_path, target, "--overwrite") == 2
    err = err_of(capsys)
    assert f"terascale train: error: --model {target}: " in err
    assert {"dataset": "is a terascale dataset (_manifest.json), not a model; refusing to replace it",
            "user_dir": "holds 1 file that terascale did not write (notes.txt)",
            "user_file": "is a file, not a directory; refusing to replace it"}[case] in err
    assert snapshot(tmp_path) == before


def test_train_refuses_a_published_pointer_as_model(tmp_path, capsys):
    make_model(tmp_path / "m1")
    publish(str(tmp_path / "m1"), str(tmp_path / "current"))
    before = snapshot(tmp_path)
    assert _train(tmp_path, tmp_path / "current", "--overwrite") == 2
    assert (f"--model {tmp_path / 'current'}: exists and is a model pointer; only `terascale publish` changes "
            "pointers") in err_of(capsys)
    assert snapshot(tmp_path) == before


def test_train_replaces_a_model_only_with_overwrite(tmp_path, capsys):
    m = make_model(tmp_path / "m")
    assert _train(tmp_path, m) == 2
    assert f"--model {m}: exists and is a terascale model (metadata.json); pass --overwrite (or train.overwrite: " \
           "true) to replace it" in err_of(capsys)
    with pytest.raises(SparkStarted):  # past the guard: the flag and the configuration key both allow it
        _train(tmp_path, m, "--overwrite")
    with pytest.raises(SparkStarted):
        _train(tmp_path, m, "--set", "train.overwrite=true")


def test_train_refuses_a_checkpoint_dir_holding_the_users_notes(tmp_path, capsys):
    notes = user_dir(tmp_path / "ck")
    before = snapshot(tmp_path)
    assert _train(tmp_path, tmp_path / "m", "--set", f"train.checkpoint_dir={notes}") == 2
    assert (f"train.checkpoint_dir {notes}: holds 1 file that terascale did not write (notes.txt); refusing to "
            "replace it") in err_of(capsys)
    assert snapshot(tmp_path) == before
    # the default checkpoint directory beside the model too
    user_dir(tmp_path / "m2.checkpoint")
    assert _train(tmp_path, tmp_path / "m2") == 2
    assert f"train.checkpoint_dir {tmp_path / 'm2.checkpoint'}: holds 1 file" in err_of(capsys)
    # inside the input dataset
    assert _train(tmp_path, tmp_path / "m3", "--set", f"train.checkpoint_dir={tmp_path / 'data' / 'ck'}") == 2
    assert f"is inside the input dataset {tmp_path / 'data'}" in err_of(capsys)


def test_checkpoint_dir_is_marked_and_removed_only_when_ours(tmp_path):
    ck = str(tmp_path / "ck")
    with RunCheckpoints(ck, "run1") as r1:
        assert artifacts.read_marker(ck, artifacts.CHECKPOINTS)["run"] == "run1"
        assert r1.dir == f"{ck}/run-run1" and os.path.isfile(f"{r1.dir}/{run_checkpoints.LEASE}")
        (Path(r1.dir) / "pass-000001.a00.npz").write_bytes(b"state")
    r1.finish()
    assert not (tmp_path / "ck").exists()
    # an empty directory the user made is used, emptied at the end and kept
    (tmp_path / "mine").mkdir()
    with RunCheckpoints(str(tmp_path / "mine"), "run4") as r4:
        pass
    r4.finish()
    assert (tmp_path / "mine").is_dir() and os.listdir(tmp_path / "mine") == []


def test_runs_sharing_a_checkpoint_dir_keep_apart_and_stale_runs_are_removed(tmp_path, caplog):
    """Run B starts while run A (same checkpoint directory) still trains: B neither reads nor
    removes A's checkpoints; a dead run's (stale lease) and an ended run's are removed."""
    ck = str(tmp_path / "ck")
    with RunCheckpoints(ck, "A") as a:
        (Path(a.dir) / "pass-000038.a00.npz").write_bytes(b"A's state")
        dead = RunCheckpoints(ck, "dead").open()
        dead.__exit__(None, None, None)
        lease = json.loads((Path(dead.dir) / run_checkpoints.LEASE).read_text())
        lease["at"] -= run_checkpoints.STALE_AFTER_S + 1  # its driver died long ago
        (Path(dead.dir) / run_checkpoints.LEASE).write_text(json.dumps(lease))
        with pytest.raises(RuntimeError):
            with RunCheckpoints(ck, "failed"):
                raise RuntimeError("the run failed")
        with caplog.at_level(logging.WARNING, logger="terascale.train"):
            with RunCheckpoints(ck, "B") as b:
                assert sorted(os.listdir(ck)) == [artifacts.CHECKPOINTS_MARKER, "run-A", "run-B"]
                assert os.listdir(b.dir) == [run_checkpoints.LEASE]  # nothing of A's to resume from
        assert "shared with run A" in caplog.text and "run-dead" in caplog.text and "run-failed" in caplog.text
        b.finish()
        assert sorted(os.listdir(ck)) == [artifacts.CHECKPOINTS_MARKER, "run-A"]
        assert (Path(a.dir) / "pass-000038.a00.npz").read_bytes() == b"A's state"
    a.finish()
    assert not (tmp_path / "ck").exists()


def _predict(tmp_path, output, *extra):
    return main(["predict", "--input", str(tmp_path / "data"), "--model", str(tmp_path / "m"),
                 "--output", str(output), *extra])


def test_predict_refuses_the_users_part_files_and_its_own_input(tmp_path, capsys):
    make_dataset(tmp_path / "data")
    make_model(tmp_path / "m")
    logs = user_dir(tmp_path / "logs", ("part-00000", "part-00001.tsv", "README"))
    (tmp_path / "dlink").symlink_to(tmp_path / "data")  # the dataset through a symbolic link
    before = snapshot(tmp_path)
    assert _predict(tmp_path, logs, "--overwrite") == 2
    assert f"--output {logs}: holds 3 files that terascale did not write (README, part-00000, part-00001.tsv)" \
        in err_of(capsys)
    for target, what in ((tmp_path / "data", "is the input dataset"), (tmp_path / "data" / "p", "is inside the input"),
                         (tmp_path, "contains the input dataset"), (tmp_path / "m", "is the model"),
                         (tmp_path / "dlink" / "p", "is inside the input"), (tmp_path / "dlink", "is the input dataset")):
        assert _predict(tmp_path, target, "--overwrite") == 2
        assert f"--output {target}: {what}" in err_of(capsys)
    assert snapshot(tmp_path) == before


def test_predict_replaces_predictions_only_with_overwrite(tmp_path, capsys):
    make_dataset(tmp_path / "data")
    make_model(tmp_path / "m")
    artifacts.write_marker(str(tmp_path / "p"), artifacts.PREDICTIONS, "r0")
    assert _predict(tmp_path, tmp_path / "p") == 2
    assert "exists and is terascale predictions (_terascale_predictions.json); pass --overwrite" in err_of(capsys)
    with pytest.raises(SparkStarted):
        _predict(tmp_path, tmp_path / "p", "--overwrite")


def test_featurize_refuses_a_users_directory_and_an_unflagged_dataset(tmp_path, capsys):
    raw = user_dir(tmp_path / "raw", ("day1.tsv",))
    mine = user_dir(tmp_path / "out", ("notes.txt",))
    ds = make_dataset(tmp_path / "ds")
    before = snapshot(tmp_path)

    def featurize(out, *extra):
        return main(["featurize", "--input", str(raw), "--output", str(out), *extra])

    assert featurize(mine, "--overwrite") == 2
    assert f"terascale featurize: error: --output {mine}: holds 1 file that terascale did not write" in err_of(capsys)
    assert featurize(ds) == 2
    assert "pass --overwrite (or featurize.overwrite: true)" in err_of(capsys)
    assert featurize(raw / "ds", "--overwrite") == 2
    assert f"--output {raw / 'ds'}: is inside the input {raw}" in err_of(capsys)
    assert snapshot(tmp_path) == before
    with pytest.raises(SparkStarted):
        featurize(ds, "--overwrite")


def test_evaluate_out_replaces_only_a_metrics_file(tmp_path, capsys):
    make_model(tmp_path / "m")
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    (tmp_path / "metrics.json").write_text('{"logloss": 0.5, "auroc": 0.7}')

    def evaluate(out, *extra):
        return main(["evaluate", "--input", str(tmp_path / "data"), "--model", str(tmp_path / "m"), "--out", str(out),
                     *extra])

    assert evaluate(tmp_path / "notes.json", "--overwrite") == 2
    assert (f"--out {tmp_path / 'notes.json'}: exists and is a file that evaluate did not write, not a metrics "
            "file; refusing to replace it") in err_of(capsys)
    assert evaluate(tmp_path / "m", "--overwrite") == 2
    assert f"--out {tmp_path / 'm'}: exists and is a terascale model (metadata.json), not a metrics file" in err_of(capsys)
    assert evaluate(tmp_path / "metrics.json") == 2
    assert "pass --overwrite to replace it" in err_of(capsys)
    with pytest.raises(SparkStarted):
        evaluate(tmp_path / "metrics.json", "--overwrite")
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'


def test_publish_is_the_only_writer_of_a_pointer_and_refuses_a_users_file(tmp_path, capsys):
    m = make_model(tmp_path / "m")
    (tmp_path / "notes").write_text("not a pointer")
    assert main(["publish", "--model", m, "--pointer", str(tmp_path / "notes")]) == 2
    assert f"--pointer {tmp_path / 'notes'}: exists and is not a terascale pointer" in err_of(capsys)
    assert (tmp_path / "notes").read_text() == "not a pointer"
    (tmp_path / "d").mkdir()
    assert main(["publish", "--model", m, "--pointer", str(tmp_path / "d")]) == 2
    assert "exists and is a directory, not a model pointer" in err_of(capsys)


# ------------------------------------------------------------------ atomic replace: a crash after every step


def _crash_at(step):
    def fault(name):
        if name == step:
            raise Crash(step)
    return fault


def _whole(path: Path, kind: str) -> str | None:
    """'old' or 'new' when ``path`` holds a whole artifact of that tag, else None."""
    if kind == "model":
        try:
            w, b, _ = modeldir.load_model(str(path))
        except (modeldir.ModelError, FileNotFoundError):
            return None
        return {0.0: "old", 1.0: "new"}.get(b) if np.all(w == b) else None
    try:
        m = read_manifest(str(path)) if kind == "dataset" else json.loads((path / "_manifest.json").read_text())
    except (DatasetError, FileNotFoundError):
        return None
    tag = m.get("tag")
    part = (path / "part-00000.parquet").read_bytes()
    return tag if part == f"rows of {tag}".encode() else None


def _check_after_crash(tmp_path: Path, target: Path, kind: str, step: str, recover):
    """After a crash at ``step``: old or new is whole at the target, or at the aside, which the
    next writer restores and a reader names; the user's sibling file is untouched."""
    expect = {"staged": "old", "aside": None, "placed": "new", "cleaned": "new"}[step]
    assert _whole(target, kind) == expect
    left = artifacts.asides(str(target))
    if expect is None:
        assert not target.exists() and len(left) == 1 and _whole(Path(left[0]), kind) == "old"
        if kind != "predictions":
            reader = modeldir.load_model if kind == "model" else read_manifest
            with pytest.raises((modeldir.ModelError, DatasetError), match=f"left the previous version at {left[0]}"):
                reader(str(target))
    recover()  # the next run that writes the target
    assert _whole(target, kind) == (expect or "old")
    assert artifacts.asides(str(target)) == []
    assert (tmp_path / "sibling.txt").read_text() == "the user's"


@pytest.mark.parametrize("step", STEPS)
def test_model_commit_crash_leaves_old_or_new(tmp_path, monkeypatch, step):
    (tmp_path / "sibling.txt").write_text("the user's")
    m = tmp_path / "m"
    make_model(m, 0.0)
    staging = modeldir.staging_dir(str(m), "r2")
    modeldir.write_weights(staging, np.full(16, 1.0, np.float32))
    monkeypatch.setattr(artifacts, "FAULT", _crash_at(step))
    with pytest.raises(Crash):
        modeldir.commit(staging, str(m), {"spec": {"bits": 4}, "intercept": 1.0}, overwrite=True, run="r2")
    monkeypatch.setattr(artifacts, "FAULT", None)
    _check_after_crash(tmp_path, m, "model", step,
                       lambda: artifacts.check_target(str(m), artifacts.MODEL, True, "--model", ""))


def _featurize_results(tmp_path: Path, tag: str) -> list[dict]:
    part = tmp_path / f"task-{tag}" / "part.parquet"
    part.parent.mkdir()
    part.write_bytes(f"rows of {tag}".encode())
    return [{"task": 0, "rows": 3, "data_path": str(part), "nnz": 9, "bytes": part.stat().st_size, "positives": 1,
             "weight_sum": 3.0, "multi_rows": 0, "quarantine_path": "",
             "inputs": {"in.tsv": {"lines": 3, "rows": 3, "quarantined": {}}}}]


@pytest.mark.parametrize("step", STEPS)
def test_dataset_commit_crash_leaves_old_or_new(tmp_path, monkeypatch, step):
    (tmp_path / "sibling.txt").write_text("the user's")
    out = tmp_path / "ds"
    spec = FeatureSpec(bits=4)

    def commit(tag):
        root = artifacts.staging_path(str(out), tag)
        m = _commit(str(out), root, spec, ["in.tsv"], _featurize_results(tmp_path, tag), 0.1, {}, None,
                    overwrite=True, run_id=tag)
        return m

    commit("old")
    manifest = out / "_manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tag": "old"}))
    monkeypatch.setattr(artifacts, "FAULT", _crash_at(step))
    real_write = artifacts.replace_dir

    def tagged(root, target, run):  # stamp the new manifest so _whole can tell the versions apart
        p = Path(root) / "_manifest.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "tag": "new"}))
        real_write(root, target, run)

    monkeypatch.setattr(artifacts, "replace_dir", tagged)
    with pytest.raises(Crash):
        commit("new")
    monkeypatch.setattr(artifacts, "FAULT", None)
    _check_after_crash(tmp_path, out, "dataset", step,
                       lambda: artifacts.check_target(str(out), artifacts.DATASET, True, "--output", ""))


def test_an_ordinary_error_between_the_renames_puts_the_old_output_back(tmp_path, monkeypatch):
    m = tmp_path / "m"
    make_model(m, 0.0)
    staging = modeldir.staging_dir(str(m), "r2")
    modeldir.write_weights(staging, np.full(16, 1.0, np.float32))
    from terascale.pipeline import fsutil

    real_move, calls = fsutil.move, []

    def failing_second_move(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk gone")
        real_move(src, dst)

    monkeypatch.setattr(fsutil, "move", failing_second_move)
    with pytest.raises(OSError, match="disk gone"):
        modeldir.commit(staging, str(m), {"spec": {"bits": 4}, "intercept": 1.0}, overwrite=True, run="r2")
    monkeypatch.setattr(fsutil, "move", real_move)
    assert _whole(m, "model") == "old" and artifacts.asides(str(m)) == []


def test_model_commit_rechecks_the_target(tmp_path):
    staging = modeldir.staging_dir(str(tmp_path / "m"), "r")
    modeldir.write_weights(staging, np.zeros(16, np.float32))
    user_dir(tmp_path / "m")  # appeared while the model trained
    with pytest.raises(artifacts.OutputError, match="holds 1 file that terascale did not write"):
        modeldir.commit(staging, str(tmp_path / "m"), {"spec": {"bits": 4}, "intercept": 0.0}, overwrite=True)
    assert snapshot(tmp_path / "m") == {"notes.txt": hashlib.sha256(b"the user's notes.txt\n").hexdigest()}


def test_config_keys_exist():
    cfg = load_config([], ["featurize.overwrite=true", "train.overwrite=true", "predict.overwrite=true"])
    assert (cfg.featurize.overwrite, cfg.train.overwrite, cfg.predict.overwrite) == (True, True, True)
    assert load_config().train.overwrite is False


def test_demo_reruns_over_its_own_logs_only(tmp_path):
    from terascale.jobs.demo import _remove_generated

    gen = user_dir(tmp_path / "raw", ("part-00000.tsv", "part-00000.prob.npy", "_truth.json"))
    _remove_generated(str(gen))
    assert not gen.exists()
    mine = user_dir(tmp_path / "raw2", ("part-00000.tsv", "clicks.csv"))
    with pytest.raises(artifacts.OutputError, match=f"demo: {mine} holds files the demo did not generate "
                                                    r"\(clicks.csv\)"):
        _remove_generated(str(mine))
    assert sorted(os.listdir(mine)) == ["clicks.csv", "part-00000.tsv"]


def test_files_terascale_adds_to_its_artifacts_are_its_own(tmp_path):
    """A model's token dictionary and publication record, a dataset's token dictionary: replacing
    such an artifact with overwrite is allowed (they are not a user's files)."""
    m = make_model(tmp_path / "m")
    (tmp_path / "m" / "tokens.parquet").write_bytes(b"t")
    (tmp_path / "m" / "_published.json").write_text("{}")
    assert artifacts.check_target(m, artifacts.MODEL, True, "--model", "").foreign == []
    ds = make_dataset(tmp_path / "ds")
    (Path(ds) / "_tokens.parquet").write_bytes(b"t")
    assert artifacts.check_target(ds, artifacts.DATASET, True, "--output", "").foreign == []


def test_a_model_replaced_at_the_same_path_is_scored_anew(tmp_path):
    """The scoring process keeps the last model it loaded; ``train --overwrite`` into the same
    directory (an atomic replacement) must not leave evaluate/predict scoring the old weights."""
    from terascale.jobs import scoring

    def model(fill: float) -> None:
        staging = modeldir.staging_dir(str(tmp_path / "m"))
        modeldir.write_weights(staging, np.full(16, fill, np.float32), storage="dense")
        meta = {"spec": {"bits": 4}, "intercept": fill, "config": {"train": {"loss": "logistic"}}}
        modeldir.commit(staging, str(tmp_path / "m"), meta, overwrite=True)

    model(0.25)
    w, b, loss, _ = scoring._model(str(tmp_path / "m"))
    assert (float(w[0]), b, loss) == (0.25, 0.25, "logistic")
    model(-1.5)
    w, b, _, _ = scoring._model(str(tmp_path / "m"))
    assert (float(w[0]), b) == (-1.5, -1.5)
