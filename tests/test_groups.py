"""The group map (which field produced each hashed bucket) against a slow, obvious reference.

The reference hashes every token of every valid line with ``pipeline.spec`` and keeps the
smallest group per bucket; the kernels, the per-task maps and the executors' merge must all
agree with it, whatever the split of the input into blocks and tasks.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.pipeline.blocks import BlockParser
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.groups import (
    GROUPS_FILE,
    MAX_GROUPS,
    NO_GROUP,
    group_names,
    load_map,
    read_groups,
    token_groups,
    write_map,
)
from terascale.pipeline.manifest import DatasetError, read_manifest
from terascale.pipeline.spec import FeatureSpec, criteo_tokens, hash_index, int_token

MAX_LINE = 65536
INT_RE = re.compile(r"[+-]?[0-9]{1,18}")
# integer fields first (few distinct tokens each), so that at small bits the later fields still
# own buckets and the map holds many different groups
ORDER = tuple(f"I{k}" for k in range(13, 0, -1)) + tuple(f"C{k}" for k in (2, 5, 9, 6, 14, 23, 1, 3, 17, 20))
CONJ = (("C6", "C9"), ("I2", "C14"), ("C2", "C5"))


# ------------------------------------------------------------------------------------------
# the reference


def valid_record(raw: bytes, max_line: int = MAX_LINE) -> dict | None:
    """{field: text} of a good Criteo line, None for a line the featurizer must quarantine."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if not raw or len(raw) > max_line:
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    f = line.split("\t")
    if len(f) != 40 or f[0] not in ("0", "1"):
        return None
    if any(v and not INT_RE.fullmatch(v) for v in f[1:14]):
        return None
    return dict(zip(CRITEO_FIELDS, f[1:], strict=True))


def reference_map(data: bytes, spec: FeatureSpec) -> np.ndarray:
    """Min group per bucket over every token of every valid line, token by token."""
    names = group_names(spec)
    ref = np.full(1 << spec.bits, NO_GROUP, np.uint8)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for raw in lines:
        if spec.format == "libsvm":
            idx = libsvm_indices(raw, spec)
            for i in idx or ():
                ref[i] = 0
            continue
        rec = valid_record(raw)
        if rec is None:
            continue
        tokens = criteo_tokens(rec, spec.fields, spec.int_bucketing, spec.conjunctions)
        present = {f for f in spec.fields if rec[f] != ""}
        # the token list is: present fields in spec order, then conjunctions of present fields
        groups = [g for g, f in enumerate(spec.fields) if f in present]
        groups += [len(spec.fields) + j for j, (a, b) in enumerate(spec.conjunctions) if a in present and b in present]
        assert len(groups) == len(tokens)
        for tok, g in zip(tokens, groups, strict=True):
            if g < len(spec.fields):
                assert names[g] == tok.split("=", 1)[0]
            g = min(g, MAX_GROUPS - 1)  # past 255 names the rest is 'other'
            i = hash_index(tok, spec.bits, spec.seed)
            ref[i] = min(ref[i], g)
    return ref


def libsvm_indices(raw: bytes, spec: FeatureSpec) -> list[int] | None:
    """Indices of a good LibSVM line (0-based), None for a bad one (the test lines are simple)."""
    parts = raw.decode().split()
    if not parts or parts[0] not in ("1", "+1", "0", "-1"):
        return None
    out = []
    for p in parts[1:]:
        i, _, v = p.partition(":")
        if not i.isdigit() or not re.fullmatch(r"-?[0-9.]+", v):
            return None
        k = int(i) - spec.libsvm_index_base
        if not 0 <= k < 1 << spec.bits:
            return None
        out.append(k)
    return out


def kernel_map(data: bytes, spec: FeatureSpec, pieces: int = 1) -> np.ndarray:
    """The map one BlockParser builds over ``data`` cut into ``pieces`` blocks at line starts."""
    g = np.full(1 << spec.bits, NO_GROUP, np.uint8)
    parser = BlockParser(spec, MAX_LINE, groups=g)
    cuts = [0]
    for k in range(1, pieces):
        nl = data.find(b"\n", len(data) * k // pieces)
        cuts.append(len(data) if nl < 0 else nl + 1)
    cuts.append(len(data))
    for a, b in itertools.pairwise(cuts):
        if b > a:
            parser.parse(np.frombuffer(data[a:b], dtype=np.uint8))
    return g


def criteo_line(label="1", ints=None, cats=None) -> str:
    ints = ints if ints is not None else [""] * 13
    cats = cats if cats is not None else [""] * 26
    return "\t".join([label, *ints, *cats])


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("groups-raw")
    s = generate_clicklogs(d, 4000, files=2, seed=11, malformed_rate=0.04, processes=1)
    assert s["malformed_total"] > 0
    return d


@pytest.fixture(scope="module")
def log_bytes(logs):
    return b"".join(p.read_bytes() for p in sorted(logs.glob("*.tsv")))


# ------------------------------------------------------------------------------------------
# names and group numbers


def test_group_names_and_token_groups():
    spec = FeatureSpec(fields=("C3", "I1", "C1"), conjunctions=(("C1", "C3"), ("I1", "C1")))
    assert group_names(spec) == ["C3", "I1", "C1", "C1^C3", "I1^C1"]
    sel, conj = token_groups(spec)
    assert sel.dtype == conj.dtype == np.uint8
    assert sel.tolist() == [0, 1, 2] and conj.tolist() == [3, 4]

    pairs = tuple(itertools.combinations(CRITEO_FIELDS, 2))[:250]
    big = FeatureSpec(fields=CRITEO_FIELDS, conjunctions=pairs)  # 39 + 250 names
    names = group_names(big)
    assert len(names) == MAX_GROUPS == 255
    assert names[:39] == list(CRITEO_FIELDS) and names[39] == "I1^I2" and names[253] == "{}^{}".format(*pairs[214])
    assert names[254] == "other"
    sel, conj = token_groups(big)
    assert sel.tolist() == list(range(39))
    assert conj.tolist() == list(range(39, 254)) + [254] * (250 - 215)

    exact = FeatureSpec(fields=CRITEO_FIELDS, conjunctions=pairs[:216])  # 255 names: no 'other'
    assert len(group_names(exact)) == 255 and group_names(exact)[-1] == "{}^{}".format(*pairs[215])
    assert group_names(FeatureSpec(format="libsvm", bits=8)) == ["features"]


# ------------------------------------------------------------------------------------------
# the kernels against the reference


@pytest.mark.parametrize(
    "spec",
    [
        FeatureSpec(fields=ORDER, bits=10, seed=5, conjunctions=CONJ),  # every bucket is shared
        FeatureSpec(fields=ORDER, bits=16, seed=1, conjunctions=CONJ, int_bucketing="identity"),
        # 39 fields + 40 conjunctions: rows longer than the ranking sort's 64 entries
        FeatureSpec(fields=CRITEO_FIELDS, bits=12, seed=2, conjunctions=tuple(itertools.combinations(ORDER[13:], 2))[:40]),
        # 39 + 250 groups: conjunctions from the 216th on share the group 'other'
        FeatureSpec(fields=CRITEO_FIELDS, bits=13, seed=3,
                    conjunctions=tuple(itertools.combinations(CRITEO_FIELDS[::-1], 2))[:250]),
    ],
    ids=["bits10", "bits16", "long-rows", "other"],
)
def test_criteo_map_equals_the_reference(log_bytes, spec):
    ref = reference_map(log_bytes, spec)
    got = kernel_map(log_bytes, spec)
    np.testing.assert_array_equal(got, ref)
    # the data is discriminating: many groups own buckets (and first-come or max would differ)
    assert np.unique(ref[ref != NO_GROUP]).size >= 8
    # blocks are independent: any cut at line starts gives the same map
    np.testing.assert_array_equal(kernel_map(log_bytes, spec, pieces=7), ref)
    if spec.bits >= 16:
        assert (ref == NO_GROUP).any()
    if len(spec.conjunctions) > MAX_GROUPS:
        assert (ref == MAX_GROUPS - 1).any()


group_int = st.one_of(st.just(""), st.integers(-3, 70000).map(str), st.integers(-(10**12), 10**12).map(str))
group_cat = st.one_of(st.just(""), st.sampled_from(["a", "b", "a^b", "=", "日本"]),
                      st.text(alphabet="abcxyz^=é", max_size=4))
group_lines = st.builds(criteo_line, st.sampled_from(["0", "1", "2"]), st.lists(group_int, min_size=13, max_size=13),
                        st.lists(group_cat, min_size=26, max_size=26))
group_specs = st.builds(
    FeatureSpec,
    bits=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    fields=st.permutations(CRITEO_FIELDS).map(lambda p: tuple(p[:12])),
    int_bucketing=st.sampled_from(["log_squared", "identity"]),
).flatmap(lambda s: st.lists(st.tuples(st.sampled_from(s.fields), st.sampled_from(s.fields)), max_size=5)
          .map(lambda c: replace(s, conjunctions=tuple(c))))


@settings(max_examples=150, deadline=None)
@given(st.lists(group_lines, min_size=1, max_size=12), group_specs)
@example([criteo_line("1", ["1"] * 13, ["v"] * 26)] * 2,  # 2 buckets: every field collides
         FeatureSpec(fields=CRITEO_FIELDS[::-1], bits=1, conjunctions=(("C1", "I1"), ("C1", "C1"))))
@example([criteo_line("1", ["1"] * 13, ["v"] * 26)], FeatureSpec(fields=("C26", "C25"), bits=3))  # empty buckets
def test_criteo_map_property(text_lines, spec):
    blob = ("\n".join(text_lines) + "\n").encode()
    np.testing.assert_array_equal(kernel_map(blob, spec), reference_map(blob, spec))


def test_quarantined_lines_contribute_nothing():
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=20, seed=9, conjunctions=(("C1", "C2"),))
    good = criteo_line("1", ["5"] + [""] * 12, ["g1", "g2"] + [""] * 24)
    bad = [
        criteo_line("1", ["x"] + [""] * 12, ["bad1", "bad2"] + [""] * 24),  # bad_integer
        criteo_line("2", ["7"] + [""] * 12, ["bad3", "bad4"] + [""] * 24),  # bad_label
        criteo_line("1", ["7"] + [""] * 12, ["bad5", "bad6"] + [""] * 23),  # wrong_field_count
        criteo_line("1", ["7"] + [""] * 12, ["bad7", "b\udcffd"] + [""] * 24),  # invalid_utf8 (0xff)
    ]
    blob = "\n".join([good, *bad[:3], good]).encode() + b"\n" + bad[3].encode("utf-8", "surrogateescape") + b"\n"
    pb = BlockParser(spec, MAX_LINE).parse(np.frombuffer(blob, np.uint8))
    assert pb.status.tolist() == [0, 6, 5, 4, 0, 3]  # ok, bad_integer, bad_label, wrong_field_count, ok, invalid_utf8
    got = kernel_map(blob, spec)
    expect = np.full(1 << spec.bits, NO_GROUP, np.uint8)
    for tok, g in ((int_token("I1", 5), 0), ("C1=g1", 13), ("C2=g2", 14), ("C1=g1^C2=g2", 39)):
        i = hash_index(tok, spec.bits, spec.seed)
        expect[i] = min(expect[i], g)
    np.testing.assert_array_equal(got, expect)
    bad_tokens = ["C1=bad1", "C2=bad2", int_token("I1", 7), "C1=bad3", "C1=bad5", "C1=bad7", "C1=bad1^C2=bad2"]
    assert all(got[hash_index(t, spec.bits, spec.seed)] == NO_GROUP for t in bad_tokens)


def test_libsvm_map_marks_the_buckets_of_good_rows_only():
    spec = FeatureSpec(format="libsvm", bits=5)
    text = b"+1 3:1 1:0.5\n-1 2:1\n1 30:1 9999:1\nbad line\n0 4:1 4:1\n1 7:1 8:x\n1 12:1\n"
    got = kernel_map(text, spec)
    expect = np.full(32, NO_GROUP, np.uint8)
    expect[[0, 1, 2, 3, 11]] = 0  # 29 (index_out_of_range row), 6 and 7 (unparsable row) stay empty
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(reference_map(text, spec), expect)
    np.testing.assert_array_equal(kernel_map(text, spec, pieces=3), expect)


def test_parser_refuses_a_map_of_the_wrong_shape():
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=8)
    for bad in (np.full(128, 255, np.uint8), np.full(256, 255, np.int16), np.full(256, 255, np.uint8)[::-1]):
        with pytest.raises(ValueError, match="2\\^bits = 256"):
            BlockParser(spec, MAX_LINE, groups=bad)


# ------------------------------------------------------------------------------------------
# the file


def _manifest(bits: int, groups: dict | None) -> dict:
    return {"spec": {"bits": bits}, "groups": groups}


def test_read_groups_validates_the_file(tmp_path):
    entry = {"path": GROUPS_FILE, "names": ["features"], "buckets": 2}
    m = np.full(16, NO_GROUP, np.uint8)
    m[[3, 9]] = 0
    write_map(str(tmp_path / GROUPS_FILE), m)
    np.testing.assert_array_equal(read_groups(str(tmp_path), _manifest(4, entry)), m)
    assert not list(tmp_path.glob("*.tmp-*"))

    assert read_groups(str(tmp_path), _manifest(4, None)) is None  # bits > 26, or no map
    assert read_groups(str(tmp_path), {"spec": {"bits": 4}}) is None  # a manifest from before maps

    path = tmp_path / GROUPS_FILE
    full = path.read_bytes()
    cases = {
        "truncated": (full[:-3], r"truncated \(13 of 16 data bytes\)"),
        "trailing": (full + b"\0", "bytes after its 16 entries"),
        "not npy": (b"hello world, not an array", "not a readable .npy file"),
        "header only": (full[:8], "not a readable .npy file"),
    }
    for blob, msg in cases.values():
        path.write_bytes(blob)
        with pytest.raises(DatasetError, match=re.escape(str(path)) + ".*" + msg):
            read_groups(str(tmp_path), _manifest(4, entry))

    np.save(path, np.zeros(16, np.int16))
    with pytest.raises(DatasetError, match=re.escape(str(path)) + ".*dtype int16, want uint8"):
        read_groups(str(tmp_path), _manifest(4, entry))
    np.save(path, np.zeros((4, 4), np.uint8))
    with pytest.raises(DatasetError, match=re.escape(str(path)) + r".*shape \(4, 4\), want a 1-D array"):
        read_groups(str(tmp_path), _manifest(4, entry))
    np.save(path, np.zeros(32, np.uint8))
    with pytest.raises(DatasetError, match=re.escape(str(path)) + r".*32 entries, want 2\^bits = 16"):
        read_groups(str(tmp_path), _manifest(4, entry))
    path.unlink()
    with pytest.raises(DatasetError, match=re.escape(str(path)) + ".*missing"):
        read_groups(str(tmp_path), _manifest(4, entry))

    # the maps the tasks write are what the merge reads: writable (merged in place)
    write_map(str(tmp_path / "t.npy"), m)
    a = load_map(str(tmp_path / "t.npy"), 16)
    assert a.flags.writeable
    with pytest.raises(ValueError, match="1-D uint8"):
        write_map(str(tmp_path / "u.npy"), m.astype(np.int8))


# ------------------------------------------------------------------------------------------
# the Spark job: per-task maps merged (on the driver, or on the executors), committed before the manifest


def _fconf(*sets):
    return load_config([], list(sets)).featurize


@pytest.mark.spark
@pytest.mark.parametrize("where", ["driver", "executors"])
def test_featurize_map_equals_the_reference_for_any_split(spark, logs, log_bytes, tmp_path, monkeypatch, where):
    from terascale.pipeline import spark_featurize
    from terascale.pipeline.spark_featurize import run_featurize

    if where == "executors":  # maps too large in all for the driver: merged by a Spark job
        monkeypatch.setattr(spark_featurize, "DRIVER_MERGE_BYTES", 0)

    spec = FeatureSpec(fields=ORDER, bits=10, seed=5, conjunctions=CONJ)
    ref = reference_map(log_bytes, spec)
    maps = []
    for parts in (1, 5):
        out = tmp_path / f"p{parts}"
        m = run_featurize(spark, [str(logs)], str(out), spec, _fconf(f"featurize.partitions={parts}"))
        assert len(m["files"]) == parts
        assert read_manifest(str(out))["groups"] == m["groups"]
        g = read_groups(str(out), read_manifest(str(out)))
        maps.append(g)
        assert m["groups"] == {"path": GROUPS_FILE, "names": group_names(spec), "buckets": int((g != NO_GROUP).sum())}
        assert m["distinct_features"] == m["groups"]["buckets"]
        assert m["quarantine"]["rows"] > 0
        assert not list(out.glob("*.tmp-*")) and not (out / "_temporary").exists()
    np.testing.assert_array_equal(maps[0], ref)
    np.testing.assert_array_equal(maps[1], ref)
    assert np.unique(ref).size >= 8


@pytest.mark.spark
def test_featurize_libsvm_map_and_a_rerun_without_a_map(spark, tmp_path):
    from terascale.pipeline.spark_featurize import run_featurize

    src = tmp_path / "a.svm"
    src.write_text("+1 3:1 1:0.5\n-1 2:1\n1 60:1 9999:1\nbad line\n0 4:1 4:1\n1 33:1 34:x\n")
    out = tmp_path / "ds"
    spec = FeatureSpec(format="libsvm", bits=6)
    m = run_featurize(spark, [str(src)], str(out), spec, _fconf("featurize.format=libsvm", "featurize.partitions=2"))
    g = read_groups(str(out), m)
    assert np.flatnonzero(g != NO_GROUP).tolist() == [0, 1, 2, 3] and (g[[0, 1, 2, 3]] == 0).all()
    assert m["groups"] == {"path": GROUPS_FILE, "names": ["features"], "buckets": 4} and m["distinct_features"] == 4

    # bits above GROUPS_MAX_BITS: no map; the new dataset replaces the first run's whole, its map included
    big = FeatureSpec(format="libsvm", bits=27)
    m2 = run_featurize(spark, [str(src)], str(out), big, _fconf("featurize.format=libsvm", "featurize.overwrite=true"))
    assert m2["groups"] is None and m2["distinct_features"] is None
    assert not (out / GROUPS_FILE).exists()
    assert read_groups(str(out), read_manifest(str(out))) is None
