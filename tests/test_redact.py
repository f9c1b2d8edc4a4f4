"""The redaction rule (pipeline.redact): which keys are secret, nested values, URIs."""

from __future__ import annotations

import json
import logging
import re

import pytest

from terascale.pipeline.redact import (
    SECRET,
    SPARK_DEFAULT_REDACTION_REGEX,
    SPARK_REDACTION_REGEX,
    RedactingFormatter,
    is_secret_key,
    redact,
    redact_text,
    spark_redaction_regex,
)

SECRET_KEYS = [
    "spark.hadoop.fs.s3a.access.key",
    "spark.hadoop.fs.s3a.secret.key",
    "spark.hadoop.fs.s3a.session.token",
    "spark.hadoop.fs.s3a.bucket.logs.secret.key",
    "spark.hadoop.fs.s3a.encryption.key",
    "spark.hadoop.fs.s3a.server-side-encryption.key",
    "spark.hadoop.fs.azure.account.key.myacct.dfs.core.windows.net",
    "spark.hadoop.fs.azure.account.oauth2.client.secret",
    "spark.hadoop.fs.azure.sas.container.myacct.blob.core.windows.net",
    "spark.hadoop.fs.azure.sas.fixed.token",
    "spark.hadoop.fs.gs.auth.service.account.private.key",
    "spark.hadoop.fs.gs.auth.client.secret",
    "spark.hadoop.fs.gs.auth.refresh.token",
    "spark.hadoop.fs.gs.encryption.key",
    "spark.hadoop.hadoop.http.authentication.signature.secret",
    "spark.hadoop.fs.s3a.proxy.password",
    "spark.hadoop.hadoop.security.group.mapping.ldap.bind.password",
    "spark.hadoop.ssl.client.truststore.password",
    "spark.hadoop.fs.cosn.userinfo.secretKey",
    "spark.hadoop.fs.oss.accessKeySecret",
    "spark.hadoop.fs.swift.service.rack.apikey",
    "spark.ssl.keyStorePassword",
    "spark.ssl.keyPassword",
    "spark.authenticate.secret",
    "spark.executorEnv.AWS_SECRET_ACCESS_KEY",
    "spark.executorEnv.AWS_ACCESS_KEY_ID",
    "spark.yarn.appMasterEnv.GITHUB_TOKEN",
    "spark.executorEnv.HADOOP_CREDSTORE_PASSWORD",  # the keystore behind credential.provider.path
    "service.apikey",
    "service.api_key",
    "service.apiKey",
    "db.passwd",
    "db.credentials",
    "X-Amz-Credential",
    "sig",
]

SECRET_KEYS += ["spark.executorEnv.DB_PASS", "spark.executorEnv.GITHUB_PAT", "spark.mycompany.auth",
                "spark.executorEnv.API_JWT", "spark.hadoop.http.bearer"]

PLAIN_KEYS = [
    "spark.sql.shuffle.partitions",
    "featurize.seed",
    "featurize.bits",
    "key",
    "join.key",
    "partition.keys",
    "predict.keep_columns",
    "spark.hadoop.hadoop.security.credential.provider.path",
    "spark.hadoop.fs.s3a.aws.credentials.provider",
    "spark.hadoop.fs.azure.sas.token.provider.type",
    "spark.hadoop.fs.azure.account.oauth2.client.id",
    "spark.hadoop.fs.gs.auth.service.account.json.keyfile",
    "spark.hadoop.hadoop.security.credstore.java-keystore-provider.password-file",
    "spark.hadoop.dfs.encryption.key.provider.uri",
    "spark.authenticate.secret.file",
    "spark.io.encryption.keySizeBits",
    "spark.ssl.keyStore",
    "spark.kerberos.keytab",
    "spark.executor.memory",
    "spark.hadoop.fs.s3a.proxy.username",
    "spark.hadoop.hadoop.security.group.mapping.ldap.bind.password.file",
    "train.checkpoint_dir",
    "train.online_passes",
    "spark.hadoop.fs.s3a.path.style.access",
    "spark.authenticate",
    "allreduce.handshake_timeout_s",
]


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", PLAIN_KEYS)
def test_keys_that_are_not_secret(key):
    assert not is_secret_key(key)


def test_every_schema_key_is_shown():
    from terascale.jobs.config import all_keys

    assert [k for k in all_keys() if is_secret_key(k)] == []


def test_nested_mappings_and_lists():
    doc = {
        "spark": {"conf": {"spark.hadoop.fs.s3a.secret.key": "S3CR3T", "spark.executor.memory": "4g"}},
        "access": {"key": "AKIA1", "region": "eu"},  # judged by its dotted path: access.key
        "password": {"nested": ["a", "b"]},  # the whole value under a secret key
        "runs": [{"token": 7, "pass": 1}, ("x", {"client_secret": None})],
        "featurize": {"seed": 3, "key": "C1"},
    }
    assert redact(doc) == {
        "spark": {"conf": {"spark.hadoop.fs.s3a.secret.key": SECRET, "spark.executor.memory": "4g"}},
        "access": {"key": SECRET, "region": "eu"},
        "password": SECRET,
        "runs": [{"token": SECRET, "pass": 1}, ("x", {"client_secret": SECRET})],
        "featurize": {"seed": 3, "key": "C1"},
    }
    assert doc["spark"]["conf"]["spark.hadoop.fs.s3a.secret.key"] == "S3CR3T"  # a copy: the input is unchanged


@pytest.mark.parametrize("text, want", [
    ("s3a://AKIAX:wJalr/K7+MDENG@bucket/data/day=1", "s3a://***@bucket/data/day=1"),
    ("s3://AKIAX:SECRET@bucket/", "s3://***@bucket/"),
    ("https://user:pa55@host:8443/x?a=1", "https://***@host:8443/x?a=1"),
    ("https://ghp_T0KEN@github.com/org/repo.git", "https://***@github.com/org/repo.git"),
    ("model s3a://A:B@b/m1 and hdfs://alice@nn:8020/m2, done", "model s3a://***@b/m1 and hdfs://***@nn:8020/m2, done"),
    ("['s3a://A:B@b/x', 's3a://C:D@e/y']", "['s3a://***@b/x', 's3a://***@e/y']"),
    ("https://acct.blob.core.windows.net/c/f?sv=2022&sig=AbC%2F&se=1", "https://acct.blob.core.windows.net/c/f?sv=2022&sig=***&se=1"),
    ("https://h/x?X-Amz-Credential=AK%2F1&X-Amz-Signature=ff&n=2", "https://h/x?X-Amz-Credential=***&X-Amz-Signature=***&n=2"),
    # unchanged: no credentials
    ("hdfs://nn:8020/dir/a@b.txt", "hdfs://nn:8020/dir/a@b.txt"),
    ("s3a://bucket/dir/user@example.com/x", "s3a://bucket/dir/user@example.com/x"),
    ("file:///tmp/x", "file:///tmp/x"),
    ("/local/path:with@odd", "/local/path:with@odd"),
    ("jceks://hdfs@nn:8020/user/a/aws.jceks", "jceks://hdfs@nn:8020/user/a/aws.jceks"),  # names the keystore's filesystem
    ("no uri here: password=1", "no uri here: password=1"),
])
def test_uri_credentials(text, want):
    assert redact_text(text) == want
    assert redact({"dataset": text}) == {"dataset": want}


def test_formatter_redacts_messages_arguments_and_tracebacks():
    fmt = RedactingFormatter("%(message)s")
    try:
        raise OSError("cannot open s3a://AK:SK@bucket/x")
    except OSError:
        rec = logging.LogRecord("terascale", logging.ERROR, __file__, 1, "reading %s", ("https://u:p@h/y",),
                                exc_info=__import__("sys").exc_info())
    out = fmt.format(rec)
    assert "reading https://***@h/y" in out and "s3a://***@bucket/x" in out
    assert "AK:SK" not in out and "u:p@" not in out


def test_spark_regex_covers_the_rule_and_extends_the_current_value():
    assert spark_redaction_regex(None) == f"(?:{SPARK_DEFAULT_REDACTION_REGEX})|(?:{SPARK_REDACTION_REGEX})"
    assert spark_redaction_regex("(?i)mine") == f"(?:(?i)mine)|(?:{SPARK_REDACTION_REGEX})"
    once = spark_redaction_regex(None)
    assert spark_redaction_regex(once) == once  # idempotent
    # Python's re and Java's regex agree on this syntax; Spark searches the key (find)
    rx = re.compile(once.replace("(?:(?i)", "(?:").replace("(?i)", ""), re.I)
    for k in SECRET_KEYS:
        assert rx.search(k), k
    for k in ("spark.sql.shuffle.partitions", "featurize.seed", "spark.executor.memory", "spark.ssl.keyStore"):
        assert not rx.search(k), k


def test_spark_settings_extend_what_the_session_has():
    from terascale.pipeline.redact import SPARK_STRING_REDACTION_REGEX, spark_redaction_settings

    assert spark_redaction_settings({}.get) == {"spark.redaction.regex": spark_redaction_regex(None),
                                                "spark.redaction.string.regex": SPARK_STRING_REDACTION_REGEX}
    mine = {"spark.redaction.regex": "(?i)mine", "spark.redaction.string.regex": "corp-[0-9]+"}
    got = spark_redaction_settings(mine.get)
    assert got["spark.redaction.string.regex"] == f"(?:corp-[0-9]+)|(?:{SPARK_STRING_REDACTION_REGEX})"
    assert spark_redaction_settings(got.get) == got  # idempotent
    plan = "FileScan parquet [label] Location: InMemoryFileIndex[s3a://AK:wJ/x+y@bucket/d, s3a://bucket/e]"
    assert re.sub(SPARK_STRING_REDACTION_REGEX, "*", plan) == (
        "FileScan parquet [label] Location: InMemoryFileIndex[s3a://*@bucket/d, s3a://bucket/e]")


def test_config_rendering_and_errors_hide_secrets(tmp_path):
    from terascale.jobs.config import ConfigError, load_config, render_yaml, to_dict

    cfg = load_config([], ['spark.conf={spark.hadoop.fs.s3a.secret.key: S3CR3T, spark.executor.memory: 2g}',
                           "train.init_model=s3a://AK:SK@bucket/model"])
    assert dict(cfg.spark.conf)["spark.hadoop.fs.s3a.secret.key"] == "S3CR3T"  # Spark gets the real value
    d = to_dict(cfg)
    assert d["spark"]["conf"] == {"spark.executor.memory": "2g", "spark.hadoop.fs.s3a.secret.key": SECRET}
    assert d["train"]["init_model"] == "s3a://***@bucket/model"
    text = render_yaml(cfg, with_help=False)
    assert "spark.hadoop.fs.s3a.secret.key: '***'" in text and "S3CR3T" not in text and "AK:SK" not in text
    assert "S3CR3T" not in json.dumps(d)
    # PyYAML quotes the offending line in its errors: terascale names the line, not its text
    bad = tmp_path / "bad.yaml"
    bad.write_text("spark:\n  conf:\n    spark.hadoop.fs.s3a.secret.key: 'S3CR3T\n")
    with pytest.raises(ConfigError) as e:
        load_config([bad])
    assert "S3CR3T" not in str(e.value) and "line" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config([], ["spark.conf={spark.hadoop.fs.s3a.secret.key: 'S3CR3T}"])
    assert "S3CR3T" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config([], ["spark.conf=[S3CR3T]"])
    assert "S3CR3T" not in str(e.value)


def test_publish_refuses_a_model_path_with_credentials(tmp_path):
    """A pointer must resolve and must not store credentials: refused before any filesystem is
    touched (no connection to the URI's host is attempted)."""
    from terascale.pipeline.pointer import PointerError, publish

    pointer = tmp_path / "current"
    with pytest.raises(PointerError) as e:
        publish("s3a://AKIAX:S3CR3T@bucket/models/m1", str(pointer))
    assert str(e.value).startswith("refusing to publish s3a://***@bucket/models/m1: the path carries credentials")
    assert "S3CR3T" not in str(e.value) and not pointer.exists()


def test_json_files_are_written_redacted(tmp_path):
    from terascale.pipeline import fsutil

    path = str(tmp_path / "m.json")
    fsutil.write_json_atomic(path, {"dataset": "s3a://AK:SK@b/d", "conf": {"fs.s3a.secret.key": "SK"}, "rows": 3})
    assert json.loads((tmp_path / "m.json").read_text()) == {
        "dataset": "s3a://***@b/d", "conf": {"fs.s3a.secret.key": SECRET}, "rows": 3}
