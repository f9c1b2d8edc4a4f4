"""The cost model of one training pass (issue 21, ``docs/pages/explanation/scaling.md``): pure arithmetic, no I/O.

A pass of K ranks costs

    T_pass(K) = T_compute(K) + T_wait(K) + T_allreduce(K)

**Compute.** Rank k does w_k = nnz_k · c(T) seconds of work, c(T) the measured seconds per
non-zero of the pass's kernel with T threads (:class:`Compute`). The ranks share the cores
actually available to them, C (a calibration input, not the machine's nominal count: other work
may hold some), by processor sharing (:func:`ps_finish_times`): while n ranks still compute,
each runs at min(1, C/n) of a core. With every rank on a core of its own (K·T ≤ C, a cluster)
rank k finishes at w_k; with equal shards on fewer cores all finish at Σ_k w_k / C. The slowest
rank's finish is the makespan T_compute + T_wait: ``T_compute`` is when the median rank
finishes, ``T_wait`` what the slowest adds. On a cluster the w_k are drawn from the tail model
below.

**AllReduce** (:func:`allreduce_seconds`) of a vector of n bytes over the balanced binary tree
(rank r's children are 2r+1 and 2r+2, see ``allreduce.topology``), pipelined in chunks of c
bytes: every tree edge carries the vector once up and once down, and the up and down flows
overlap. Host r's link carries, in each direction, f_r = (children of r) + (1 if r has a parent)
vectors (up: its own partial sum out, its children's in; down: the result in, to each child
out); the busiest link carries f(K) = max_r f_r vectors (:func:`link_factor`: 1 at K = 2, 2 at
K = 3, 4, and 3 from K = 5 on). With link rate B (bytes of payload per second: the shaped rate
times the TCP/IP payload share of a frame, :func:`payload_efficiency`), M = ⌈n/c⌉ chunks and
S = 2·depth pipeline stages (up and down the tree, :func:`tree_depth`), the busiest link passes
one chunk every τ = f·(n/M)/B, so

    T_link = (M + S − 1)·τ + S·ℓ

ℓ the per-hop software latency (a frame through two processes' sockets). A pass is CPU-bound
instead when sealing, sending, receiving, opening and adding the chunks outruns the cores: every
edge moves the vector in each direction, 2(K−1)·n bytes in all, at κ CPU seconds per byte and
direction (both endpoints, measured over one link), so

    T_allreduce = max(T_link, 2(K−1)·n·κ / C_io)

with C_io the cores the AllReduce's threads can use (``Compute.io_cores``: on a machine shared
with CPU-bound work, more than the compute's C, as threads waking from socket waits run first).

**Tail** (:class:`TailModel`): per-host compute times t_k = t_med · b_k · s_k, b_k the host's
speed (lognormal, σ) and s_k its slowdown: 1, or with probability ``p_busy`` a busy host
(lognormal around ``busy_factor``), or with probability ``p_bad`` a broken one
(``bad_factor``); both persist from pass to pass (a host is slow because of what it is and
what else runs on it). Without spares the pass waits for max_k t_k. With S spares
(terascale's and the paper's speculative execution in the first pass, :func:`first_pass_race`),
once half the shards have finished each spare restarts one of the S slowest unfinished shards
on a host of its own; a shard's first finisher survives and serves the later passes, so a slow
host that loses its race costs only the first pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: bytes per frame on an Ethernet link besides the IP packet (the MAC header; tc counts it)
ETH_HEADER = 14
#: IPv4 (20) + TCP (20) + TCP timestamps (12) bytes of header per segment
TCP_IP_HEADERS = 52


def tree_depth(k: int) -> int:
    """Edges on the longest root-to-leaf path of the balanced binary tree over ``k`` ranks."""
    if k < 1:
        raise ValueError(f"k = {k}: must be >= 1")
    return k.bit_length() - 1


def children(rank: int, k: int) -> int:
    """Number of children of ``rank`` in the tree of ``k`` ranks."""
    return sum(1 for c in (2 * rank + 1, 2 * rank + 2) if c < k)


def host_link_vectors(k: int) -> list[int]:
    """Per rank, the vectors its host link carries in EACH direction during one AllReduce."""
    return [children(r, k) + (1 if r > 0 else 0) for r in range(k)]


def link_factor(k: int) -> int:
    """Vectors crossing the busiest host link in one direction (0 for a single rank)."""
    return max(host_link_vectors(k)) if k > 1 else 0


def payload_efficiency(mtu: int = 1500) -> float:
    """TCP payload bytes per byte a shaper counts (MTU-sized segments, Ethernet header included)."""
    return (mtu - TCP_IP_HEADERS) / (mtu + ETH_HEADER)


@dataclass(frozen=True)
class Network:
    """The links and the AllReduce transport, as the model sees them."""

    link_bits_per_s: float  # each host's link rate, each direction (the shaper's rate)
    chunk_bytes: int = 1 << 20  # allreduce chunk size
    hop_latency_s: float = 0.0  # one frame through a tree edge's two processes (software)
    cpu_s_per_byte: float = 0.0  # κ: CPU per byte and direction of an edge, both endpoints
    mtu: int = 1500

    @property
    def payload_bytes_per_s(self) -> float:
        return self.link_bits_per_s / 8.0 * payload_efficiency(self.mtu)


def allreduce_seconds(k: int, nbytes: int, net: Network, cores: float = math.inf) -> dict[str, float]:
    """The AllReduce of ``nbytes`` over ``k`` ranks (module docstring): ``seconds`` and its terms
    ``link_s`` (T_link), ``cpu_s`` (the CPU bound), ``stream_s`` (f·n/B alone, no pipeline fill or
    latency), ``fill_s`` and ``latency_s``."""
    if k <= 1 or nbytes <= 0:
        return {"seconds": 0.0, "link_s": 0.0, "cpu_s": 0.0, "stream_s": 0.0, "fill_s": 0.0, "latency_s": 0.0}
    f = link_factor(k)
    m = math.ceil(nbytes / net.chunk_bytes)
    stages = 2 * tree_depth(k)
    tau = f * (nbytes / m) / net.payload_bytes_per_s
    stream = m * tau
    fill = (stages - 1) * tau
    latency = stages * net.hop_latency_s
    link = stream + fill + latency
    cpu = 2 * (k - 1) * nbytes * net.cpu_s_per_byte / cores
    return {"seconds": max(link, cpu), "link_s": link, "cpu_s": cpu, "stream_s": stream, "fill_s": fill,
            "latency_s": latency}


def effective_bandwidth_bits(k: int, nbytes: int, seconds: float) -> float:
    """Effective AllReduce bandwidth (bits/s): the payload the busiest host link carries in one
    direction, f(K)·n bytes, over the AllReduce's seconds. Against the link rate it says what
    share of the busiest link the collective used (1.0 = the link never idled and carried no
    header); it cannot exceed :func:`payload_efficiency` of the rate."""
    return link_factor(k) * nbytes * 8.0 / seconds


@dataclass(frozen=True)
class Compute:
    """Seconds per non-zero of a pass's kernel at T threads in one process (measured), and the
    cores the ranks actually have."""

    s_per_nnz: dict[int, float]  # T -> seconds per non-zero, one process alone on the machine
    cores: float  # effective cores available to all ranks' compute together (C)
    #: cores the AllReduce's threads can use (None: ``cores``). They sleep on sockets most of the
    #: time and the scheduler runs a thread that wakes from a sleep ahead of ones that have been
    #: computing, so on a machine shared with CPU-bound work they get more than the ranks'
    #: compute share: the machine's cores.
    io_cores: float | None = None

    def work(self, nnz: int, threads: int = 1) -> float:
        """Seconds of one rank's pass over ``nnz`` non-zeros with ``threads`` threads, alone."""
        return nnz * self.s_per_nnz[threads]


def ps_finish_times(work_s: Sequence[float], cores: float) -> np.ndarray:
    """When each of ranks with these solo work seconds finishes when they all start together and
    share ``cores`` cores by processor sharing (as Linux's fair scheduler shares them): while n
    ranks run, each runs at min(1, cores / n) of a core's speed. In the input's order."""
    w = np.asarray(work_s, dtype=float)
    order = np.argsort(w, kind="stable")
    finish = np.empty_like(w)
    t = done = 0.0
    for i, j in enumerate(order):
        rate = min(1.0, cores / (w.shape[0] - i))
        t += (w[j] - done) / rate
        done = w[j]
        finish[j] = t
    return finish


def compute_makespan(work_s: Sequence[float], cores: float) -> float:
    """When the last rank finishes (:func:`ps_finish_times`); 0 for no ranks."""
    return float(ps_finish_times(work_s, cores).max()) if len(work_s) else 0.0


def pass_seconds(nnz_per_rank: Sequence[int], nbytes: int, comp: Compute, net: Network,
                 threads: int = 1) -> dict[str, float]:
    """One pass of ``len(nnz_per_rank)`` ranks on one machine of ``comp.cores`` cores: a gradient
    pass over each rank's non-zeros, then an AllReduce of ``nbytes``. Returns ``seconds`` and its
    terms ``compute_s`` (when the median rank finishes its compute, the sharing of cores
    included), ``wait_s`` (until the slowest finishes) and ``allreduce_s``, with the AllReduce's
    own terms. Threads: a rank of T threads, w = nnz · c(T) seconds alone on T cores, is T
    threads of w core-seconds each sharing the cores with everything else."""
    work = [comp.work(n, threads) for n in nnz_per_rank for _ in range(threads)]
    finish = ps_finish_times(work, comp.cores) if work else np.zeros(0)
    per_rank = finish.reshape(len(nnz_per_rank), threads).max(axis=1) if work else finish
    makespan = float(per_rank.max()) if per_rank.size else 0.0
    median = float(np.median(per_rank)) if per_rank.size else 0.0
    ar = allreduce_seconds(len(nnz_per_rank), nbytes, net, comp.io_cores or comp.cores)
    return {"seconds": makespan + ar["seconds"], "compute_s": median, "wait_s": makespan - median,
            "allreduce_s": ar["seconds"], **{f"allreduce_{key}": v for key, v in ar.items() if key != "seconds"}}


# ---------------------------------------------------------------------------------------------
# The tail of the per-host compute times, with and without spares


@dataclass(frozen=True)
class TailModel:
    """Per-host compute time factors (module docstring): t = median · speed · slowdown, both
    properties of the host (they persist from pass to pass)."""

    sigma: float  # lognormal spread of every host's speed (median 1)
    p_busy: float  # share of hosts slowed by other work
    busy_factor: float  # their median slowdown
    busy_sigma: float  # lognormal spread of their slowdown
    p_bad: float  # share of broken hosts
    bad_factor: float  # their slowdown

    def factors(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` hosts' factors: speed · slowdown (1 for a normal host)."""
        u = rng.random(n)
        s = np.exp(self.sigma * rng.standard_normal(n))
        busy = u < self.p_busy
        s[busy] *= self.busy_factor * np.exp(self.busy_sigma * rng.standard_normal(int(busy.sum())))
        bad = (u >= self.p_busy) & (u < self.p_busy + self.p_bad)
        s[bad] *= self.bad_factor
        return s


def first_pass_race(first: np.ndarray, spare_times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first pass with spares: ``first[k]`` is shard k's time on its own host,
    ``spare_times[j]`` the time spare j's host would take for a shard. Once half the shards
    (rounded up) have finished, spare j restarts the j-th slowest unfinished shard (the slowest
    first; each shard raced once; shards finished by then are not raced). Returns (each shard's
    finish time, which spare won it or -1)."""
    k = first.shape[0]
    finish = first.astype(float).copy()
    winner = np.full(k, -1)
    if spare_times.shape[0] == 0 or k == 0:
        return finish, winner
    t_half = np.sort(first)[(k + 1) // 2 - 1]
    unfinished = np.flatnonzero(first > t_half)
    slowest = unfinished[np.argsort(-first[unfinished], kind="stable")]
    for j, shard in enumerate(slowest[: spare_times.shape[0]]):
        t_spare = t_half + spare_times[j]
        if t_spare < finish[shard]:
            finish[shard] = t_spare
            winner[shard] = j
    return finish, winner


def simulate_cluster(tail: TailModel, k: int, spares: int, median_s: float, rng: np.random.Generator
                     ) -> dict[str, np.ndarray]:
    """One simulated job of ``k`` hosts + ``spares``: ``own`` (each shard's time on its own host),
    ``first`` (pass 1's per-shard finish times), ``later`` (each shard's compute time in the later passes, on its survivor's host)
    and ``replaced`` (the shards a spare won)."""
    own = median_s * tail.factors(rng, k)
    spare = median_s * tail.factors(rng, spares)
    finish, winner = first_pass_race(own, spare)
    won = winner >= 0
    later = own.copy()
    later[won] = spare[winner[won]]
    return {"own": own, "first": finish, "later": later, "replaced": won}


def tail_quantiles(tail: TailModel, k: int, spares: int, median_s: float, jobs: int = 200, seed: int = 0
                   ) -> dict[str, float]:
    """The paper's Table 2 statistics of simulated jobs: per job, the 5/50/95% quantiles and the
    max of the per-host compute times of the passes after the first, then their medians over
    ``jobs`` jobs; also the median number of shards a spare won, the median of the first pass's
    slowest finish and the share of jobs whose slowest later pass is over 3 × the median."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(jobs):
        sim = simulate_cluster(tail, k, spares, median_s, rng)
        q5, q50, q95 = np.quantile(sim["later"], [0.05, 0.5, 0.95])
        worst = sim["later"].max()
        rows.append((q5, q50, q95, worst, sim["replaced"].sum(), sim["first"].max(), worst > 3 * q50))
    a = np.array(rows, dtype=float)
    m = np.median(a, axis=0)
    return {"q05": m[0], "q50": m[1], "q95": m[2], "max": m[3], "replaced": m[4], "first_pass_max": m[5],
            "p_max_over_3x": float(a[:, 6].mean())}


def expected_max_lognormal(k: int, sigma: float, samples: int = 20000, seed: int = 0) -> float:
    """E[max of k lognormal(0, σ) factors] by simulation (a check on the tail model's body)."""
    rng = np.random.default_rng(seed)
    return float(np.exp(sigma * rng.standard_normal((samples, k))).max(axis=1).mean())


def mixture_cdf(tail: TailModel, x: float | np.ndarray) -> np.ndarray:
    """P(factor ≤ x) of one host's factor speed · slowdown (a busy host's speed and slowdown
    combine into one lognormal: log-variances add)."""
    from scipy.special import ndtr  # the standard normal CDF

    lx = np.log(np.asarray(x, dtype=float))
    p_normal = 1.0 - tail.p_busy - tail.p_bad
    busy_sd = math.hypot(tail.sigma, tail.busy_sigma)
    return (p_normal * ndtr(lx / tail.sigma)
            + tail.p_busy * ndtr((lx - math.log(tail.busy_factor)) / busy_sd)
            + tail.p_bad * ndtr((lx - math.log(tail.bad_factor)) / tail.sigma))


def mixture_quantile(tail: TailModel, q: float) -> float:
    """The factor x with P(factor ≤ x) = q (bisection on :func:`mixture_cdf`)."""
    from scipy.optimize import brentq

    return float(brentq(lambda x: float(mixture_cdf(tail, x)) - q, 1e-6, 1e6, xtol=1e-12, rtol=1e-12))


def fit_tail(q05: float, q50: float, q95: float, worst: float, hosts: int, p_busy: float,
             busy_sigma: float = 0.25) -> TailModel:
    """A :class:`TailModel` (factors relative to ``q50``) whose 5/50/95% quantiles match
    ``q05/q50/q95`` (seconds), with one broken host per ``hosts`` at ``worst / q50`` (the
    paper's Table 2 has one among 1000) and a share ``p_busy`` of busy hosts: three quantiles do
    not determine both the share and the slowdown of the busy hosts, so the share is given and
    (σ, busy_factor) are fitted by least squares on the log quantiles."""
    from scipy.optimize import least_squares

    targets = np.log(np.array([q05, q50, q95]) / q50)

    def model(v):
        return TailModel(sigma=float(np.exp(v[0])), p_busy=p_busy, busy_factor=1.0 + float(np.exp(v[1])),
                         busy_sigma=busy_sigma, p_bad=1.0 / hosts, bad_factor=worst / q50)

    def resid(v):
        t = model(v)
        return np.log([mixture_quantile(t, q) for q in (0.05, 0.5, 0.95)]) - targets

    sol = least_squares(resid, x0=np.array([math.log(0.1), math.log(0.8)]), xtol=1e-12, ftol=1e-12)
    return model(sol.x)
