"""train.l2 = auto (the default) and train.l1 = auto through the train job: the path is recorded
in metadata.json, summarised, plotted in the report and used by evaluate; a task failing inside
the path resumes from its checkpoint on the same λ and the model has the clean run's bits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.report import build_report
from terascale.jobs.scoring import evaluate
from terascale.jobs.steps import train_summary
from terascale.jobs.train_job import run_train
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.modeldir import load_model
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec
from terascale.solvers.regpath import PATHS, effective_l2, effective_penalty

pytestmark = pytest.mark.spark
BASE = ["train.workers=2", "train.passes=6", "train.checkpoint_interval_s=0", "spark.master=local[2]"]


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("regpath")
    generate_clicklogs(d / "raw", 6000, files=2, seed=3, processes=1)
    generate_clicklogs(d / "rawt", 2000, files=1, seed=4, processes=1)
    for name, raw in (("tr", "raw"), ("te", "rawt")):
        spec = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=0)
        run_featurize(spark, [str(d / raw)], str(d / name), spec, load_config([], ["featurize.partitions=2"]).featurize)
    return d


@pytest.fixture(scope="module")
def clean(spark, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "m"
    cfg = load_config([], BASE)
    assert cfg.train.l2 == "auto"  # the default
    return out, run_train(spark, cfg, str(data / "tr"), str(out))


def test_the_default_fits_a_path_and_records_it(spark, data, clean, tmp_path):
    model, meta = clean
    on_disk = json.loads((model / "metadata.json").read_text())
    reg = on_disk["regularization"]
    assert on_disk["config"]["train"]["l2"] == "auto" and reg["penalty"] == "l2"
    steps = reg["steps"]
    # the path scales with the dataset's rows (all shards, held-out rows included): 100 / N first
    assert reg["rows"] == 6000
    rule = PATHS["l2"]
    assert [s["l2"] for s in steps] == [rule.next_value(steps[:k], 6000) for k in range(len(steps))]
    assert steps[0]["l2"] == pytest.approx(100 / 6000) and "(100 / 6,000 rows)" in reg["rule"]
    holdouts = [s["holdout_loss"] for s in steps]
    assert reg["chosen_step"] == holdouts.index(min(holdouts)) and reg["value"] == steps[reg["chosen_step"]]["l2"]
    assert reg["stop"] == rule.over(steps, 6000) and rule.next_value(steps, 6000) is None
    assert on_disk["objective"] == steps[reg["chosen_step"]]["objective"]
    assert len(on_disk["history"]) == sum(s["passes"] for s in steps)
    assert [h["pass"] for h in on_disk["history"]] == list(range(1, len(on_disk["history"]) + 1))
    assert effective_l2(on_disk) == reg["value"]
    # the driver's summary names the path and marks the choice
    text = train_summary(on_disk)
    assert "l2 auto" in text and f"chose {reg['value']:g} (step {reg['chosen_step'] + 1} of {len(steps)}" in text
    assert text.count(" <-") == 1
    # evaluate's objective is f at the chosen λ
    metrics = evaluate(spark, str(data / "te"), str(model))
    assert f"+ {reg['value']:g}/2 |beta|^2" in metrics["objective_definition"]
    w, b, _ = load_model(str(model))
    assert np.isfinite(metrics["objective"]) and metrics["objective"] > 0
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    page = open(build_report(str(model), str(tmp_path / "metrics.json"), str(tmp_path / "r"))).read()
    assert "<h2>Regularization path</h2>" in page and 'alt="regularization_path"' in page
    assert (tmp_path / "r" / "regularization_path.png").stat().st_size > 1000
    assert f"l2 auto: {reg['value']:g}" in page
    assert w.dtype == np.float32 and np.isfinite(b)


def _disk(tmp_path) -> list[str]:
    return ["train.data_cache=disk", "train.memory_budget_mb=28", f"train.cache_dir={tmp_path / 'local'}"]


def test_the_path_from_the_disk_cache_gives_memory_modes_model_and_streams_its_rows(spark, data, clean, tmp_path):
    """Invariant 9 on the path: from the local shard cache the model, every step and every pass are
    memory mode's, bit for bit; the ranks' steps renumber the cache's files in place, so the memory
    record (driver and ranks) counts the blocks a pass holds and no copy of the indices."""
    model, meta = clean
    disk = run_train(spark, load_config([], [*BASE, *_disk(tmp_path)]), str(data / "tr"), str(tmp_path / "d"))
    w_mem, b_mem, _ = load_model(str(model))
    w_disk, b_disk, _ = load_model(str(tmp_path / "d"))
    assert w_disk.tobytes() == w_mem.tobytes() and b_disk == b_mem and disk["objective"] == meta["objective"]
    drop = ("seconds",)
    assert [{k: v for k, v in s.items() if k not in drop} for s in disk["regularization"]["steps"]] == \
        [{k: v for k, v in s.items() if k not in drop} for s in meta["regularization"]["steps"]]
    assert [(h["objective"], h.get("holdout_loss")) for h in disk["history"]] == \
        [(h["objective"], h.get("holdout_loss")) for h in meta["history"]]
    assert [r["data_cache"]["mode"] for r in disk["per_rank"]] == ["disk", "disk"]
    blocks = "shard blocks in memory (train.data_cache = disk)"
    est = disk["memory_estimate"]
    assert blocks in est["terms"] and "shard CSR" not in est["terms"]
    assert sum(est["categories"].values()) == est["needed_bytes"] == est["phase_totals"][est["peak_phase"]]
    for r in disk["per_rank"]:
        terms = r["memory"]["terms"]
        assert terms[blocks] == min(r["csr_bytes"], 28 << 20) and "shard CSR" not in terms
        assert not any("renumbered" in k or "non-zeros" in k for k in terms)
        assert "regularization path: best model and warm start (12 B x 2^bits)" in terms or \
            r["memory"]["breakdown_phase"] == "read"
    assert not list((tmp_path / "local").rglob("*.indices"))  # the cache went with the tasks


def test_a_rank_failing_inside_the_path_resumes_on_the_same_lambda(spark, data, clean, tmp_path):
    """A rank failing inside the path's second step resumes from its checkpoint on the same λ, here
    with its shard in the disk cache (read again by the new attempt): the clean in-memory run's bits."""
    _, meta = clean
    steps = meta["regularization"]["steps"]
    assert len(steps) >= 2
    fail_at = steps[0]["passes"] + 2  # the second pass of the path's second step
    cfg = load_config([], [*BASE, *_disk(tmp_path), "train.inject.fail_shard=1", f"train.inject.fail_pass={fail_at}",
                           "train.inject.fail_mode=raise"])
    hurt = run_train(spark, cfg, str(data / "tr"), str(tmp_path / "hurt"))
    assert len(hurt["attempts"]) == 2
    assert {r["resumed_from_pass"] for r in hurt["per_rank"]} == {fail_at}
    resumed_on = hurt["history"][fail_at]  # the first pass the second attempt ran
    assert resumed_on["path_step"] == 1 and resumed_on["l2"] == steps[1]["l2"]
    w_clean, b_clean, _ = load_model(str(clean[0]))
    w_hurt, b_hurt, _ = load_model(str(tmp_path / "hurt"))
    assert w_hurt.tobytes() == w_clean.tobytes() and b_hurt == b_clean
    drop = ("seconds",)
    assert [{k: v for k, v in s.items() if k not in drop} for s in hurt["regularization"]["steps"]] == \
        [{k: v for k, v in s.items() if k not in drop} for s in steps]


def test_a_rank_failing_right_after_a_steps_last_pass_resumes_every_later_step_bit_for_bit(spark, data, clean,
                                                                                               tmp_path):
    """The checkpoint of a step's last pass holds a finished step: the new attempt restores it
    without a pass (the rows, handed over, are renumbered in place by the restored phase) and
    starts the next step. That step must start as in the clean run (its first evaluation over
    the working table, not over the renumbered rows as if they held feature ids), so every later
    step has the clean run's passes and held-out loss, whichever step is chosen."""
    _, meta = clean
    steps = meta["regularization"]["steps"]
    assert len(steps) >= 3
    fail_at = steps[0]["passes"]  # the checkpoint of step 0's last pass
    cfg = load_config([], [*BASE, "train.inject.fail_shard=1", f"train.inject.fail_pass={fail_at}",
                           "train.inject.fail_mode=raise"])
    hurt = run_train(spark, cfg, str(data / "tr"), str(tmp_path / "hurt"))
    assert len(hurt["attempts"]) == 2 and {r["resumed_from_pass"] for r in hurt["per_rank"]} == {fail_at}
    drop = ("seconds",)
    assert [{k: v for k, v in s.items() if k not in drop} for s in hurt["regularization"]["steps"]] == \
        [{k: v for k, v in s.items() if k not in drop} for s in steps]
    w_clean, b_clean, _ = load_model(str(clean[0]))
    w_hurt, b_hurt, _ = load_model(str(tmp_path / "hurt"))
    assert w_hurt.tobytes() == w_clean.tobytes() and b_hurt == b_clean


def test_l1_auto_fits_an_l1_path_and_evaluate_uses_its_choice(spark, data, tmp_path):
    out = tmp_path / "m"
    cfg = load_config([], [*BASE, "train.l1=auto", "train.l2=1e-8"])
    meta = run_train(spark, cfg, str(data / "tr"), str(out))
    reg = meta["regularization"]
    assert reg["penalty"] == "l1" and meta["config"]["train"]["l1"] == "auto"
    steps = reg["steps"]
    rule = PATHS["l1"]  # the values in the order the rule gives them (here it turns: 1e-4 beats 2.7e-5)
    assert [s["l1"] for s in steps] == [rule.next_value(steps[:k]) for k in range(len(steps))]
    assert rule.over(steps) == reg["stop"] and rule.next_value(steps) is None
    holdouts = [s["holdout_loss"] for s in steps]
    assert reg["chosen_step"] == holdouts.index(min(holdouts)) and reg["value"] == steps[reg["chosen_step"]]["l1"]
    w, b, _ = load_model(str(out))
    # the model is the chosen step's, with its non-zero count; the path goes from sparse to dense
    assert np.count_nonzero(w) == steps[reg["chosen_step"]]["nonzeros"] == meta["weights"]["nonzeros"]
    by_l1 = sorted(steps, key=lambda s: -s["l1"])  # sparse to dense
    assert all(a["nonzeros"] <= b["nonzeros"] for a, b in zip(by_l1, by_l1[1:], strict=False))
    assert by_l1[0]["nonzeros"] < by_l1[-1]["nonzeros"] < w.size
    assert effective_penalty(meta, "l1") == reg["value"] and effective_l2(meta) == 1e-8
    text = train_summary(meta)
    assert f"l2 1e-08, l1 auto: {reg['value']:g}" in text and "l1 path" in text and " non-zero" in text
    metrics = evaluate(spark, str(data / "te"), str(out))
    assert f"+ {reg['value']:g} |beta|_1 + 1e-08/2 |beta|^2" in metrics["objective_definition"]
    assert metrics["nonzeros"] == np.count_nonzero(w)
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    page = open(build_report(str(out), str(tmp_path / "metrics.json"), str(tmp_path / "r"))).read()
    assert f"l1 auto: {reg['value']:g}" in page and "<th>non-zeros</th>" in page
    assert np.isfinite(b)


def test_a_downsampled_datasets_path_follows_the_rows_it_stands_for(spark, data, tmp_path):
    """Negatives kept at rate r and weighted 1/r stand for every row before downsampling: the
    path starts at 100 / those rows, as it would on every row (not at 100 / the kept rows)."""
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=0)
    m = run_featurize(spark, [str(data / "raw")], str(tmp_path / "s"), spec,
                      load_config([], ["featurize.partitions=2", "featurize.negative_rate=0.25"]).featurize)
    before = m["sampling"]["before"]["rows"]
    assert before == 6000 > m["rows"]
    meta = run_train(spark, load_config([], BASE + ["train.passes=3"]), str(tmp_path / "s"), str(tmp_path / "m"))
    reg = meta["regularization"]
    assert reg["rows"] == before and reg["steps"][0]["l2"] == pytest.approx(100 / before)
