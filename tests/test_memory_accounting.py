"""One memory accounting for the driver's preflight and the ranks: categories that sum to the
total, a rank's measured peak / baseline / phase peaks from /proc, and a real Spark train job
that records them per rank, prints them and shows them in its report."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from terascale.jobs.cli import main
from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.memory_accounting import (
    BUFFERS,
    CATEGORIES,
    LBFGS_MEMORY,
    MODEL_STATE,
    PROCESS_BASELINE,
    SHARD,
    Plan,
    Sizes,
    account,
    csr_bytes,
    hot_bytes,
    memory_line,
)
from terascale.jobs.memory_probe import MemoryProbe, reset_hwm
from terascale.jobs.preflight import BASELINE_BYTES, ShardSize, estimate
from terascale.jobs.report import build_report
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

MIB = 1 << 20


def _plan(solver: str, holdout: bool = True, **kw) -> Plan:
    p = {"lbfgs_memory": 15, "threads": 2, "partition": "fixed", "workers": 2, "chunk_bytes": MIB, **kw}
    return Plan(solver, p["lbfgs_memory"], p["threads"], p["partition"], holdout, p["workers"], p["chunk_bytes"])


@pytest.mark.parametrize("solver", ["online", "lbfgs", "hybrid", "cocoa"])
@pytest.mark.parametrize("active", [20_000, 1 << 20])
def test_categories_sum_to_the_total_in_every_phase(solver, active):
    s = Sizes(1 << 20, rows=1000, nnz=39_000, nnz_values=3_900, active=active)
    acc = account(_plan(solver), s, 100 * MIB)
    cats = acc.categories()
    assert tuple(cats) == CATEGORIES and sum(cats.values()) == acc.total == sum(acc.terms.values())
    assert cats[PROCESS_BASELINE] == 100 * MIB
    assert {t for terms in acc.breakdown().values() for t in terms} == set(acc.terms)
    assert acc.total == max(acc.phase_totals().values()) == acc.phase_totals()[acc.peak_phase]
    assert cats[SHARD] >= csr_bytes(1000, 39_000, 3_900) and cats[MODEL_STATE] > 0
    if acc.peak_phase == "L-BFGS":  # the pairs and vectors: (8·15 + 80)·(d + 1); its AllReduce is a buffer
        # and the second thread's accumulators: a copy of the local table (24 B per shard feature), or
        # (the lbfgs solver's first evaluation) a full-length gradient and Hessian (16 B x 2^bits)
        f = min(1 << 20, 39_000, active)
        second_thread = max(24 * (f + 1), 16 * ((1 << 20) + 1) if solver == "lbfgs" else 0)
        assert cats[LBFGS_MEMORY] == 200 * (active + 1)
        assert cats[BUFFERS] == 32 * (active + 1) + 3 * MIB + second_thread
    elif acc.peak_phase == "online passes":  # two threads: the hot-feature replicas and relabel maps
        assert cats[LBFGS_MEMORY] == 0 and cats[BUFFERS] == 3 * MIB + hot_bytes(1 << 20, 2)
        assert hot_bytes(1 << 20, 2) == (2 * (4096 + 8) + 8) * 16 + 128 + 3 * (1 << 20) + (1 << 17)
    else:
        assert cats[LBFGS_MEMORY] == 0 and cats[BUFFERS] == 3 * MIB


def test_the_preflight_computes_through_the_accounting():
    t = load_config([], ["train.solver=hybrid", "train.l2=1e-6"]).train
    e = estimate(t, 1 << 20, ShardSize(1000, 39_000, 3_900), 1 << 20, 2, MIB)
    acc = account(_plan("hybrid", lbfgs_memory=t.lbfgs_memory, threads=t.threads), Sizes(1 << 20, 1000, 39_000, 3_900, 1 << 20,
                                                                                    features=39_000), BASELINE_BYTES)
    assert (e.needed, e.phase, e.terms) == (acc.total, acc.peak_phase, acc.terms)
    assert e.categories == acc.categories() and sum(e.categories.values()) == e.needed
    assert e.to_json()["categories"] == e.categories and e.to_json()["phase_totals"]["L-BFGS"] == e.needed


def test_a_regularization_path_costs_two_weight_vectors_and_nothing_per_non_zero():
    sizes = Sizes(1 << 20, 1000, 39_000, 0, 1 << 20, features=39_000)
    fixed = account(Plan.of(load_config([], ["train.l2=1e-6"]).train, True, 2, MIB), sizes, BASELINE_BYTES)
    auto = account(Plan.of(load_config([], ["train.l2=auto"]).train, True, 2, MIB), sizes, BASELINE_BYTES)
    # the steps share the working table, which renumbers the handed-over shard in place: no copy
    assert auto.phase_totals()["L-BFGS"] - fixed.phase_totals()["L-BFGS"] == 12 * ((1 << 20) + 1)
    assert auto.phase_totals()["online passes"] == fixed.phase_totals()["online passes"]


@pytest.mark.parametrize("l2", ["auto", "1e-6"])
@pytest.mark.parametrize("penalty", ["l2", "l1"])
def test_a_shard_streamed_from_the_disk_cache_counts_its_blocks_and_nothing_per_non_zero(l2, penalty):
    """train.data_cache = disk: the shard's term is the budget (a block per thread at once), and
    no term of any phase grows with the shard's non-zeros, with a path (l2 or l1 = auto) as with
    a fixed λ: doubling the non-zeros of a shard larger than the budget changes nothing."""
    sets = [f"train.l2={l2}"] if penalty == "l2" else ["train.l2=1e-6", f"train.l1={'auto' if l2 == 'auto' else 1e-6}"]
    t = load_config([], sets).train
    budget = 64 * MIB
    D, n, d = 1 << 22, 2_000_000, 1 << 20

    def acc(nnz: int, cache_budget: int):
        return account(Plan.of(t, True, 2, MIB, cache_budget), Sizes(D, n, nnz, 0, d, features=d), BASELINE_BYTES)

    for z in (40_000_000, 80_000_000):
        disk, mem = acc(z, budget), acc(z, 0)
        assert "shard CSR" not in disk.base and disk.base["shard blocks in memory (train.data_cache = disk)"][1] == budget
        assert mem.base["shard CSR"][1] == csr_bytes(n, z, 0) > budget
        assert disk.phase_totals()["L-BFGS"] == mem.phase_totals()["L-BFGS"] - csr_bytes(n, z, 0) + budget
    small, big = acc(40_000_000, budget), acc(80_000_000, budget)
    grows = {k for k in small.phases for t, (_, b) in big.phases[k].items() if b != small.phases[k][t][1]}
    assert grows == {"read"}  # only the record batch in flight while reading (13 B x a batch's non-zeros)
    assert big.phase_totals()["L-BFGS"] == small.phase_totals()["L-BFGS"]
    assert big.categories("L-BFGS")[SHARD] == small.categories("L-BFGS")[SHARD] == budget
    # a shard smaller than the budget: its CSR, whole
    tiny = account(Plan.of(t, True, 2, MIB, budget), Sizes(D, 1000, 39_000, 0, d), BASELINE_BYTES)
    assert tiny.base["shard blocks in memory (train.data_cache = disk)"][1] == csr_bytes(1000, 39_000, 0)


def test_cocoa_from_the_disk_cache_counts_its_whole_shard():
    """CoCoA's epochs read rows in random order: from the cache its resident set grows to the shard's."""
    t = load_config([], ["train.solver=cocoa", "train.l2=1e-6"]).train
    acc = account(Plan.of(t, False, 2, MIB, 64 * MIB), Sizes(1 << 20, 2_000_000, 40_000_000, 0, 1 << 20), 0)
    assert acc.base["shard CSR"][1] == csr_bytes(2_000_000, 40_000_000, 0)


def test_a_rank_counts_its_csr_as_held_binary_or_not():
    # a binary shard holds no values: the rank passes CSRData.nbytes, not 4 bytes per non-zero
    n, z = 1000, 39_000
    held = 8 * (n + 1) + 4 * z + 4 * n + 4 * n  # indptr int64, indices int32, labels and weights float32
    acc = account(_plan("lbfgs", holdout=True), Sizes(1 << 16, n, z, 0, 5000, csr=held), 50 * MIB)
    assert acc.base["shard CSR"][1] == held == csr_bytes(n, z, 0)
    assert "split" not in acc.phases  # held-out rows are split off while reading
    assert acc.phases["read"]["one record batch in flight while reading"][1] == int(n * (13 * z / n + 24))
    # partition=redeal gathers every rank's rows
    acc = account(_plan("cocoa", partition="redeal", workers=3), Sizes(1 << 16, n, z, z, 5000, csr=held), 0)
    assert acc.base["shard CSR"][1] == 3 * held and acc.phases["split"]["rows in flight while gathering"][1] == 3 * held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and clear_refs are Linux's")
def test_the_probe_measures_each_phase_on_its_own():
    probe = MemoryProbe()
    assert probe.baseline > 0 and probe.hwm_reset == reset_hwm()
    big = np.ones(200 * MIB // 8)  # touched: resident, then freed within the phase
    assert int(big.sum()) == big.size
    del big
    first = probe.end_phase("read")
    assert first >= probe.baseline + 190 * MIB
    second = probe.end_phase("solver")
    if probe.hwm_reset:  # the high-water mark was reset after "read": the 200 MiB array is gone
        assert second < first - 150 * MIB
    else:
        assert second >= first
    assert probe.peak >= first and probe.phase_peaks == {"read": first, "solver": second}


@pytest.fixture(scope="module")
def dataset(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    generate_clicklogs(d / "raw", 3000, files=2, seed=5, processes=1)
    run_featurize(spark, [str(d / "raw")], str(d / "data"), FeatureSpec(fields=CRITEO_FIELDS, bits=14),
                  load_config([], ["featurize.partitions=2"]).featurize)
    return d / "data"


@pytest.mark.spark
def test_a_train_job_records_prints_and_reports_each_ranks_memory(spark, dataset, tmp_path, capsys):
    model = tmp_path / "m"
    sets = ["train.solver=hybrid", "train.l2=1e-6", "train.workers=2", "train.passes=3", "train.holdout_period=10",
            "spark.master=local[2]"]
    assert main(["train", "--input", str(dataset), "--model", str(model), *[x for s in sets for x in ("--set", s)]]) == 0
    meta = json.loads((model / "metadata.json").read_text())
    est = meta["memory_estimate"]
    assert sum(est["categories"].values()) == est["needed_bytes"]
    assert {r["rank"] for r in meta["per_rank"]} == {0, 1}
    for r in meta["per_rank"]:
        m = r["memory"]
        print(json.dumps(m))  # shown when an assertion fails
        assert r["peak_rss_bytes"] == m["peak_rss_bytes"] >= m["baseline_rss_bytes"] > 50 * MIB
        assert set(m["phase_peaks"]) == {"read", "solver"}
        assert all(0 < p <= m["peak_rss_bytes"] for p in m["phase_peaks"].values())
        assert max(m["phase_peaks"].values()) == m["peak_rss_bytes"]  # the phases cover the task
        b = m["breakdown"]
        assert tuple(b) == CATEGORIES and b[PROCESS_BASELINE] == m["baseline_rss_bytes"]
        assert b[SHARD] >= r["csr_bytes"] > 0
        if max(m["phase_peaks"], key=m["phase_peaks"].get) == "solver":  # the read phase holds no model yet
            assert b[MODEL_STATE] > 0 and b[BUFFERS] > 0
        assert m["unaccounted_bytes"] == m["peak_rss_bytes"] - sum(b.values())
        assert sum(m["terms"].values()) == sum(b.values())
        # the L-BFGS phase's agreed active set, at most the 2^14 features
        assert m["active_features_from"] == "the L-BFGS phase's active set" and 0 < m["active_features"] <= 1 << 14
        assert m["active_features"] == next(h["active_features"] for h in meta["history"] if "active_features" in h)
        # the breakdown is the accounting at the phase of the measured peak
        measured = max(m["phase_peaks"], key=m["phase_peaks"].get)
        assert sum(b.values()) == m["phase_estimates"][measured]
        if m["breakdown_phase"] == "L-BFGS":
            assert measured == "solver" and b[LBFGS_MEMORY] == (8 * 15 + 80) * (m["active_features"] + 1)
        else:
            assert m["breakdown_phase"] in (("read", "split") if measured == "read" else ("online passes",))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("memory"))
    assert line.strip() == f"memory             {memory_line(meta)}"
    assert "(rank 0)" in line and "(rank 1)" in line and "estimate" in line

    html = open(build_report(str(model), out_dir=str(tmp_path / "rep"))).read()
    assert "<h2>Memory per rank</h2>" in html and 'alt="memory"' in html and (tmp_path / "rep" / "memory.png").exists()
    for cat in ("process baseline", "shard", "model state", "buffers", "unaccounted (peak − accounted)"):
        assert f"<td>{cat}</td>" in html
    assert "measured / estimate" in html and f"{meta['per_rank'][0]['memory']['peak_rss_bytes'] / est['needed_bytes']:.2f}" in html
