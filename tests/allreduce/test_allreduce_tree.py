"""AllReduce / broadcast / scalars over a real tree of N worker threads on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from terascale.allreduce.communicator import Communicator, LocalCommunicator
from terascale.allreduce.node import TreeNode
from terascale.allreduce.topology import build_tree, children_of, parent_of, path_to_root
from tests.allreduce.harness import CHUNK_BYTES, run_tree, tree_order_sum

DTYPES = (np.float32, np.float64)


def _lengths(dtype) -> list[int]:
    per = CHUNK_BYTES // np.dtype(dtype).itemsize
    return [0, 1, per - 1, per, per + 1, 3 * per + 5]


def _integer_valued(shard: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 + shard)
    return rng.integers(-1000, 1000, size=n).astype(dtype)


def _random(shard: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(shard)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, size=n)).astype(dtype)


# every rank count with the default cipher (aes-gcm), a representative few with the others
@pytest.mark.parametrize(
    "n_ranks,cipher",
    [(n, "aes-gcm") for n in (1, 2, 3, 5, 8, 16)]
    + [(2, "aes-gmac"), (16, "aes-gmac"), (5, "hmac-sha256"), (16, "hmac-sha256")],
)
def test_allreduce_every_size_class(n_ranks, cipher):
    """Integer-valued data: exact equality with numpy's sum. Random data: bit-equality with a
    reference summing in tree order. Every rank gets identical bytes."""

    def body(node: TreeNode):
        out = []
        for dtype in DTYPES:
            for n in _lengths(dtype):
                out.append(("int", dtype, n, node.allreduce(_integer_valued(node.rank, n, dtype))))
                out.append(("rnd", dtype, n, node.allreduce(_random(node.rank, n, dtype))))
        return out

    run = run_tree(n_ranks, body, cipher=cipher)
    for i, (kind, dtype, n, got0) in enumerate(run.results[0]):
        make = _integer_valued if kind == "int" else _random
        inputs = [make(r, n, dtype) for r in range(n_ranks)]
        expected = np.sum(inputs, axis=0, dtype=dtype) if kind == "int" else tree_order_sum(inputs)
        assert got0.dtype == np.dtype(dtype) and got0.shape == (n,)
        assert got0.tobytes() == np.asarray(expected, dtype=dtype).tobytes(), (kind, dtype, n)
        for r in range(1, n_ranks):
            assert run.results[r][i][3].tobytes() == got0.tobytes(), (
                f"rank {r} differs ({kind}, {dtype}, {n})"
            )


def test_sum_follows_the_tree_order_not_rank_order():
    """With K=5 the tree sums (x0 + ((x1 + x3) + x4)) + x2, which float32 rounding tells apart
    from the rank order ((((x0 + x1) + x2) + x3) + x4); so the reference is not vacuous."""
    xs = [1e8, 1.0, -1e8, 1.0, 1.0]
    arrays = [np.array([x], dtype=np.float32) for x in xs]
    sequential = np.float32(0)
    for a in arrays:
        sequential = np.float32(sequential + a[0])
    assert sequential == 2.0 and tree_order_sum(arrays)[0] == 0.0
    run = run_tree(5, lambda node: node.allreduce(arrays[node.rank]))
    assert all(r[0] == 0.0 for r in run.results)


@pytest.mark.parametrize("cipher", ["aes-gcm", "aes-gmac", "hmac-sha256"])
def test_tiny_socket_buffers_and_large_frames(cipher):
    """4 KiB socket buffers with 16 KiB chunks: every frame needs many partial sends/receives."""
    n = 3 * 4096 + 17

    def body(node):
        return node.allreduce(_random(node.rank, n, np.float32)), node.allreduce(
            _random(node.rank, n, np.float64)
        )

    run = run_tree(
        5, body, node_kwargs={"chunk_bytes": 16384, "socket_buffer_bytes": 4096}, cipher=cipher
    )
    for j, dtype in enumerate(DTYPES):
        expected = tree_order_sum([_random(r, n, dtype) for r in range(5)])
        for r in range(5):
            assert run.results[r][j].tobytes() == expected.tobytes()


def test_default_chunk_size_multi_megabyte_vector():
    n = (1 << 20) + 3  # 4 MiB of float32: 5 chunks of 1 MiB, the last one partial

    def body(node):
        return node.allreduce(_integer_valued(node.rank, n, np.float32))

    run = run_tree(3, body, node_kwargs={"chunk_bytes": 1 << 20})
    expected = sum(_integer_valued(r, n, np.float32) for r in range(3))
    for r in range(3):
        assert np.array_equal(run.results[r], expected)


@pytest.mark.parametrize("n_ranks", [2, 5, 8])
def test_broadcast_from_every_root(n_ranks):
    n = 3 * (CHUNK_BYTES // 4) + 5

    def body(node):
        return [
            node.broadcast(_random(node.rank, n, np.float32), root=root)
            for root in range(node.size)
        ]

    run = run_tree(n_ranks, body)
    for root in range(n_ranks):
        expected = _random(root, n, np.float32).tobytes()
        for r in range(n_ranks):
            assert run.results[r][root].tobytes() == expected, (root, r)


def test_scalars_barrier_shapes_and_stats():
    def body(node):
        sums = node.allreduce_scalars([float(node.rank), 1.0, 0.5])
        node.barrier()
        empty = node.allreduce_scalars([])
        matrix = node.allreduce(np.full((3, 7), node.rank + 1, dtype=np.float64))
        strided = node.allreduce(np.arange(40, dtype=np.float32)[::2])
        big_endian = node.allreduce(np.ones(9, dtype=">f8"))
        return sums, empty, matrix, strided, big_endian, node.stats(), node.totals()

    run = run_tree(4, body)
    for sums, empty, matrix, strided, big_endian, stats, totals in run.results:
        assert totals == stats["totals"]
        assert sums == [6.0, 4.0, 2.0] and all(type(v) is float for v in sums)
        assert empty == []
        assert matrix.shape == (3, 7) and np.all(matrix == 10.0)
        assert np.array_equal(strided, 4 * np.arange(40, dtype=np.float32)[::2])
        assert big_endian.dtype == np.dtype("<f8") and np.all(big_endian == 4.0)
        assert len(stats["calls"]) == 6 and stats["totals"]["calls"] == 6
        for call in stats["calls"]:
            assert call["wall_s"] >= call["wait_s"] >= 0 and call["transfer_s"] >= 0
            assert abs(call["wait_s"] + call["transfer_s"] - call["wall_s"]) < 1e-9
        assert (
            stats["calls"][3]["bytes"] == 3 * 7 * 8
            and stats["calls"][0]["op"] == "allreduce_scalars"
        )


def test_unsupported_dtypes_and_roots_are_rejected_on_every_communicator():
    def body(node):
        errors = []
        for bad in (np.arange(3), np.ones(3, dtype=np.float16), np.array(["a"])):
            try:
                node.allreduce(bad)
            except TypeError as exc:
                errors.append(str(exc))
        try:
            node.broadcast(np.ones(2), root=node.size)
        except ValueError as exc:
            errors.append(str(exc))
        node.barrier()  # still usable: validation happens before any communication
        return errors

    run = run_tree(2, body)
    assert all(len(e) == 4 for e in run.results)
    local = LocalCommunicator()
    with pytest.raises(TypeError, match="float32 or float64"):
        local.allreduce(np.arange(3))
    with pytest.raises(ValueError):
        local.broadcast(np.ones(2), root=1)


def test_totals_match_stats_on_local_and_lazy_communicators():
    from terascale.allreduce.lazy import LazyCommunicator

    local = LocalCommunicator()
    lazy = LazyCommunicator(0, 1, LocalCommunicator)
    assert lazy.totals()["calls"] == 0 and not lazy.joined
    for c in (local, lazy):
        c.allreduce(np.ones(5, np.float32))
        c.allreduce_scalars([1.0])
        assert c.totals() == c.stats()["totals"] and c.totals()["calls"] == 2
    assert lazy.joined


def test_local_communicator_is_the_size_one_twin():
    with LocalCommunicator() as comm:
        assert isinstance(comm, Communicator) and (comm.rank, comm.size) == (0, 1)
        x = np.arange(10, dtype=np.float32).reshape(2, 5)
        y = comm.allreduce(x)
        assert np.array_equal(x, y) and y is not x and not np.shares_memory(x, y)
        assert np.array_equal(comm.broadcast(x), x)
        assert comm.allreduce_scalars([1.5, 2]) == [1.5, 2.0]
        comm.barrier()
        assert comm.stats()["totals"]["calls"] == 4
    with pytest.raises(RuntimeError):
        comm.allreduce(x)


def test_single_rank_tree_matches_local_communicator():
    x = _random(0, 100, np.float64)
    run = run_tree(
        1, lambda node: (node.allreduce(x), node.broadcast(x), node.allreduce_scalars([2.0]))
    )
    local = LocalCommunicator()
    assert run.results[0][0].tobytes() == local.allreduce(x).tobytes()
    assert run.results[0][1].tobytes() == x.tobytes() and run.results[0][2] == [2.0]


def test_topology_arithmetic():
    assert parent_of(0) is None and [parent_of(r) for r in (1, 2, 3, 4, 5, 6)] == [0, 0, 1, 1, 2, 2]
    assert children_of(0, 1) == () and children_of(0, 2) == (1,) and children_of(1, 5) == (3, 4)
    assert path_to_root(9) == (9, 4, 1, 0) and path_to_root(0) == (0,)
    placements = build_tree([("h", 1000 + r) for r in range(7)])
    assert [p.rank for p in placements] == list(range(7))
    assert placements[2].parent.port == 1000 and [c.rank for c in placements[2].children] == [5, 6]
    for p in placements:
        assert type(p).from_json(p.to_json()) == p


def test_no_threads_left_behind():
    before = set(threading.enumerate())
    run_tree(5, lambda node: node.allreduce(np.ones(3 * CHUNK_BYTES, dtype=np.float32)))
    deadline = time.monotonic() + 5.0
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before, [t.name for t in threading.enumerate()]


@pytest.mark.slow
def test_separate_processes_agree_bit_for_bit():
    """Ranks as real OS processes (spawned), as in production: the benchmark helper raises if
    the ranks' results differ."""
    from tests.benchmarks import allreduce_socket as bench

    r = bench.allreduce_bandwidth(3, n=100_003, repeats=1, chunk_bytes=1 << 16)
    assert r["k"] == 3 and r["best_s"] > 0


def test_results_are_owned_by_the_caller_and_their_memory_reused_once_dropped():
    """Large results come from a pool: a held result is never overwritten by a later call, a
    dropped one's memory is used again (no fresh page faults per call)."""
    import gc

    n = (1 << 20) // 4 + 1  # just over 1 MiB of float32

    def body(node):
        first = node.allreduce(np.full(n, 1.0, dtype=np.float32))
        second = node.allreduce(np.full(n, 2.0, dtype=np.float32))
        held_ok = first[0] == 2.0 and first[-1] == 2.0 and second[0] == 4.0
        address = first.__array_interface__["data"][0]
        first[:] = -1.0  # the caller may write into its result
        del first
        gc.collect()
        third = node.allreduce(np.full(n, 3.0, dtype=np.float32))
        reused = third.__array_interface__["data"][0] == address
        return held_ok, bool(second[0] == 4.0), bool((third == 6.0).all()), reused

    run = run_tree(2, body, node_kwargs={"chunk_bytes": 1 << 18})
    assert run.results == [(True, True, True, True)] * 2
