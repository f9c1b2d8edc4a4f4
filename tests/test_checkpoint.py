"""jobs.checkpoint and jobs.resume: verified, attempt-named, fenced checkpoints and the resume agreement."""

from __future__ import annotations

import logging
import os
import shutil
import threading

import numpy as np
import pytest

from terascale.allreduce.protocol import new_key
from terascale.jobs import checkpoint
from terascale.jobs.checkpoint import CheckpointError, CorruptCheckpoint, Superseded
from terascale.jobs.resume import ResumeAgreement, ResumeRestart, decide
from tests.allreduce.harness import FAST, NODE_DEFAULTS, run_tree


def _state(p: int) -> dict:
    rng = np.random.default_rng(p)
    return {"pass": p, "phase": "online", "history": [{"pass": i + 1, "objective": 1.0 / (i + 1)} for i in range(p)],
            "stop_reason": None, "intercept": 0.25 * p, "weights": rng.standard_normal(1000).astype(np.float32),
            "G": rng.random(1000)}


def _files(d) -> list[str]:
    return sorted(os.listdir(d))


def test_save_keeps_two_verified_checkpoints_named_by_attempt(tmp_path):
    d = str(tmp_path / "ck")
    checkpoint.begin_attempt(d, 0)
    for p in (1, 2, 3):
        checkpoint.save(d, p, _state(p), attempt=0)
    assert _files(d) == ["attempt-0000.fence", "pass-000002.a00.json", "pass-000002.a00.npz",
                         "pass-000003.a00.json", "pass-000003.a00.npz"]  # no temporary left behind
    entry, state, held = checkpoint.newest(d, 1)
    assert (entry.pass_no, entry.attempt, held) == (3, 0, [3, 2])
    want = _state(3)
    assert state["weights"].tobytes() == want["weights"].tobytes() and state["G"].tobytes() == want["G"].tobytes()
    assert state["history"] == want["history"] and state["intercept"] == 0.75


def test_a_checkpoint_is_streamed_to_its_file_not_built_in_memory(tmp_path):
    """Rank 0 writes the checkpoints: its memory must hold the state, not a second copy of the
    file (numpy reports its buffers to tracemalloc, so a BytesIO of the whole ``.npz`` shows)."""
    import tracemalloc

    d = str(tmp_path / "ck")
    big = np.arange(1 << 24, dtype=np.float64)  # 128 MiB
    state = {**_state(1), "weights": big}
    tracemalloc.start()
    try:
        checkpoint.save(d, 1, state, attempt=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes // 3, peak  # a few 16 MiB write buffers at most
    entry, loaded, _ = checkpoint.newest(d, 0)
    assert entry.pass_no == 1 and loaded["weights"].tobytes() == big.tobytes()
    assert loaded["G"].tobytes() == state["G"].tobytes() and loaded["history"] == state["history"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_npz", "drop_json", "garbage_json", "edit_json"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path, caplog, damage):
    d = tmp_path / "ck"
    for p in (1, 2):
        checkpoint.save(str(d), p, _state(p), attempt=0)
    npz, js = d / "pass-000002.a00.npz", d / "pass-000002.a00.json"
    if damage == "truncate":
        npz.write_bytes(npz.read_bytes()[:-100])
    elif damage == "flip":
        b = bytearray(npz.read_bytes())
        b[len(b) // 2] ^= 0x01
        npz.write_bytes(bytes(b))
    elif damage == "drop_npz":
        npz.unlink()
    elif damage == "drop_json":
        js.unlink()
    elif damage == "garbage_json":
        js.write_bytes(b"\x00{not json")
    else:  # a valid JSON whose state was edited: its recorded sha256 no longer matches
        js.write_text(js.read_text().replace('"intercept": 0.5', '"intercept": 0.6'))
    caplog.set_level(logging.WARNING, logger="terascale.train")
    entry, state, held = checkpoint.newest(str(d), 1)
    assert (entry.pass_no, held, state["intercept"]) == (1, [1], 0.25)
    named = str(js) if damage in ("garbage_json", "edit_json") else str(npz)
    assert named in caplog.text and "falling back to an older checkpoint" in caplog.text


def test_no_usable_checkpoint_is_a_checkpoint_error_naming_the_files(tmp_path):
    d = tmp_path / "ck"
    for p in (1, 2):
        checkpoint.save(str(d), p, _state(p), attempt=0)
    for p in (1, 2):
        f = d / f"pass-00000{p}.a00.npz"
        f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*pass-000002\.a00\.npz.*pass-000001\.a00\.npz"):
        checkpoint.newest(str(d), 1)
    with pytest.raises(CorruptCheckpoint, match=r"pass-000001\.a00\.npz: 50 bytes"):
        checkpoint.load(checkpoint.find(str(d), 1, 1))
    assert checkpoint.newest(str(tmp_path / "none"), 0) is None


def test_a_zombie_of_the_previous_attempt_cannot_write_into_the_new_attempts_checkpoints(tmp_path):
    d = tmp_path / "ck"
    checkpoint.begin_attempt(str(d), 0)
    for p in (1, 2):
        checkpoint.save(str(d), p, _state(p), attempt=0)
    checkpoint.begin_attempt(str(d), 1)  # the driver starts attempt 1; attempt 0 lingers on
    # what attempt 0 completed before attempt 1 started is still there to resume from
    assert checkpoint.newest(str(d), 1)[0] == checkpoint.Entry(2, 0, str(d))
    checkpoint.save(str(d), 3, _state(3), attempt=1)
    before = {n: (d / n).read_bytes() for n in _files(d)}
    # the zombie's writer sees the fence: it writes nothing and deletes nothing
    with pytest.raises(Superseded, match="attempt 0 is superseded by attempt 1"):
        checkpoint.save(str(d), 3, _state(30), attempt=0)
    with pytest.raises(Superseded):
        checkpoint.save(str(d), 4, _state(40), attempt=0)
    assert {n: (d / n).read_bytes() for n in _files(d)} == before
    # a late write that raced past the check (its files land after the fence): never used
    side = tmp_path / "side"
    checkpoint.save(str(side), 5, _state(50), attempt=0)
    for n in _files(side):
        shutil.copy(side / n, d / n)
    for attempt in (1, 2):
        assert checkpoint.newest(str(d), attempt)[0] == checkpoint.Entry(3, 1, str(d))
    checkpoint.begin_attempt(str(d), 2)  # a fence that lists the late write does not admit it
    assert checkpoint.newest(str(d), 2)[0] == checkpoint.Entry(3, 1, str(d))
    # the next save of the current attempt prunes the zombie's files, keeps the two newest usable
    checkpoint.save(str(d), 4, _state(4), attempt=2)
    assert [n for n in _files(d) if n.startswith("pass-")] == [
        "pass-000003.a01.json", "pass-000003.a01.npz", "pass-000004.a02.json", "pass-000004.a02.npz"]


def test_per_rank_checkpoints_use_the_top_directorys_fences(tmp_path):
    d = str(tmp_path / "ck")
    checkpoint.begin_attempt(d, 0)
    r1 = checkpoint.rank_dir(d, 1)
    checkpoint.save(r1, 1, _state(1), attempt=0, root=d)
    checkpoint.begin_attempt(d, 1)
    assert checkpoint.entries(r1, 1, root=d) == [checkpoint.Entry(1, 0, r1)]
    with pytest.raises(Superseded):
        checkpoint.save(r1, 2, _state(2), attempt=0, root=d)


def test_decide_picks_the_newest_pass_every_rank_holds():
    assert decide([[4, 3], [4, 3], [4]]) == 4
    assert decide([[], []]) is None
    with pytest.raises(ResumeRestart, match=r"ranks resumed from passes \[4, 3, 4\]: every rank restarts from pass 3") as e:
        decide([[4, 3], [3, 2], [4, 3]])
    assert e.value.pass_no == 3
    with pytest.raises(CheckpointError, match=r"rank 0 holds \[4\], rank 1 holds \[\]"):
        decide([[4], []])


def test_resume_agreement_rides_the_first_collective_of_a_real_tree():
    held = {0: [5, 4], 1: [4, 3], 2: [5, 4]}  # rank 1 could not verify pass 5

    def body(node):
        comm = ResumeAgreement(node, held[node.rank])
        try:
            comm.allreduce(np.ones(3))
        except ResumeRestart as r:
            return r.pass_no, comm.allreduce(np.ones(3)).tolist()  # the tree is still usable
        return None

    run = run_tree(3, body)
    assert run.results == [(4, [3.0, 3.0, 3.0])] * 3
    agreed = run_tree(2, lambda node: (ResumeAgreement(node, [7, 6]).allreduce_scalars([1.0]), node.stats()["totals"]["calls"]))
    assert [r[0] for r in agreed.results] == [[2.0], [2.0]] and agreed.results[0][1] == 2


def test_a_task_of_the_previous_attempt_cannot_join_the_new_attempts_tree():
    from terascale.allreduce.node import TreeNode

    old_key, key = new_key(), new_key()
    refused: list[BaseException] = []

    def zombie(server):
        def join():
            try:
                TreeNode.join(server.address, old_key, shard=1, attempt_id="w1-a0", **{**NODE_DEFAULTS, "connect_timeout_s": 2.0})
            except BaseException as e:  # noqa: BLE001 - what the zombie gets is the point
                refused.append(e)

        t = threading.Thread(target=join, daemon=True)
        t.start()
        t.join(10)

    run = run_tree(2, lambda node: node.allreduce(np.full(2, node.rank + 1.0)).tolist(), key=key,
                   server_kwargs={**FAST, "handshake_timeout_s": 0.5}, during=zombie)
    assert run.results == [[3.0, 3.0], [3.0, 3.0]]
    assert len(refused) == 1 and run.server.survivors() == {0: "attempt-0", 1: "attempt-1"}
    assert run.server.rejected_connections >= 1



def test_a_checkpoint_that_does_not_fit_the_run_is_a_checkpoint_error(tmp_path):
    from terascale.jobs.train_task import Inject, TaskSpec, _resume
    from terascale.solvers.api import SolverParams
    from tests.solvers.helpers import keep, planted_problem, train_local

    data = planted_problem(n=200, d=20)
    params = SolverParams(solver="online", l2=1e-6, passes=2)
    states = []
    train_local(data, params, on_pass_end=keep(states))
    d = str(tmp_path / "ck")
    checkpoint.save(d, 2, states[-1], attempt=0)

    def spec(n_features: int, params: SolverParams) -> TaskSpec:
        return TaskSpec(shards=((),), n_features=n_features, params=params, holdout_period=0, checkpoint_dir=d,
                        checkpoint_interval_s=0, staging_dir="", inject=Inject())

    entry, state, held = _resume(spec(data.n_features, params), 0, 1)
    assert (entry.pass_no, held, state["weights"].tobytes()) == (2, [2], states[-1]["weights"].tobytes())
    with pytest.raises(CheckpointError, match=r"pass-000002\.a00\.json does not fit this run: resume state: n_features = 20: the data has 21"):
        _resume(spec(data.n_features + 1, params), 0, 1)
    with pytest.raises(CheckpointError, match=r"params\.solver = 'online' differs from this run's 'lbfgs'"):
        _resume(spec(data.n_features, SolverParams(solver="lbfgs")), 0, 1)
