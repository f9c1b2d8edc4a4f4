"""Scaling (issue 21): the cost model (``costmodel``) calibrated, then checked against K = 2..8
hosts on 1 Gbit/s shaped links, then carried to the paper's 1000 nodes; ``docs/pages/explanation/scaling.md``.

Hosts are network namespaces (``tests.multihost.netns``: 198.18.0.0/15 addresses, veth pairs to
a bridge, tc tbf at 1 Gbit/s in both directions). One rank process per host
(``scaling_rank``) runs real passes over its shard of the benchmark data (the 2M-row click
log featurized at 2^22, ``bench_memory``'s dataset; the train job's shard plan): the gradient
pass and the AllReduce of ``[g | loss | bad]`` (2^22 + 3 float64, 32 MiB) over real sockets;
the tree server binds the driver namespace's address (``scaling_driver``). No Spark.

1. Calibration (``scaling_calibrate``): the kernels' seconds per non-zero at T = 1, 2 threads;
   the AllReduce's CPU per byte (κ) and per-hop latency (ℓ) at K = 2 over an unshaped
   namespace link (and over loopback, for comparison); a pool of probe processes that measures
   the cores K concurrent processes get, just before and just after each measured run (their
   mean is the run's C: the machine's 2 cores are shared with other work, and Linux's
   autogroup scheduling gives each session an equal share, so this changes from minute to
   minute with what else runs).
2. Sweep: ``ROUNDS`` rounds over K = 2..8 (alternating order), each run ``PASSES`` passes; per
   run the model's prediction from that run's calibration beside the measurement. Figures are
   medians over the rounds. Each run also times the AllReduce alone (after a barrier, no compute)
   and reads every host's interface counters (bytes that crossed its link).
3. Effective AllReduce bandwidth at K = 4: the busiest link's payload, f(4)·n = 2n bytes, over the
   lone AllReduce's seconds (``costmodel.effective_bandwidth_bits``), against 1 Gbit/s: in the
   sweep, and in runs of the AllReduce alone (no data loaded, 2 × 5 calls), interleaved: the
   train job's settings (the window ``allreduce.window_chunks`` auto, socket buffers autotuned),
   the window off, and the window off with the buffers fixed at one chunk.
4. Diagnosis: K = 2, 3, 4 AllReduce alone at 200 Mbit/s (where the CPU is no limit), the window
   auto, the links' socket buffers left to Linux's autotuning (the train job's setting) and fixed
   at one chunk.
5. The 1000-node extrapolation with the paper's setup (``paper_extrapolation``).

``python -m tests.benchmarks.bench_scaling [--quick]``; ``--plot-from A.json[,B.json...]`` pools
the rounds of one or more results (:func:`merge`), redraws ``docs/pages/explanation/scaling.png`` and prints the
doc's tables. Writes bench-results/scaling.json (through ``make bench``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tests.benchmarks import costmodel as cm
from tests.benchmarks.common import RESULTS, ROOT, write_result

KS = tuple(range(2, 9))
ROUNDS = 3
PASSES = 3
RATE, LINK_BITS = "1gbit", 1e9
SLOW_RATE, SLOW_BITS = "200mbit", 2e8
CHUNK = 1 << 20
VECTOR_ELEMENTS = (1 << 22) + 3  # [g | loss | bad] of the 2^22-feature model, float64
DOC_PNG = ROOT / "docs" / "pages" / "explanation" / "scaling.png"

# The paper (Agarwal, Chapelle, Dudík & Langford, JMLR 2014), splice site data, Tables 2-3.
PAPER = {
    "nodes": 1000, "features": 1 << 24, "rows": 50_000_000, "nnz_per_row": 3300, "data_bytes": 3e12,
    "table2": {"without": {"q05": 29, "q50": 34, "q95": 60, "max": 758, "comm": 26},
               "with": {"q05": 29, "q50": 33, "q95": 49, "max": 63, "comm": 10}},
    "table3": {"nodes": [100, 200, 500, 1000], "comm": [5, 12, 9, 16], "median": [167, 105, 43, 34],
               "max": [462, 271, 172, 95]},
}


# ---------------------------------------------------------------------------------------------
# Runs


def _hosts(k: int) -> list[str]:
    return [f"h{i}" for i in range(k)]


def run_k(net, k: int, rank_args: list[str], timeout_s: float = 900.0) -> dict:
    """One run of ``k`` rank processes (hosts h0..h{k-1}), the tree server in the driver
    namespace: the ranks' reports and each host's counter deltas."""
    spec = [[["ip", "netns", "exec", net.ns(h)], net.addr(h)] for h in _hosts(k)]
    before = {h: net.counters(h) for h in _hosts(k)}
    t0 = time.perf_counter()
    r = net.run("driver", [sys.executable, "-m", "tests.benchmarks.scaling_driver", "--bind", net.addr("driver"),
                           "--k", str(k), "--hosts", json.dumps(spec), "--", *rank_args],
                timeout=timeout_s, check=False, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"K = {k} failed: {r.stderr[-4000:]}")
    after = {h: net.counters(h) for h in _hosts(k)}
    return {"k": k, "wall_s": wall, "reports": json.loads(r.stdout.strip().splitlines()[-1]),
            "counters": {h: {c: after[h][c] - before[h][c] for c in after[h]} for h in _hosts(k)}}


def summarize_run(run: dict) -> dict:
    """Per pass round: the pass (slowest rank, barrier to AllReduce end), the compute (median
    rank, slowest rank), the lone AllReduce (slowest rank); medians over the rounds; and the
    busiest link's bytes per AllReduce from the counters."""
    reps = run["reports"]
    rounds = len(reps[0]["rounds"])
    per = []
    for i in range(rounds):
        rr = [r["rounds"][i] for r in reps]
        comp = [x["compute_s"] for x in rr]
        per.append({"pass_s": max(x["pass_s"] for x in rr), "compute_median_s": statistics.median(comp),
                    "compute_max_s": max(comp), "allreduce_s": max(x["allreduce_s"] for x in rr),
                    "allreduce_cpu_s": sum(x.get("allreduce_cpu_s", 0.0) for x in rr)})
    out = {key: statistics.median(p[key] for p in per) for key in per[0]}
    out["rounds"] = per
    k = run["k"]
    nbytes = reps[0]["vector_bytes"]
    calls = 1 + 2 * rounds  # warm-up + per round the pass's and the lone AllReduce
    busiest = max(max(c["tx_bytes"], c["rx_bytes"]) for c in run["counters"].values())
    out.update({"k": k, "nnz_per_rank": [r["nnz"] for r in sorted(reps, key=lambda r: r["shard"])],
                "vector_bytes": nbytes, "busiest_link_bytes_per_allreduce": busiest / calls,
                "busiest_link_vectors": busiest / calls / nbytes, "model_link_factor": cm.link_factor(k),
                "effective_bandwidth_bits": cm.effective_bandwidth_bits(k, nbytes, out["allreduce_s"])})
    out["wait_s"] = out["compute_max_s"] - out["compute_median_s"]
    return out


def predict_run(summary: dict, c1: float, cores: float, net: cm.Network) -> dict:
    """The model's pass for a run: its shards' non-zeros, the kernel's c(1), the probed cores."""
    comp = cm.Compute({1: c1}, cores=cores, io_cores=float(os.cpu_count() or 1))
    return cm.pass_seconds(summary["nnz_per_rank"], summary["vector_bytes"], comp, net)


# ---------------------------------------------------------------------------------------------
# The paper's setup at 1000 nodes


def paper_extrapolation(c1: float, kappa: float, hop_latency_s: float, p_busy: tuple[float, ...] = (0.06, 0.1, 0.2),
                        spares: tuple[int, ...] = (0, 10, 50, 100), disk_bytes_per_s: float = 90e6) -> dict:
    """The model with the paper's setup (:data:`PAPER`): 1000 nodes, 2^24 features, 50k rows of
    3300 non-zeros per node. Compute: this machine's gradient kernel on a node's shard in memory,
    and the same shard streamed from a disk at ``disk_bytes_per_s`` (VW's cache file: 3 TB /
    1000 nodes per pass) for the paper's own setup. AllReduce: 1 Gbit/s links, float32 (VW) and
    float64 (terascale's L-BFGS) vectors, with the overlapped pipelined tree (this transport) and
    with reduce then broadcast one after the other. Tail: :func:`costmodel.fit_tail` to Table 2
    without speculative execution, for each assumed share of busy hosts, then S spares."""
    p = PAPER
    nodes = p["nodes"]
    rows = p["rows"] // nodes
    nnz = rows * p["nnz_per_row"]
    out: dict = {"nodes": nodes, "rows_per_node": rows, "nnz_per_node": nnz,
                 "compute_in_memory_s": nnz * c1,
                 "disk_bytes_per_node": p["data_bytes"] / nodes,
                 "compute_from_disk_s": p["data_bytes"] / nodes / disk_bytes_per_s,
                 "disk_bytes_per_s_assumed": disk_bytes_per_s,
                 "paper_rate_nnz_per_s": nnz / p["table2"]["with"]["q50"]}
    net = cm.Network(LINK_BITS, CHUNK, hop_latency_s, kappa)
    ar = {}
    for name, itemsize in (("float32", 4), ("float64", 8)):
        n = p["features"] * itemsize
        a = cm.allreduce_seconds(nodes, n, net)  # one rank per host: a core each for its CPU
        # reduce, then broadcast: each phase pipelines M chunks through D stages, an inner node's
        # link carrying 2 chunks (its children's, or to its children) per chunk step
        m_chunks, d = math.ceil(n / CHUNK), cm.tree_depth(nodes)
        two_phase = 2 * (m_chunks + d - 1) * 2 * (n / m_chunks) / net.payload_bytes_per_s
        ar[name] = {"bytes": n, "overlapped_s": a["seconds"], "terms": a, "two_phase_s": two_phase,
                    "implied_link_bits_overlapped": [3 * n * 8 / t for t in (10.0, 16.0)],
                    "implied_link_bits_two_phase": [4 * n * 8 / t for t in (10.0, 16.0)]}
    out["allreduce"] = ar
    out["depth"] = cm.tree_depth(nodes)
    out["link_factor"] = cm.link_factor(nodes)
    out["allreduce_by_nodes"] = {str(k): cm.allreduce_seconds(k, p["features"] * 4, net)["seconds"]
                                 for k in (2, 4, 8, 16, 100, 200, 500, 1000)}
    t2 = p["table2"]["without"]
    tails = {}
    for pb in p_busy:
        tail = cm.fit_tail(t2["q05"], t2["q50"], t2["q95"], t2["max"], nodes, pb)
        tails[str(pb)] = {"model": tail.__dict__,
                          "by_spares": {str(s): cm.tail_quantiles(tail, nodes, s, float(t2["q50"]), jobs=200)
                                        for s in spares}}
    out["tail"] = tails
    return out


# ---------------------------------------------------------------------------------------------
# Main


def _link_only_args(rounds: int, sockbuf: int = 0, window: str = "auto") -> list[str]:
    return ["--link-only", str(VECTOR_ELEMENTS), "--rounds", str(rounds), "--chunk-bytes", str(CHUNK),
            "--socket-buffer-bytes", str(sockbuf), "--window-chunks", window]


def _dataset() -> Path:
    """bench_memory's featurized dataset (made once under bench-results/data, with its raw logs)."""
    from tests.benchmarks import bench_memory

    made = RESULTS / "data" / f"memory-{bench_memory.ROWS}-bits{bench_memory.BITS}"
    return made if (made / "_manifest.json").exists() else bench_memory._dataset()


def main(argv: list[str] | None = None) -> dict:
    from tests.benchmarks.scaling_calibrate import CorePool, kernel_costs, link_costs
    from tests.benchmarks.scaling_driver import run_ranks
    from tests.multihost.netns import Network, unavailable

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one round, K = 2, 4, 8")
    ap.add_argument("--plot-from", default="")
    args = ap.parse_args(argv or [])
    if args.plot_from:
        res = merge([json.loads(Path(f).read_text()) for f in args.plot_from.split(",")])
        res["plot"] = str(plot(res, DOC_PNG))
        print(doc_tables(res))
        return res
    why = unavailable()
    if why:  # make bench goes on with the other benchmarks; the result says why
        print(f"bench_scaling skipped: it needs network namespaces: {why}", flush=True)
        return {"skipped": why}
    ks, rounds = ((2, 4, 8), 1) if args.quick else (KS, ROUNDS)
    dataset = str(_dataset())
    fig: dict = {"cpu_count": os.cpu_count(), "load_average_1m": {"start": os.getloadavg()[0]}, "dataset": dataset,
                 "link_rate_bits": LINK_BITS, "chunk_bytes": CHUNK, "passes_per_run": PASSES, "rounds": rounds}

    from terascale.pipeline.dataset import plan_shards, read_csr
    from terascale.pipeline.manifest import read_manifest

    m = read_manifest(dataset)
    csr = read_csr(plan_shards(dataset, 4, m)[0], 1 << int(m["spec"]["bits"]))
    print("calibrating the kernels ...", flush=True)
    fig["kernels"] = kernel_costs(csr, repeats=5)
    del csr
    c1 = fig["kernels"]["gradient"]["1"]["best_s_per_nnz"]
    print("calibrating AllReduce over loopback ...", flush=True)
    fig["link_loopback"] = link_costs(run_ranks(2, "127.0.0.1", [([], "127.0.0.1")] * 2, _link_only_args(5)))

    with CorePool(dataset, max(ks), c1) as pool, Network(["driver", *_hosts(max(ks))], rate=RATE, family="tsscale") as net:
        print("calibrating AllReduce over an unshaped namespace link ...", flush=True)
        for h in _hosts(2):
            net.shape(h, None)
        fig["link_bridge"] = link_costs(run_k(net, 2, _link_only_args(5))["reports"])
        for h in _hosts(2):
            net.shape(h, RATE)
        kappa, hop = fig["link_bridge"]["cpu_s_per_byte"], fig["link_bridge"]["hop_latency_s"]
        model_net = cm.Network(LINK_BITS, CHUNK, hop, kappa)
        runs = []
        for rnd in range(rounds):
            for k in (ks if rnd % 2 == 0 else tuple(reversed(ks))):
                before = pool.probe(k)
                run = run_k(net, k, ["--dataset", dataset, "--rounds", str(PASSES), "--chunk-bytes", str(CHUNK)])
                after = pool.probe(k)
                cores = (before["cores"] + after["cores"]) / 2
                s = summarize_run(run)
                pred = predict_run(s, 1.0 / after["best_solo_rate_nnz_per_s"], cores, model_net)
                runs.append({"round": rnd, "k": k, "cores": cores, "probe_before": before, "probe_after": after,
                             "measured": s, "predicted": pred})
                print(f"round {rnd + 1} K={k}: cores {before['cores']:.2f}/{after['cores']:.2f}; "
                      f"pass measured {s['pass_s']:.2f} s, "
                      f"predicted {pred['seconds']:.2f} s; AllReduce alone {s['allreduce_s']:.3f} s "
                      f"(predicted {pred['allreduce_s']:.3f}); busiest link {s['busiest_link_vectors']:.2f} vectors",
                      flush=True)
        fig["runs"] = runs
        print("K = 4 AllReduce alone: the window auto and off, socket buffers auto and fixed at one chunk ...",
              flush=True)
        k4 = []
        for _ in range(2):
            for window, sockbuf in (("auto", 0), ("0", 0), ("0", CHUNK)):
                r = summarize_link_run(run_k(net, 4, _link_only_args(5, sockbuf, window)), LINK_BITS)
                r["socket_buffer_bytes"], r["window_chunks"] = sockbuf, window
                k4.append(r)
                print(f"1 Gbit/s K=4 window {window} socket buffers {sockbuf or 'auto'}: {r['seconds']:.3f} s, "
                      f"{r['fraction_of_link']:.0%} of the link", flush=True)
        fig["k4_link_only"] = k4
        print("diagnosis at 200 Mbit/s ...", flush=True)
        for h in _hosts(4):
            net.shape(h, SLOW_RATE)
        diag = []
        for k in (2, 3, 4):
            for sockbuf in (0, CHUNK):
                r = summarize_link_run(run_k(net, k, _link_only_args(3, sockbuf)), SLOW_BITS)
                r["socket_buffer_bytes"] = sockbuf
                diag.append(r)
                print(f"200 Mbit/s K={k} socket buffers {sockbuf or 'auto'}: {r['seconds']:.2f} s, "
                      f"{r['fraction_of_link']:.0%} of the link", flush=True)
        fig["diagnosis_200mbit"] = diag
    fig["load_average_1m"]["end"] = os.getloadavg()[0]
    fig["per_k"] = per_k(runs, ks)
    k4 = fig["per_k"]["4"]
    fig["k4_effective_bandwidth"] = {"bits_per_s": k4["effective_bandwidth_bits"],
                                     "fraction_of_link": k4["effective_bandwidth_bits"] / LINK_BITS,
                                     "ceiling_fraction": cm.payload_efficiency(), "target": 0.8}
    fig["paper"] = paper_extrapolation(c1, kappa, hop)
    fig["targets"] = _targets(fig["per_k"])
    fig["plot"] = str(plot(fig, DOC_PNG))
    print(markdown_table(fig))
    return fig


def merge(results: list[dict]) -> dict:
    """Several sweeps as one: their runs pooled (rounds renumbered in order), the K = 4 and
    200 Mbit/s AllReduce runs pooled, the per-K medians and targets recomputed over all rounds;
    calibration and the 1000-node extrapolation from the last sweep."""
    out = dict(results[-1])
    if len(results) == 1:
        return out
    runs, offset = [], 0
    for res in results:
        for r in res["runs"]:
            runs.append({**r, "round": r["round"] + offset})
        offset += res["rounds"]
    out["runs"], out["rounds"], out["sweeps"] = runs, offset, len(results)
    out["k4_link_only"] = [r for res in results for r in res.get("k4_link_only", [])]
    out["diagnosis_200mbit"] = [r for res in results for r in res.get("diagnosis_200mbit", [])]
    out["calibrations"] = [{key: res[key] for key in ("kernels", "link_bridge", "link_loopback")} for res in results]
    ks = sorted({r["k"] for r in runs})
    out["per_k"] = per_k(runs, ks)
    k4 = out["per_k"]["4"]
    out["k4_effective_bandwidth"] = {**out["k4_effective_bandwidth"], "bits_per_s": k4["effective_bandwidth_bits"],
                                     "fraction_of_link": k4["effective_bandwidth_bits"] / LINK_BITS}
    out["targets"] = _targets(out["per_k"])
    return out


def _targets(pk: dict) -> dict:
    frac = pk["4"]["effective_bandwidth_bits"] / LINK_BITS
    worst = max(abs(v["pass_error"]) for v in pk.values())
    return {"k4_effective_bandwidth_fraction": {"value": frac, "target": 0.8, "met": frac >= 0.8},
            "max_abs_pass_error": {"value": worst, "target": 0.25, "met": worst <= 0.25}}


def summarize_link_run(run: dict, link_bits: float) -> dict:
    """A ``--link-only`` run: the slowest rank's median call and its share of the link."""
    reps = run["reports"]
    calls = len(reps[0]["rounds"])
    t = statistics.median(max(r["rounds"][i]["allreduce_s"] for r in reps) for i in range(calls))
    eff = cm.effective_bandwidth_bits(run["k"], reps[0]["vector_bytes"], t)
    return {"k": run["k"], "seconds": t, "effective_bandwidth_bits": eff, "fraction_of_link": eff / link_bits}


def per_k(runs: list[dict], ks) -> dict:
    """Medians over the rounds per K: measured and predicted pass and its terms, errors."""
    out = {}
    for k in ks:
        rs = [r for r in runs if r["k"] == k]
        med = {key: statistics.median(r["measured"][key] for r in rs)
               for key in ("pass_s", "compute_median_s", "compute_max_s", "wait_s", "allreduce_s",
                           "busiest_link_vectors", "effective_bandwidth_bits")}
        pred = {key: statistics.median(r["predicted"][key] for r in rs)
                for key in ("seconds", "compute_s", "wait_s", "allreduce_s", "allreduce_link_s", "allreduce_cpu_s")}
        out[str(k)] = {**med, **{f"pred_{key}": v for key, v in pred.items()},
                       "cores": statistics.median(r["cores"] for r in rs),
                       "pass_errors": [r["predicted"]["seconds"] / r["measured"]["pass_s"] - 1 for r in rs],
                       "pass_error": pred["seconds"] / med["pass_s"] - 1,
                       "allreduce_error": pred["allreduce_s"] / med["allreduce_s"] - 1,
                       "pass_min_s": min(r["measured"]["pass_s"] for r in rs),
                       "pass_max_s": max(r["measured"]["pass_s"] for r in rs),
                       "link_factor": cm.link_factor(k)}
    return out


def doc_tables(fig: dict) -> str:
    """The docs/pages/explanation/scaling.md tables of a result: calibration, the sweep, K = 4, the 1000 nodes."""
    k = fig["kernels"]
    lb, lo = fig["link_bridge"], fig["link_loopback"]
    ns = lambda x: f"{x * 1e9:.1f} ns"  # noqa: E731
    cal = ["| input | value | from |", "|---|---|---|",
           f"| c(1), gradient pass | {ns(k['gradient']['1']['best_s_per_nnz'])} per non-zero "
           f"(median {ns(k['gradient']['1']['median_s_per_nnz'])}) | `kernel_costs`, {k['rows']:,} rows, "
           f"{k['nnz']:,} non-zeros, best of 5 |",
           f"| c(2), gradient pass | {ns(k['gradient']['2']['best_s_per_nnz'])} (median "
           f"{ns(k['gradient']['2']['median_s_per_nnz'])}) | the same, 2 threads |",
           f"| c(1), c(2), online pass | {ns(k['online']['1']['best_s_per_nnz'])}, "
           f"{ns(k['online']['2']['best_s_per_nnz'])} | the same (not used by the sweep) |",
           f"| κ, AllReduce CPU per byte and edge direction | {lb['cpu_s_per_byte'] * 1e9:.2f} ns "
           f"(loopback {lo['cpu_s_per_byte'] * 1e9:.2f} ns) | K = 2 over an unshaped namespace link, "
           "32 MiB, median of 5 |",
           f"| ℓ, per-hop latency | {lb['hop_latency_s'] * 1e3:.2f} ms (loopback {lo['hop_latency_s'] * 1e3:.2f} ms) "
           "| 4-scalar AllReduce at K = 2, / 2 |",
           "| B, payload rate | 1 Gbit/s × 0.956 = 119.5 MB/s | tbf rate, MTU 1500 |",
           f"| C, cores for compute | per run, {_cores_range(fig)} (table below: medians) | probes before and after each run |",
           "| C_io | 2 | the machine's cores |"]
    sweep = markdown_table(fig)
    ek = fig["k4_effective_bandwidth"]
    k4 = [f"Sweep (the AllReduce alone in the K = 4 runs: the median over {fig['rounds']} rounds of each run's median "
          f"of {fig['passes_per_run']} calls): "
          f"{ek['bits_per_s'] / 1e9:.3f} Gbit/s = {ek['fraction_of_link']:.0%} of the link "
          f"(ceiling {ek['ceiling_fraction']:.1%}).", "",
          "| run | window | socket buffers | seconds | effective bandwidth | share of 1 Gbit/s |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(fig.get("k4_link_only", [])):
        window = r.get("window_chunks", "0")  # runs from before the window: none
        k4.append(f"| {i + 1} | {'auto (4)' if window == 'auto' else 'off'} | "
                  f"{'autotuned' if not r['socket_buffer_bytes'] else '1 MiB fixed'} | {r['seconds']:.3f} | "
                  f"{r['effective_bandwidth_bits'] / 1e9:.3f} Gbit/s | {r['fraction_of_link']:.0%} |")
    k4 += ["", "| 200 Mbit/s links | K = 2 | K = 3 | K = 4 |", "|---|---|---|---|"]
    diag = fig.get("diagnosis_200mbit", [])
    for sb, name in ((0, "autotuned"), (CHUNK, "1 MiB fixed")):
        cells = [" / ".join(f"{r['fraction_of_link']:.0%}" for r in diag if r["socket_buffer_bytes"] == sb and r["k"] == kk)
                 for kk in (2, 3, 4)]
        k4.append(f"| socket buffers {name} (one figure per sweep) | " + " | ".join(cells) + " |")
    return "\n\n".join(["\n".join(cal), sweep, "\n".join(k4), paper_table(fig["paper"])])


def _cores_range(fig: dict) -> str:
    """The range of the probes' cores over every run (both probes of each)."""
    c = [p["cores"] for r in fig.get("runs", []) for p in (r["probe_before"], r["probe_after"])]
    return f"{min(c):.2f}–{max(c):.2f}" if c else "n/a"


def paper_table(p: dict) -> str:
    """The 1000-node comparison table."""
    t2 = PAPER["table2"]
    ar = p["allreduce"]
    tails = p["tail"]
    rows = ["| per pass, 1000 nodes | paper | model | notes |", "|---|---|---|---|",
            f"| median compute | 33–34 s (Table 2), 34 s (Table 3) | {p['compute_from_disk_s']:.0f} s streamed from "
            f"disk at {p['disk_bytes_per_s_assumed'] / 1e6:.0f} MB/s; {p['compute_in_memory_s']:.1f} s in memory "
            f"(this machine's kernel) | {p['nnz_per_node'] / 1e6:.0f}M non-zeros per node |",
            f"| communication | 10–16 s (26 s in the run without spares) | {ar['float32']['overlapped_s']:.1f} s float32, "
            f"{ar['float64']['overlapped_s']:.1f} s float64 (overlapped); {ar['float32']['two_phase_s']:.1f} s float32 "
            "reduce-then-broadcast | 1 Gbit/s, f = 3, depth 9, 1 MiB chunks |"]
    for pb in ("0.06", "0.1", "0.2"):
        t = tails[pb]
        m = t["model"]
        b0, b50 = t["by_spares"]["0"], t["by_spares"]["50"]
        b10 = t["by_spares"]["10"]
        rows.append(f"| tail, p_busy = {float(pb):.0%} (σ = {m['sigma']:.3f}, busy × {m['busy_factor']:.2f}) | "
                    f"without: 5/50/95% {t2['without']['q05']}/{t2['without']['q50']}/{t2['without']['q95']} s, "
                    f"max {t2['without']['max']} s; with: {t2['with']['q05']}/{t2['with']['q50']}/{t2['with']['q95']} s, "
                    f"max {t2['with']['max']} s | 0 spares: {b0['q05']:.0f}/{b0['q50']:.0f}/{b0['q95']:.0f} s, max "
                    f"{b0['max']:.0f} s; 10 spares: 95% {b10['q95']:.0f} s, max {b10['max']:.0f} s; 50 spares: "
                    f"{b50['q05']:.0f}/{b50['q50']:.0f}/{b50['q95']:.0f} s, max {b50['max']:.0f} s ({b50['replaced']:.0f} "
                    "shards won by spares) | medians over 200 simulated jobs |")
    return "\n".join(rows)


def markdown_table(fig: dict) -> str:
    rows = ["| K | C (cores) | compute, median rank (s) | wait (s) | pass measured (s) | pass predicted (s) | error "
            "| error per round | AllReduce alone measured (s) | predicted (s) | busiest link (vectors) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, v in fig["per_k"].items():
        per = " ".join(f"{e:+.0%}" for e in v["pass_errors"])
        rows.append(f"| {k} | {v['cores']:.2f} | {v['compute_median_s']:.2f} | {v['wait_s']:.2f} | {v['pass_s']:.2f} | "
                    f"{v['pred_seconds']:.2f} | **{v['pass_error']:+.0%}** | {per} | {v['allreduce_s']:.3f} | "
                    f"{v['pred_allreduce_s']:.3f} | {v['busiest_link_vectors']:.2f} (f = {v['link_factor']}) |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Plot


def plot(fig: dict, path: Path) -> Path:
    """Three panels: the pass predicted and measured against K; the AllReduce alone predicted and
    measured against K with its effective bandwidth; the 1000-node tail with and without spares."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pk = fig["per_k"]
    ks = [int(k) for k in pk]
    f, ax = plt.subplots(1, 3, figsize=(15, 4.4))
    a = ax[0]
    meas = [pk[str(k)]["pass_s"] for k in ks]
    lo = [pk[str(k)]["pass_s"] - pk[str(k)]["pass_min_s"] for k in ks]
    hi = [pk[str(k)]["pass_max_s"] - pk[str(k)]["pass_s"] for k in ks]
    comp = np.array([pk[str(k)]["pred_compute_s"] for k in ks])
    wait = np.array([pk[str(k)]["pred_wait_s"] for k in ks])
    arr = np.array([pk[str(k)]["pred_allreduce_s"] for k in ks])
    a.bar(ks, comp, 0.6, color="#9ecae1", label="predicted: compute (median rank)")
    a.bar(ks, wait, 0.6, bottom=comp, color="#fdae6b", label="predicted: wait for the slowest")
    a.bar(ks, arr, 0.6, bottom=comp + wait, color="#a1d99b", label="predicted: AllReduce")
    a.errorbar(ks, meas, yerr=[lo, hi], fmt="ko-", capsize=3, label="measured pass (median, min-max)")
    a.set_xlabel("hosts K (1 Gbit/s links)")
    a.set_ylabel("seconds per pass")
    a.set_title("One pass: gradient + AllReduce of 32 MiB")
    a.legend(fontsize=7, loc="upper left")
    a = ax[1]
    a.plot(ks, [pk[str(k)]["allreduce_s"] for k in ks], "ko-", label="measured (median)")
    a.plot(ks, [pk[str(k)]["pred_allreduce_s"] for k in ks], "s--", color="#31a354", label="predicted")
    a.plot(ks, [pk[str(k)]["pred_allreduce_link_s"] for k in ks], ":", color="#31a354", label="predicted: link term")
    a.set_xlabel("hosts K")
    a.set_ylabel("seconds (AllReduce alone)")
    a.set_title("AllReduce of 32 MiB over 1 Gbit/s links")
    b = a.twinx()
    b.plot(ks, [pk[str(k)]["effective_bandwidth_bits"] / 1e9 for k in ks], "^-", color="#e6550d", alpha=0.7,
           label="effective bandwidth (right)")
    b.axhline(0.8, color="#e6550d", lw=0.8, ls="--")
    b.set_ylim(0, 1.05)
    b.set_ylabel("Gbit/s: f(K)·n / time", color="#e6550d")
    h1, l1 = a.get_legend_handles_labels()
    h2, l2 = b.get_legend_handles_labels()
    a.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    a = ax[2]
    paper = fig["paper"]
    t10 = paper["tail"]["0.1"]
    tail = cm.TailModel(**t10["model"])
    xs = np.geomspace(20, 1000, 400)
    a.plot(xs, 1 - cm.mixture_cdf(tail, xs / 34.0), color="#756bb1", label="model: one host (p_busy = 10%)")
    rng = np.random.default_rng(1)
    for s, col in ((0, "#de2d26"), (50, "#3182bd")):
        sim = cm.simulate_cluster(tail, 1000, s, 34.0, rng)
        srt = np.sort(sim["later"])
        a.step(srt, 1 - np.arange(srt.size) / srt.size, where="post", color=col, alpha=0.8,
               label=f"one simulated job of 1000, {s} spares (max {srt[-1]:.0f} s)")
    for key, mk, col in (("without", "x", "#de2d26"), ("with", "o", "#3182bd")):
        t = fig_paper_quantiles(key)
        a.plot(t, [0.95, 0.5, 0.05, 0.001], mk, color=col, ms=8, mfc="none",
               label=f"paper Table 2, {key} spec. exec.: 5/50/95%, max")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlim(20, 1000)
    a.set_xticks([20, 50, 100, 200, 500, 1000], ["20", "50", "100", "200", "500", "1000"])
    a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_ylim(5e-4, 1.2)
    a.set_xlabel("seconds of compute per pass, later passes (1000 nodes)")
    a.set_ylabel("share of hosts at least this slow")
    a.set_title("1000 nodes: the slow-host tail")
    a.legend(fontsize=7, loc="upper right")
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path, dpi=110)
    plt.close(f)
    return path


def fig_paper_quantiles(key: str) -> list[float]:
    t = PAPER["table2"][key]
    return [t["q05"], t["q50"], t["q95"], t["max"]]


if __name__ == "__main__":
    res = main(sys.argv[1:])
    print(write_result("scaling", res))
