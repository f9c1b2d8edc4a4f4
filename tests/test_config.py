"""The configuration schema: defaults file in sync, overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from terascale.jobs.config import Config, ConfigError, all_keys, load_config, render_yaml

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_yaml_is_rendered_from_the_schema():
    assert (ROOT / "conf" / "defaults.yaml").read_text() == render_yaml(), (
        "conf/defaults.yaml is out of date: run `terascale config --defaults > conf/defaults.yaml`"
    )


def test_defaults_yaml_loads_back_to_the_defaults():
    assert load_config([ROOT / "conf" / "defaults.yaml"]) == Config()


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_conf_file_is_valid(path):
    load_config([path])


def test_precedence_defaults_then_files_then_sets(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("featurize:\n  bits: 20\n  seed: 5\n")
    b = tmp_path / "b.yaml"
    b.write_text("featurize:\n  bits: 21\n")
    cfg = load_config([a, b], ["featurize.seed=9"])
    assert (cfg.featurize.bits, cfg.featurize.seed, cfg.featurize.format) == (21, 9, "criteo")


def test_set_parses_by_type():
    cfg = load_config([], [
        "featurize.conjunctions=[[C1, C2], [I3, C4]]",
        "allreduce.io_timeout_s=1e-1",
        "spark.master=local[2]",
        "spark.conf={spark.executor.memory: 2g}",
        "train.inject.slow_factor=5",
    ])
    assert cfg.featurize.conjunctions == (("C1", "C2"), ("I3", "C4"))
    assert cfg.allreduce.io_timeout_s == 0.1
    assert cfg.spark.master == "local[2]"
    assert dict(cfg.spark.conf) == {"spark.executor.memory": "2g"}
    assert cfg.train.inject.slow_factor == 5.0


@pytest.mark.parametrize(
    "sets, message",
    [
        (["featurize.bit=3"], "unknown configuration key 'featurize.bit' (did you mean 'featurize.bits'?)"),
        (["featurize.bits=40"], "featurize.bits = 40: must be an integer in [1, 30]"),
        (["featurize.bits=abc"], "featurize.bits = 'abc': must be an integer"),
        (["featurize.format=csv"], "featurize.format = 'csv': must be one of 'criteo', 'libsvm'"),
        (["train.solver=sgd"], "train.solver = 'sgd': must be one of the registered solvers 'hybrid', 'online', 'lbfgs', 'cocoa'"),
        (["train.solver=cocoa", "train.l2=0"], "train.l2 = 0.0: must be > 0 with train.solver = 'cocoa'"),
        (["featurize.conjunctions=[[C1, X9]]"], "field 'X9' is not in featurize.fields"),
        (["featurize.conjunctions=[C1]"], "featurize.conjunctions[0] = 'C1': must be a pair of field names"),
        (["featurize.fields=[I1, I1]"], "featurize.fields = ('I1', 'I1'): must be distinct names"),
        (["allreduce.io_timeout_s=0"], "allreduce.io_timeout_s = 0.0: must be a finite number in (0, 86400]"),
        (["train.inject.fail_mode=boom"], "train.inject.fail_mode = 'boom': must be one of 'raise', 'kill'"),
        (["train.inject.slow_shard=5"], "train.inject.slow_shard = 5: must be -1 or a shard in [0, 1]"),
        (["train.partition=deal"], "train.partition = 'deal': must be one of 'fixed', 'redeal'"),
        (["train.solver=cocoa", "train.formulation=primal"],
         "train.formulation = 'primal': needs train.loss = 'squared' (got 'logistic')"),
        (["train.solver=cocoa", "train.loss=squared", "train.formulation=primal", "train.partition=redeal"],
         "train.partition = 'redeal': needs train.formulation = 'dual' (got 'primal')"),
        (["train.solver=cocoa", "train.partition=redeal", "train.device=gpu"],
         "train.partition = 'redeal' runs on the CPU only"),
        (["featurize"], "must look like section.key=value"),
        (["featurize=3"], "'featurize' is a section"),
    ],
)
def test_errors_name_key_value_and_what_is_allowed(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config([], sets)
    assert message in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("featurize:\n  bitz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown configuration key 'featurize.bitz' \(did you mean 'featurize.bits'\?\)"):
        load_config([bad])
    bad.write_text("featurize: [1, 2]\n")
    with pytest.raises(ConfigError, match="'featurize' is a section and must be a mapping"):
        load_config([bad])
    bad.write_text("featurize:\n  bits: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([bad])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config([tmp_path / "missing.yaml"])


def test_train_keys_mirror_the_solver_parameters():
    import dataclasses

    from terascale.jobs.config import solver_params
    from terascale.solvers.params import SolverParams

    cfg = load_config([], ["train.l2=0.5", "train.solver=lbfgs", "train.shuffle=true"])
    assert solver_params(cfg.train) == SolverParams(l2=0.5, solver="lbfgs", shuffle=True)
    assert solver_params(Config().train) == SolverParams()  # the defaults are the solvers' own
    assert {f.name for f in dataclasses.fields(SolverParams)} <= {k.split(".")[1] for k in all_keys() if k.startswith("train.")}


def test_every_parameter_has_help_text():
    from terascale.jobs.config import iter_params

    for key, f in iter_params():
        assert f.metadata.get("help"), key
    assert "featurize.bits" in all_keys() and "train.inject.fail_mode" in all_keys()


def test_l2_takes_auto_or_a_number_from_files_and_sets(tmp_path):
    assert Config().train.l2 == "auto"
    conf = tmp_path / "c.yaml"
    for text, want in (("auto", "auto"), ("AUTO", "auto"), ("1.0e-6", 1e-6), ("1e-6", 1e-6), ("0", 0.0)):
        conf.write_text(f"train: {{l2: {text}}}\n")
        assert load_config([conf]).train.l2 == want  # YAML 1.1 reads 1e-6 as a string: accepted as a number
        assert load_config([], [f"train.l2={text}"]).train.l2 == want
    conf.write_text("train: {l2: [1]}\n")
    with pytest.raises(ConfigError, match=r"train.l2 = \[1\]: must be 'auto' or a finite number in \[0, inf\)"):
        load_config([conf])
    with pytest.raises(ConfigError, match=r"train.l2 = 'auto': chooses l2 by the held-out loss, which needs held-out "
                                          r"rows: set train.holdout_period to N > 1 .*got 0\), or set train.l2 to a number"):
        load_config([], ["train.holdout_period=0"])
    assert load_config([], ["train.holdout_period=0", "train.l2=1e-6"]).train.l2 == 1e-6
    with pytest.raises(ConfigError, match=r"train.l2 = 'auto': must be a number with train.solver = 'cocoa'"):
        load_config([], ["train.solver=cocoa"])


def test_the_allreduce_window_takes_auto_or_a_whole_number(tmp_path):
    from terascale.allreduce.spark import NetConf

    assert Config().allreduce.window_chunks == "auto"
    conf = tmp_path / "c.yaml"
    for text, want, net in (("auto", "auto", None), ("4", 4, 4), ("0", 0, 0)):
        conf.write_text(f"allreduce: {{window_chunks: {text}}}\n")
        for cfg in (load_config([conf]), load_config([], [f"allreduce.window_chunks={text}"])):
            assert cfg.allreduce.window_chunks == want and NetConf.from_conf(cfg.allreduce).window_chunks == net
    for bad in ("-1", "2.5", "many"):
        with pytest.raises(ConfigError, match=r"allreduce.window_chunks = .*: must be 'auto' or an integer in \[0, 1048576\]"):
            load_config([], [f"allreduce.window_chunks={bad}"])


def test_l1_takes_auto_with_l2_a_number(tmp_path):
    assert Config().train.l1 == 0.0
    conf = tmp_path / "c.yaml"
    conf.write_text("train: {l1: auto, l2: 0}\n")
    assert (load_config([conf]).train.l1, load_config([conf]).train.l2) == ("auto", 0.0)
    assert load_config([], ["train.l1=auto", "train.l2=1e-8"]).train.l1 == "auto"
    assert load_config([], ["train.l1=3e-6"]).train.l1 == 3e-6
    # l2 is auto by default: the error names both keys and what to do
    with pytest.raises(ConfigError, match=r"train.l2 = 'auto' and train.l1 = 'auto': a run fits one regularization "
                                          r"path, over one penalty; set the other to a number \(train.l2 is auto by "
                                          r"default: for an L1 path set e.g. train.l2=1e-8, or train.l2=0"):
        load_config([], ["train.l1=auto"])
    with pytest.raises(ConfigError, match=r"train.l1 = 'auto': chooses l1 by the held-out loss, which needs held-out "
                                          r"rows: .*or set train.l1 to a number"):
        load_config([], ["train.l1=auto", "train.l2=0", "train.holdout_period=0"])
    with pytest.raises(ConfigError, match=r"train.l1 = -1.0: must be 'auto' or a finite number in \[0, inf\)"):
        load_config([], ["train.l1=-1"])
