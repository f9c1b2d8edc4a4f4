"""The AllReduce's window (``window_chunks`` = W, :mod:`allreduce.collective_run`): a rank sends
chunk i up only after chunk i − W of the result came down, so no flow runs ahead of the slowest
by more than the window; the sums stay the tree-order sums, bit for bit, for any W, K, length
and cipher, with and without the writer threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from terascale.allreduce.channel import Channel
from terascale.allreduce.node import TreeNode, auto_window
from terascale.allreduce.protocol import MsgType
from tests.allreduce.harness import CHUNK_BYTES, run_tree, tree_order_sum

UP = (MsgType.UP_F32, MsgType.UP_F64)
DOWN = (MsgType.DOWN_F32, MsgType.DOWN_F64)


def _data(rank: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(500 + rank)
    return rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, size=n)


@pytest.mark.parametrize("k", [2, 3, 5, 8])
@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_window_keeps_the_tree_order_sum_bit_for_bit(k, window, overlap):
    per = CHUNK_BYTES // 8
    lengths = [0, 1, per, 2 * per + 1, 9 * per + 3]

    def body(node: TreeNode):
        return [node.allreduce(_data(node.rank + 10 * i, n)) for i, n in enumerate(lengths)]

    run = run_tree(k, body, node_kwargs={"window_chunks": window, "overlap": overlap})
    for i, n in enumerate(lengths):
        want = tree_order_sum([_data(r + 10 * i, n) for r in range(k)]).tobytes()
        assert all(run.results[r][i].tobytes() == want for r in range(k)), (k, window, n)


def _events(monkeypatch) -> list[tuple[float, str, str]]:
    """(time, thread name, kind) of every data frame a rank starts to send up ("up": sealed or
    sent) and every result chunk it has received from its parent ("down")."""
    events: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def note(kind: str) -> None:
        with lock:
            events.append((time.perf_counter(), threading.current_thread().name, kind))

    seal, send, recv = Channel.seal_data, Channel.send, Channel.recv_data_into

    def seal_data(self, msg_type, view, out):
        if msg_type in UP:
            note("up")
        return seal(self, msg_type, view, out)

    def send_(self, msg_type, payload=b""):
        if msg_type in UP:
            note("up")
        return send(self, msg_type, payload)

    def recv_data_into(self, msg_type, out):
        recv(self, msg_type, out)
        if msg_type in DOWN:
            note("down")

    monkeypatch.setattr(Channel, "seal_data", seal_data)
    monkeypatch.setattr(Channel, "send", send_)
    monkeypatch.setattr(Channel, "recv_data_into", recv_data_into)
    return events


@pytest.mark.parametrize("window", [0, 2])
def test_no_rank_sends_more_than_the_window_ahead_of_the_result(monkeypatch, window):
    """The root joins the collective 0.3 s late. Without a window (0) the leaves send every chunk
    at once, into the socket buffers; with W = 2 a leaf's chunk i goes up only after result chunk
    i − 2 came down. K = 2: one leaf, whose calling thread sends up and whose downward-flow thread
    (named after its rank) receives."""
    events = _events(monkeypatch)
    n = 12 * (CHUNK_BYTES // 8)  # 12 chunks

    def body(node: TreeNode):
        threading.current_thread().name = f"rank{node.rank}-caller"
        if node.rank == 0:
            time.sleep(0.3)
        return node.allreduce(_data(node.rank, n))

    run = run_tree(2, body, node_kwargs={"window_chunks": window, "overlap": False})
    assert run.results[1].tobytes() == tree_order_sum([_data(0, n), _data(1, n)]).tobytes()
    ups = [t for t, who, kind in events if kind == "up" and who == "rank1-caller"]
    downs = [t for t, who, kind in events if kind == "down" and who.startswith("rank1-")]
    assert len(ups) == len(downs) == 12
    if window == 0:
        assert ups[-1] < downs[0]  # every chunk went up before any result came down
    else:
        assert ups[window - 1] < downs[0]  # the first W chunks go at once
        for i in range(window, 12):
            assert ups[i] > downs[i - window], i


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="window_chunks must be >= 0"):
        TreeNode(None, None, [], window_chunks=-1)  # type: ignore[arg-type]


def test_the_default_window_is_the_trees_depth_plus_two_from_three_ranks():
    assert [auto_window(k) for k in (1, 2, 3, 4, 7, 8, 1000)] == [0, 0, 3, 4, 4, 5, 11]
    for k in (1, 2, 3, 4):
        run = run_tree(k, lambda node: node.window_chunks)
        assert run.results == [auto_window(k)] * k
    assert run_tree(2, lambda node: node.window_chunks, node_kwargs={"window_chunks": 0}).results == [0, 0]
