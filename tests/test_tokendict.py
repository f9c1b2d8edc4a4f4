"""The token dictionary (``featurize.token_dictionary``) and ``terascale inspect``."""

from __future__ import annotations

import collections
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, ConfigError, load_config, render_yaml
from terascale.jobs.train_job import run_train
from terascale.pipeline import tokendict
from terascale.pipeline.generate import generate_clicklogs, token_weight
from terascale.pipeline.modeldir import ModelError
from terascale.pipeline.modelinspect import top_features
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec, criteo_tokens, hash_index

ROOT = Path(__file__).resolve().parents[1]


def _sample(spec, toks, k, m, chunk):
    s = tokendict.TokenSample(spec, k, m)
    for i in range(0, len(toks), chunk):
        s.add_tokens(toks[i:i + chunk])
    return s.table()


def test_the_sample_is_a_function_of_the_token_set_and_merges_exactly(monkeypatch):
    monkeypatch.setattr(tokendict, "REDUCE_MIN_ROWS", 1)  # reduce after (almost) every block
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=8, seed=3)
    rng = random.Random(1)
    toks = [f"C{rng.randint(1, 26)}={rng.getrandbits(32):08x}" for _ in range(3000)]
    toks += toks[:500]  # repeats change nothing
    full = _sample(spec, toks, 3, 40, 10_000)
    shuffled = toks[:]
    rng.shuffle(shuffled)
    assert _sample(spec, shuffled, 3, 40, 7).equals(full)  # any order, any block size
    # tasks each keep their own sample; merging them gives the sample of the union
    parts = [_sample(spec, shuffled[i::3], 3, 40, 100) for i in range(3)]
    assert tokendict.reduce(pa.concat_tables(parts), 3, 40).equals(full)
    b, t = full["bucket"].to_pylist(), full["token"].to_pylist()
    assert len(set(b)) == 40 and max(collections.Counter(b).values()) == 3  # both bounds hold
    assert all(hash_index(x, 8, 3) == y for x, y in zip(t, b, strict=True))  # a name hashes to its bucket
    distinct = sorted(set(toks))
    for y in set(b):  # the smallest tokens of each kept bucket
        assert [x for x, yy in zip(t, b, strict=True) if yy == y] == [x for x in distinct if hash_index(x, 8, 3) == y][:3]


def test_block_tokens_are_the_reference_tokens_of_the_good_lines(tmp_path):
    from terascale.pipeline.blocks import BlockParser

    generate_clicklogs(tmp_path, 800, files=1, seed=9, malformed_rate=0.05, processes=1)
    data = (tmp_path / "part-00000.tsv").read_bytes()
    spec = FeatureSpec(fields=CRITEO_FIELDS[:20], bits=30, seed=2, conjunctions=(("C6", "C7"), ("I2", "C3")))
    import numpy as np

    pb = BlockParser(spec, 65536).parse(np.frombuffer(data, np.uint8))
    assert (pb.status != 0).sum() > 10
    s = tokendict.TokenSample(spec, 64, 1 << 20)
    s.add_block(np.frombuffer(data, np.uint8), pb.status, pb.line_start, pb.line_len)
    got = set(s.table()["token"].to_pylist())
    want = set()
    for i in np.flatnonzero(pb.status == 0):
        fs = data[pb.line_start[i]:pb.line_start[i] + pb.line_len[i]].decode().split("\t")
        want |= set(criteo_tokens(dict(zip(CRITEO_FIELDS, fs[1:], strict=True)), spec.fields, "log_squared",
                                  spec.conjunctions))
    assert got == want and any("^" in t for t in got)


def test_config_checks_and_the_key_is_not_taken_for_a_secret():
    with pytest.raises(ConfigError, match="featurize.token_dictionary = true: needs featurize.format = 'criteo'"):
        load_config([], ["featurize.token_dictionary=true", "featurize.format=libsvm"])
    with pytest.raises(ConfigError, match=r"featurize.dictionary_per_bucket"):
        load_config([], ["featurize.dictionary_per_bucket=0"])
    text = render_yaml(load_config([], ["featurize.token_dictionary=true", "spark.conf={a.token: x}"]), with_help=False)
    assert "token_dictionary: true" in text and "x" not in text.split("conf:")[1].split("\n")[0]


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    generate_clicklogs(d / "raw", 10_000, files=2, seed=5, malformed_rate=0.01, processes=1)
    return d


def _fc(*sets):
    return load_config([], ["featurize.token_dictionary=true", *sets]).featurize


@pytest.mark.spark
def test_dictionary_does_not_depend_on_the_split(spark, data, tmp_path):
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=12, seed=1, conjunctions=(("C6", "C9"),))
    sets = ("featurize.dictionary_per_bucket=2", "featurize.dictionary_max_buckets=1000")
    m1 = run_featurize(spark, [str(data / "raw")], str(tmp_path / "a"), spec, _fc("featurize.partitions=1", *sets))
    m4 = run_featurize(spark, [str(data / "raw")], str(tmp_path / "b"), spec,
                       _fc("featurize.partitions=4", "featurize.block_mb=1", *sets))
    t1, t4 = (pq.read_table(tmp_path / x / "_tokens.parquet") for x in "ab")
    assert t1.equals(t4) and t1.num_rows == m1["dictionary"]["entries"] == m4["dictionary"]["entries"]
    assert m1["dictionary"] == {"path": "_tokens.parquet", "entries": t1.num_rows, "buckets": 1000,
                                "per_bucket": 2, "max_buckets": 1000}
    toks = t1["token"].to_pylist()
    assert all(hash_index(x, 12, 1) == b for x, b in zip(toks, t1["bucket"].to_pylist(), strict=True))


def _planted_heavy(raw: Path, n: int, min_count: int) -> list[str]:
    """The n tokens of largest |planted weight| among those on at least min_count lines."""
    cnt = collections.Counter()
    for f in sorted(raw.glob("*.tsv")):
        for line in f.read_bytes().split(b"\n"):
            fs = line.decode("utf-8", "replace").split("\t")
            if len(fs) == 40 and fs[0] in ("0", "1"):
                try:
                    cnt.update(criteo_tokens(dict(zip(CRITEO_FIELDS, fs[1:], strict=True)), CRITEO_FIELDS, "log_squared"))
                except ValueError:
                    continue
    return sorted((t for t, c in cnt.items() if c >= min_count), key=lambda t: -abs(token_weight(t)))[:n]


@pytest.mark.spark
def test_inspect_names_the_planted_heavy_tokens(spark, data, tmp_path):
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=0)
    run_featurize(spark, [str(data / "raw")], str(tmp_path / "ds"), spec, _fc())
    cfg = load_config([], ["train.workers=1", "train.holdout_period=0", "train.l2=1e-3", "spark.master=local[2]"])
    meta = run_train(spark, cfg, str(tmp_path / "ds"), str(tmp_path / "m"))
    assert meta["dictionary"]["path"] == "tokens.parquet" and (tmp_path / "m" / "tokens.parquet").exists()
    toks = pq.read_table(tmp_path / "m" / "tokens.parquet")["token"].to_pylist()
    assert any(x.startswith("I") for x in toks) and any(x.startswith("C26=") for x in toks)
    r = top_features(str(tmp_path / "m"), 50, names=True)
    named = {t for row in r["top"] for t in row["tokens"]}
    heavy = _planted_heavy(data / "raw", 10, 100)
    assert sum(t in named for t in heavy) >= 6, (heavy, named)
    for row in r["top"]:  # a named heavy feature's weight has its planted weight's sign
        if len(row["tokens"]) == 1 and row["tokens"][0] in heavy:
            assert (row["weight"] > 0) == (token_weight(row["tokens"][0]) > 0)

    # a model without a dictionary: buckets and weights, but asking for names fails clearly
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "m", bare)
    (bare / "tokens.parquet").unlink()
    md = json.loads((bare / "metadata.json").read_text())
    del md["dictionary"]
    (bare / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(ModelError, match="has no token dictionary"):
        top_features(str(bare), 5, names=True)
    cli = lambda *a: subprocess.run([sys.executable, "-m", "terascale.jobs.cli", "inspect", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120, cwd=ROOT)
    p = cli(str(bare), "--top", "5", "--names")
    assert p.returncode == 1 and "has no token dictionary" in p.stderr
    p = cli(str(bare), "--top", "5")
    assert p.returncode == 0 and "(no token dictionary: buckets only)" in p.stdout
    assert len(p.stdout.strip().splitlines()) == 3 + 5
    p = cli(str(tmp_path / "m"), "--top", "5", "--no-names")  # it has one: the user asked for buckets
    assert p.returncode == 0 and "(buckets only: --no-names)" in p.stdout and "no token dictionary" not in p.stdout
    p = cli(str(tmp_path / "m"), "--top", "3", "--json")
    assert [row["bucket"] for row in json.loads(p.stdout)["top"]] == [row["bucket"] for row in r["top"][:3]]
