"""AllReduce speed per cipher: against raw loopback TCP and against Spark's treeAggregate.

- Raw loopback (``allreduce_socket.raw_loopback``): one TCP transfer of 64 MiB between two
  processes, no framing and no crypto.
- AllReduce (``allreduce_socket.allreduce_bandwidth``): a 2^24-element float32 vector (64 MiB)
  over K = 2, 4, 8 processes on 127.0.0.1, for each ``allreduce.cipher``; time = the slowest
  rank's wall time of one call. ``aes-gcm`` also runs with ``overlap=False`` (no writer or reader threads)
  at K = 2 and 4, to show what the overlap buys.
- Spark ``treeAggregate`` summing the same 2^24-float32 vectors from K = 4 cached partitions on
  ``local[4]`` (numpy in-place adds as seqOp/combOp, depth 2).

Rounds interleave everything (raw, every cipher and K), so load from other work on the machine
spreads over all figures; each figure is the median over all rounds' runs. ``perf`` gives, per
rank, the seconds one call spent in each stage (:meth:`allreduce.node.TreeNode.perf`): seal
(encrypt / MAC), send and recv (socket; ``*_cpu_s`` is the thread's CPU, the rest of the wall
time is waiting), open (verify / decrypt) and add.

Targets with aes-gcm: K = 2 at >= 60% of raw loopback; K = 4 >= 20x faster than treeAggregate.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from tests.benchmarks import allreduce_socket
from tests.benchmarks.common import write_result  # noqa: F401 - also sets PYSPARK_PYTHON

N = 1 << 24
NBYTES = N * 4
KS = (2, 4, 8)
K_SPARK = 4
CIPHERS = ("aes-gcm", "aes-gmac", "hmac-sha256")
DEFAULT = "aes-gcm"
ROUNDS = 3
REPEATS = 3  # timed calls per run (after one warm-up call)


def tree_aggregate_seconds(k: int = K_SPARK, n: int = N, repeats: int = 3) -> dict:
    from pyspark import StorageLevel
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{k}]").appName("bench-treeaggregate")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.memory", "6g").config("spark.driver.maxResultSize", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        rdd = spark.sparkContext.parallelize(range(k), k).map(lambda i: np.full(n, i + 1, np.float32))
        rdd.persist(StorageLevel.MEMORY_ONLY)
        rdd.count()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            total = rdd.treeAggregate(np.zeros(n, np.float32), lambda a, v: np.add(a, v, out=a),
                                      lambda a, b: np.add(a, b, out=a), depth=2)
            times.append(time.perf_counter() - t0)
            assert total.shape == (n,) and total[0] == sum(range(1, k + 1))
        rdd.unpersist()
    finally:
        spark.stop()
    return {"k": k, "elements": n, "median_s": statistics.median(times), "best_s": min(times),
            "times_s": times}


def crypto_throughput(nbytes: int = 1 << 20, loops: int = 64) -> dict:
    """Single-thread GB/s of each cipher's sealing of one 1 MiB chunk (and a plain copy)."""
    from terascale.allreduce import ciphers

    payload = memoryview(np.ones(nbytes, np.uint8)).cast("B")
    out = bytearray(nbytes + 32)
    header = bytes(18)
    figures = {}
    for name in CIPHERS:
        fc = ciphers.frame_cipher(name, b"k" * 32, "c2s")
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(loops):
                fc.seal(header, payload, out)
            best = min(best, time.perf_counter() - t0)
        figures[f"{name}_GBps"] = nbytes * loops / best / 1e9
    dst = np.empty(nbytes, np.uint8)
    t0 = time.perf_counter()
    for _ in range(loops):
        np.copyto(dst, np.frombuffer(payload, np.uint8))
    figures["memcpy_GBps"] = nbytes * loops / (time.perf_counter() - t0) / 1e9
    return figures


def _median_perf(perfs: list[list[dict]]) -> list[dict]:
    """Per rank, the median of each stage over runs."""
    ranks = len(perfs[0])
    return [
        {key: statistics.median(p[r].get(key, 0.0) for p in perfs) for key in perfs[0][r]}
        for r in range(ranks)
    ]


def measure(ks: tuple[int, ...] = KS, ciphers: tuple[str, ...] = CIPHERS, rounds: int = ROUNDS,
            n: int = N, no_overlap_ks: tuple[int, ...] = (2, 4)) -> dict:
    """Raw loopback and the AllReduce of ``n`` float32 per cipher and K, interleaved over
    ``rounds`` (see the module docstring); no Spark. ``no_overlap_ks``: the K at which the
    default cipher also runs without writer threads (only if the default cipher is measured)."""
    nbytes = n * 4
    load0 = os.getloadavg()[0]
    variants = [(c, k, True) for c in ciphers for k in ks]
    if DEFAULT in ciphers:
        variants += [(DEFAULT, k, False) for k in no_overlap_ks]
    raw_times: list[float] = []
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    perfs: dict[tuple, list] = {v: [] for v in variants}
    for rnd in range(rounds):
        raw = allreduce_socket.raw_loopback(nbytes, repeats=REPEATS)
        raw_times.append(raw["median_s"])
        print(f"round {rnd + 1}: raw loopback {nbytes / raw['median_s'] / 1e9:.2f} GB/s", flush=True)
        for cipher, k, overlap in variants:
            r = allreduce_socket.allreduce_bandwidth(k, n=n, repeats=REPEATS, cipher=cipher,
                                                    overlap=overlap)
            times[(cipher, k, overlap)].extend(r["times_s"])
            perfs[(cipher, k, overlap)].append(r["perf_per_rank"])
            print(f"round {rnd + 1}: {cipher}{'' if overlap else ' (no overlap)'} K={k}: "
                  f"median {r['median_s'] * 1e3:.0f} ms", flush=True)
    raw_s = statistics.median(raw_times)
    raw_gbps = nbytes / raw_s / 1e9
    out: dict = {
        "cpu_count": os.cpu_count(),
        "load_average_1m": {"start": load0, "end": os.getloadavg()[0]},
        "vector_bytes": nbytes,
        "ks": list(ks),
        "rounds": rounds,
        "calls_per_figure": rounds * REPEATS,
        "raw_loopback_gbps": raw_gbps,
        "raw_loopback_seconds": raw_s,
        "crypto_1MiB_single_thread": crypto_throughput(),
        "ciphers": {},
    }
    for cipher in ciphers:
        entry = {}
        for k in ks:
            entry[f"k{k}_seconds"] = statistics.median(times[(cipher, k, True)])
            entry[f"k{k}_best_seconds"] = min(times[(cipher, k, True)])
            entry[f"k{k}_gbps"] = nbytes / entry[f"k{k}_seconds"] / 1e9
            entry[f"k{k}_perf_per_rank"] = _median_perf(perfs[(cipher, k, True)])
        if 2 in ks:
            entry["k2_fraction_of_loopback"] = entry["k2_gbps"] / raw_gbps
        if 2 in ks and max(ks) > 2:
            entry[f"k{max(ks)}_over_k2_time"] = entry[f"k{max(ks)}_seconds"] / entry["k2_seconds"]
        out["ciphers"][cipher] = entry
    if DEFAULT in ciphers and no_overlap_ks:
        out["aes-gcm_no_overlap"] = {
            f"k{k}_seconds": statistics.median(times[(DEFAULT, k, False)]) for k in no_overlap_ks
        }
    for cipher in ciphers:
        e = out["ciphers"][cipher]
        cells = "  ".join(f"K={k} {e[f'k{k}_seconds'] * 1e3:6.0f} ms" for k in ks)
        share = f" ({e['k2_fraction_of_loopback']:.0%} of loopback at K=2)" if 2 in ks else ""
        print(f"{cipher:12s} {cells}{share}")
    print(f"raw loopback {raw_gbps:.2f} GB/s (median)")
    return out


def main() -> dict:
    out = measure()
    ta = tree_aggregate_seconds()
    gcm = out["ciphers"][DEFAULT]
    out["tree_aggregate"] = ta
    out["tree_aggregate_k4_seconds"] = ta["median_s"]
    out["k4_speedup_vs_tree_aggregate"] = ta["median_s"] / gcm["k4_seconds"]
    out["targets"] = {
        "k2_fraction_of_loopback": {"value": gcm["k2_fraction_of_loopback"], "target": 0.60,
                                    "met": gcm["k2_fraction_of_loopback"] >= 0.60},
        "k4_speedup_vs_tree_aggregate": {"value": out["k4_speedup_vs_tree_aggregate"], "target": 20.0,
                                         "met": out["k4_speedup_vs_tree_aggregate"] >= 20.0},
    }
    print(f"treeAggregate K={K_SPARK}: {ta['median_s'] * 1e3:.0f} ms -> aes-gcm K=4 is "
          f"{out['k4_speedup_vs_tree_aggregate']:.1f}x faster (target >= 20x)")
    return out
