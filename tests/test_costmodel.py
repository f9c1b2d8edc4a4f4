"""The cost model's arithmetic (tests/benchmarks/costmodel.py, docs/pages/explanation/scaling.md): the tree's link
loads against a count over ``allreduce.topology``'s edges, the AllReduce and pass formulas on
hand-computed cases, monotonicity, processor sharing against a time-stepped simulation, and the
tail model against samples drawn from it. No wall clock anywhere."""

from __future__ import annotations

import math

import numpy as np
import pytest

from terascale.allreduce.topology import children_of, depth, parent_of
from tests.benchmarks import costmodel as cm


def _link_loads(k: int) -> list[tuple[int, int]]:
    """(vectors out, vectors in) of each host's link in one AllReduce, counted edge by edge:
    every child sends its partial sum up and receives the result down."""
    tx, rx = [0] * k, [0] * k
    for r in range(k):
        p = parent_of(r)
        if p is not None:
            tx[r] += 1  # up: r -> parent
            rx[p] += 1
            tx[p] += 1  # down: parent -> r
            rx[r] += 1
    return list(zip(tx, rx, strict=True))


@pytest.mark.parametrize("k", [*range(1, 18), 100, 1000])
def test_link_factor_counts_the_busiest_link(k):
    loads = _link_loads(k)
    assert cm.host_link_vectors(k) == [max(t, r) for t, r in loads]
    assert cm.link_factor(k) == (max(max(t, r) for t, r in loads) if k > 1 else 0)
    assert cm.tree_depth(k) == depth(k)
    assert all(cm.children(r, k) == len(children_of(r, k)) for r in range(k))


def test_link_factor_values():
    assert [cm.link_factor(k) for k in range(1, 9)] == [0, 1, 2, 2, 3, 3, 3, 3]
    with pytest.raises(ValueError):
        cm.tree_depth(0)


def test_payload_efficiency_is_tcp_payload_per_shaped_byte():
    assert cm.payload_efficiency(1500) == pytest.approx(1448 / 1514, rel=1e-15)
    assert cm.payload_efficiency(9000) > cm.payload_efficiency(1500)


def test_allreduce_seconds_by_hand():
    n, chunk, rate, lat, kappa = 32 << 20, 1 << 20, 1e9, 2e-4, 3e-9
    net = cm.Network(rate, chunk, lat, kappa)
    b = rate / 8 * 1448 / 1514
    got = cm.allreduce_seconds(4, n, net, cores=1.5)
    tau = 2 * chunk / b  # f(4) = 2 vectors, 32 chunks, depth 2: 4 stages
    assert got["stream_s"] == pytest.approx(32 * tau, rel=1e-12)
    assert got["fill_s"] == pytest.approx(3 * tau, rel=1e-12)
    assert got["latency_s"] == pytest.approx(4 * lat, rel=1e-12)
    assert got["link_s"] == pytest.approx(35 * tau + 4 * lat, rel=1e-12)
    assert got["cpu_s"] == pytest.approx(2 * 3 * n * kappa / 1.5, rel=1e-12)
    assert got["seconds"] == max(got["link_s"], got["cpu_s"])
    # a length that is not a multiple of the chunk: 3 chunks of n/3 bytes each
    odd = cm.allreduce_seconds(2, 2 * chunk + 5, cm.Network(rate, chunk))
    assert odd["link_s"] == pytest.approx((3 + 1) * (2 * chunk + 5) / 3 / b, rel=1e-12)
    assert cm.allreduce_seconds(1, n, net)["seconds"] == 0.0
    assert cm.allreduce_seconds(4, 0, net)["seconds"] == 0.0


def test_effective_bandwidth_inverts_the_stream_term():
    n = 32 << 20
    net = cm.Network(1e9, chunk_bytes=n)  # one chunk: no pipeline to fill beyond the stages
    for k in (2, 4, 8):
        t = cm.link_factor(k) * n / net.payload_bytes_per_s
        assert cm.effective_bandwidth_bits(k, n, t) == pytest.approx(1e9 * cm.payload_efficiency(), rel=1e-12)


def test_allreduce_is_monotone():
    net = cm.Network(1e9, 1 << 20, 1e-4, 2e-9)
    sizes = [1 << 16, 1 << 20, 5 << 20, 32 << 20, 1 << 28]
    for k in range(2, 200):
        a, b = cm.allreduce_seconds(k, 32 << 20, net, 2.0), cm.allreduce_seconds(k + 1, 32 << 20, net, 2.0)
        assert b["seconds"] >= a["seconds"]
    for k in (2, 5, 1000):
        ts = [cm.allreduce_seconds(k, n, net)["seconds"] for n in sizes]
        assert ts == sorted(ts)
        assert cm.allreduce_seconds(k, 1 << 24, cm.Network(1e10))["seconds"] < \
            cm.allreduce_seconds(k, 1 << 24, cm.Network(1e9))["seconds"]


def _ps_stepped(work: list[float], cores: float, dt: float = 2e-4) -> list[float]:
    """Processor sharing by small time steps (the slow, obvious reference)."""
    left = list(work)
    finish = [0.0] * len(work)
    t = 0.0
    while any(x > 0 for x in left):
        active = [i for i, x in enumerate(left) if x > 0]
        rate = min(1.0, cores / len(active))
        t += dt
        for i in active:
            left[i] -= rate * dt
            if left[i] <= 0:
                finish[i] = t
    return finish


@pytest.mark.parametrize(("work", "cores"), [([0.1, 0.1, 1.0], 2.0), ([0.3, 0.5, 0.2, 0.9, 0.4], 1.3),
                                            ([0.5] * 8, 2.0), ([0.7, 0.1], 4.0), ([0.25, 0.6, 0.6], 0.8)])
def test_processor_sharing_matches_a_stepped_simulation(work, cores):
    got = cm.ps_finish_times(work, cores)
    assert got == pytest.approx(_ps_stepped(work, cores), abs=6e-4)
    assert cm.compute_makespan(work, cores) == pytest.approx(max(got), rel=1e-15)


def test_processor_sharing_cases():
    assert cm.ps_finish_times([1.0, 1.0, 10.0], 2.0).tolist() == pytest.approx([1.5, 1.5, 10.5])
    assert cm.compute_makespan([2.0] * 8, 2.0) == pytest.approx(8.0)  # equal shards: total / cores
    assert cm.compute_makespan([2.0, 3.0], 4.0) == 3.0  # a core each: the slowest rank
    assert cm.compute_makespan([], 2.0) == 0.0


def test_pass_seconds_adds_its_terms_and_reproduces_the_inputs():
    comp = cm.Compute({1: 2e-8, 2: 1.2e-8}, cores=1.6)
    net = cm.Network(1e9, 1 << 20, 1e-4, 2.5e-9)
    nnz = [9_000_000, 9_500_000, 8_000_000, 9_200_000, 9_100_000]
    p = cm.pass_seconds(nnz, 32 << 20, comp, net)
    finish = cm.ps_finish_times([n * 2e-8 for n in nnz], 1.6)
    assert p["compute_s"] == pytest.approx(float(np.median(finish)), rel=1e-15)
    assert p["wait_s"] == pytest.approx(finish.max() - np.median(finish), rel=1e-12)
    assert p["allreduce_s"] == cm.allreduce_seconds(5, 32 << 20, net, 1.6)["seconds"]
    io = cm.pass_seconds(nnz, 32 << 20, cm.Compute(comp.s_per_nnz, 1.6, io_cores=2.0), net)
    assert io["allreduce_s"] == cm.allreduce_seconds(5, 32 << 20, net, 2.0)["seconds"]
    assert io["compute_s"] == p["compute_s"]
    assert p["seconds"] == pytest.approx(p["compute_s"] + p["wait_s"] + p["allreduce_s"], rel=1e-15)
    # threads: one rank of 2 threads alone on 2 cores runs nnz · c(2)
    solo = cm.pass_seconds([10_000_000], 0, cm.Compute({2: 1.2e-8}, cores=2.0), net, threads=2)
    assert solo["seconds"] == pytest.approx(0.12, rel=1e-12)
    # monotone: more work or fewer cores never makes a pass faster
    base = p["seconds"]
    assert cm.pass_seconds([x * 2 for x in nnz], 32 << 20, comp, net)["seconds"] > base
    assert cm.pass_seconds(nnz, 32 << 20, cm.Compute(comp.s_per_nnz, 1.0), net)["seconds"] > base
    assert cm.pass_seconds(nnz, 64 << 20, comp, net)["seconds"] > base


def _tail() -> cm.TailModel:
    return cm.TailModel(sigma=0.1, p_busy=0.1, busy_factor=1.8, busy_sigma=0.25, p_bad=0.002, bad_factor=20.0)


def test_mixture_quantiles_match_a_sample_of_the_model():
    tail = _tail()
    sample = tail.factors(np.random.default_rng(5), 200_000)
    for q in (0.05, 0.5, 0.9, 0.95, 0.99):
        assert cm.mixture_quantile(tail, q) == pytest.approx(np.quantile(sample, q), rel=0.01)
    assert float(cm.mixture_cdf(tail, 1.0)) == pytest.approx(np.mean(sample <= 1.0), abs=0.003)
    assert np.mean(sample > 10) == pytest.approx(0.002, abs=0.0005)  # the broken hosts


def test_fit_tail_reproduces_its_targets():
    for p_busy in (0.06, 0.1, 0.2):
        t = cm.fit_tail(29, 34, 60, 758, 1000, p_busy)
        got = [34 * cm.mixture_quantile(t, q) for q in (0.05, 0.5, 0.95)]
        assert got == pytest.approx([29, 34, 60], rel=0.03)
        assert t.p_bad == 1 / 1000 and t.bad_factor == pytest.approx(758 / 34)


def test_first_pass_race_by_hand():
    first = np.array([1.0, 2.0, 3.0, 10.0, 4.0, 9.0])
    # half (3 of 6) done at t = 3: spares race 10 then 9 then 4
    finish, winner = cm.first_pass_race(first, np.array([2.0, 8.0, 0.5]))
    assert winner.tolist() == [-1, -1, -1, 0, 2, -1]  # 3+2 < 10; 3+8 > 9; 3+0.5 < 4
    assert finish.tolist() == [1.0, 2.0, 3.0, 5.0, 3.5, 9.0]
    same, none = cm.first_pass_race(first, np.zeros(0))
    assert same.tolist() == first.tolist() and (none == -1).all()


def test_spares_only_ever_shorten_the_tail():
    tail = _tail()
    rng = np.random.default_rng(11)
    for _ in range(20):
        sim = cm.simulate_cluster(tail, 300, 15, 30.0, rng)
        assert (sim["first"] <= sim["own"]).all() and (sim["later"] <= sim["own"]).all()
        assert sim["replaced"].sum() <= 15
    without = cm.tail_quantiles(tail, 1000, 0, 30.0, jobs=60, seed=2)
    with_spares = cm.tail_quantiles(tail, 1000, 50, 30.0, jobs=60, seed=2)
    assert with_spares["max"] < without["max"] / 3  # the broken hosts lose their races
    assert with_spares["q50"] == pytest.approx(without["q50"], rel=0.02)
    assert without["replaced"] == 0 and with_spares["replaced"] > 0


def test_expected_max_of_lognormals_grows_like_the_order_statistic():
    # E[max of k] for σ small ~ exp(σ · E[max of k standard normals]); k = 2: E = 1/√π
    got = cm.expected_max_lognormal(2, 0.01, samples=100_000)
    assert got == pytest.approx(math.exp(0.01 / math.sqrt(math.pi)), rel=2e-4)
    assert cm.expected_max_lognormal(1000, 0.1, samples=1000) > cm.expected_max_lognormal(10, 0.1, samples=1000)
