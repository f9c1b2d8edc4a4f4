"""Solvers over file-backed shards (the local shard cache, ``pipeline.shard_cache``): the model of
the in-memory shard bit for bit, for every solver and a resumed run; the same input errors; and
the shard's bytes resident in the process stay within the budget over whole passes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from terascale.pipeline.shard_cache import CacheBudget, cache_csr, edge_bytes
from terascale.pipeline.shard_sink import MemorySink
from terascale.solvers.api import SolverParams
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError, NonFiniteInputError
from tests.solvers.helpers import (
    keep,
    local_numbers,
    planted_problem,
    split_rows,
    train_local,
    train_on_tree,
)


def _in_memory(data: CSRData) -> CSRData:
    """``data`` through a MemorySink, as ``read_shard`` holds it (the layout the sink picks)."""
    sink = MemorySink(data.n_rows, data.nnz)
    sink.append(np.diff(data.indptr), data.indices, None if data.binary else data.full_values(), data.labels,
                data.weights)
    return sink.finish(data.n_features)


def _collided(data: CSRData, seed: int) -> CSRData:
    """``data`` with most values 1 (hashed click data): a few exceptions per shard."""
    rng = np.random.default_rng(seed)
    v = np.where(rng.random(data.nnz) < 0.1, 2.0, 1.0).astype(np.float32)
    return CSRData(data.indptr, data.indices, v, data.labels, data.weights, data.n_features)


def _twins(data: CSRData, tmp_path, name: str, rows_per_chunk: int = 37) -> tuple[CSRData, CSRData]:
    """(in memory, file-backed with ``rows_per_chunk`` rows per block) of the same rows."""
    mem = _in_memory(data)
    disk = cache_csr(data, str(tmp_path), _budget(mem, rows_per_chunk), prefix=name, batch_rows=101)
    assert disk.chunk_rows == rows_per_chunk and isinstance(disk.indices, np.memmap)
    return mem, disk


def _budget(d: CSRData, rows: int) -> CacheBudget:
    """The budget whose blocks hold ``rows`` rows of ``d`` (and the folios at their edges)."""
    return CacheBudget(edge_bytes(4 + (d.values.size > 0) + (d.vpos.size > 0)) + rows * _row_bytes(d))


def _row_bytes(d: CSRData) -> int:
    lens = np.diff(d.indptr)
    if d.vpos.size:
        exc = np.bincount(np.searchsorted(d.indptr, d.vpos, side="right") - 1, minlength=d.n_rows)
        return 16 + int((4 * lens + 12 * exc).max())
    return 16 + int(lens.max()) * (8 if d.values.size else 4)


def _same(a, b) -> None:
    assert a.weights.tobytes() == b.weights.tobytes()
    assert a.intercept == b.intercept and a.objective == b.objective and a.stop_reason == b.stop_reason
    assert [h.get("holdout_loss") for h in a.history] == [h.get("holdout_loss") for h in b.history]


SOLVERS = {
    "online": {"passes": 3},
    "lbfgs": {"passes": 8, "early_stop_passes": 0},
    "hybrid": {"passes": 6, "online_passes": 2},
    "cocoa": {"passes": 4, "local_epochs": 2},
}


@pytest.mark.parametrize("layout", ["dense", "exceptions"])
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_a_file_backed_shard_gives_the_in_memory_model_bit_for_bit(tmp_path, solver, layout):
    data = planted_problem(n=1500, d=30, density=0.25, seed=31, weighted=True)
    if layout == "exceptions":
        data = _collided(data, 32)
    held = solver != "cocoa"
    train, hold = (data.split_held_out(np.arange(data.n_rows) % 7 == 3) if held else (data, None))
    mem, disk = _twins(train, tmp_path, "0-0")
    assert (mem.vpos.size > 0) == (layout == "exceptions")
    mem_h = disk_h = None
    if held:
        mem_h, disk_h = _twins(hold, tmp_path, "0-1", rows_per_chunk=11)
    params = SolverParams(solver=solver, l2=1e-3, **SOLVERS[solver])
    want = train_local(mem, params, holdout=mem_h, consume_data=True)
    got = train_local(disk, params, holdout=disk_h, consume_data=True)
    _same(got, want)


@pytest.mark.parametrize("penalty", ["l2", "l1"])
def test_a_regularization_path_over_a_file_backed_shard_gives_the_in_memory_model_and_renumbers_the_file(
        tmp_path, penalty):
    """train.l2 / l1 = auto from the cache: the in-memory model bit for bit (every step), and the
    steps' working table renumbered the cache's own index file in place (no copy of the indices
    in memory: the rows stream from the file every step, as with a fixed λ)."""
    data = _collided(planted_problem(n=1500, d=30, density=0.25, seed=33, weighted=True), 34)
    train, hold = data.split_held_out(np.arange(data.n_rows) % 5 == 2)
    mem, disk = _twins(train, tmp_path, "0-0")
    mem_h, disk_h = _twins(hold, tmp_path, "0-1", rows_per_chunk=13)
    other = {"l1": 1e-6} if penalty == "l2" else {"l2": 1e-6}
    params = SolverParams(solver="hybrid", passes=4, online_passes=1, **{penalty: "auto"}, **other)
    want = train_local(mem, params, holdout=mem_h, consume_data=True)
    got = train_local(disk, params, holdout=disk_h, consume_data=True)
    _same(got, want)
    assert len(got.path["steps"]) >= 3 and got.path["value"] == want.path["value"]
    assert [(r["objective"], r["holdout_loss"]) for r in got.path["steps"]] == \
        [(r["objective"], r["holdout_loss"]) for r in want.path["steps"]]
    assert isinstance(disk.indices, np.memmap)
    on_disk = np.fromfile(str(tmp_path / "0-0.indices"), np.int32)
    assert on_disk.tobytes() == local_numbers(train).tobytes() == mem.indices.tobytes()


def test_two_ranks_from_the_cache_give_the_in_memory_model_bit_for_bit(tmp_path):
    data = _collided(planted_problem(n=1200, d=25, density=0.3, seed=41), 42)
    parts = [_twins(s, tmp_path, f"{r}-0", rows_per_chunk=23) for r, s in enumerate(split_rows(data, 2))]
    params = SolverParams(solver="hybrid", passes=5, l2=1e-3)
    want = train_on_tree([m for m, _ in parts], params, consume_data=True)
    got = train_on_tree([d for _, d in parts], params, consume_data=True)
    for g, w in zip(got, want, strict=True):
        _same(g, w)


@pytest.mark.parametrize("solver", ["hybrid", "online"])
def test_a_run_resumed_from_the_cache_gives_the_uninterrupted_model(tmp_path, solver):
    data = planted_problem(n=900, d=20, density=0.3, seed=51)
    params = SolverParams(solver=solver, passes=6, l2=1e-3, online_passes=2 if solver == "hybrid" else 1)
    mem, disk = _twins(data, tmp_path, "0-0", rows_per_chunk=29)
    states: list[dict] = []
    want = train_local(mem, params, on_pass_end=keep(states), consume_data=True)
    # the run resumes from pass 3 (L-BFGS's for the hybrid) on a fresh read of the shard
    again = cache_csr(data, str(tmp_path), _budget(mem, 29), prefix="1-0")
    got = train_local(again, params, resume=states[2], consume_data=True)
    _same(got, want)
    del disk


def test_the_input_checks_find_the_same_problems_in_a_file_backed_shard(tmp_path):
    data = planted_problem(n=400, d=12, seed=61)
    bad_label = CSRData(data.indptr, data.indices, data.values, data.labels.copy(), data.weights, 12)
    bad_label.labels[333] = 0.5
    bad_value = CSRData(data.indptr, data.indices, data.values.copy(), data.labels, data.weights, 12)
    bad_value.values[int(data.indptr[250]) + 1] = np.nan
    cases = [(bad_label, InvalidInputError, r"labels\[333\] = 0.5: the logistic loss takes labels 0 or 1"),
             (bad_value, NonFiniteInputError, r"values\[\d+\] = nan \(row 250\) is not finite")]
    for i, (d, err, msg) in enumerate(cases):
        disk = cache_csr(d, str(tmp_path), _budget(_in_memory(d), 17), prefix=f"{i}-0")
        assert disk.chunk_rows == 17
        for shard in (d, disk):
            with pytest.raises(err, match=msg):
                train_local(shard, SolverParams(solver="online", l2=1e-6, passes=1))


def test_a_shuffled_pass_over_a_file_backed_shard_is_refused(tmp_path):
    data = planted_problem(n=200, d=10, seed=71)
    disk = cache_csr(data, str(tmp_path), CacheBudget(64 << 20))
    with pytest.raises(InvalidInputError, match="train.shuffle = true: a shuffled pass reads rows at random"):
        train_local(disk, SolverParams(solver="online", l2=1e-6, passes=1, shuffle=True))


# A pass over a 160 MB shard with a 32 MiB budget in a process of its own: the resident bytes
# of the cache files' mappings (/proc/self/smaps, exact) after every block and every pass, and
# the process's peak resident set over the training (VmHWM, reset before it).
RSS_SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.pipeline.shard_cache import CacheBudget, DiskSink
    from terascale.solvers.api import SolverParams, train
    from terascale.solvers.data import CSRData

    directory, budget = sys.argv[1], int(sys.argv[2])
    rows, per_row, d = 2_000_000, 16, 1 << 14

    def mapped():
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and ":" not in head[0]:
                    inside = len(head) >= 6 and head[-1].startswith(directory)
                elif inside and line.startswith("Rss:"):
                    total += int(head[1]) * 1024
        return total

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    rng = np.random.default_rng(7)
    sink = DiskSink(directory, "0-0", rows, rows * per_row, CacheBudget(budget))
    for a in range(0, rows, 100_000):
        idx = np.sort(rng.integers(0, d, (100_000, per_row)), axis=1).astype(np.int32).reshape(-1)
        y = (rng.random(100_000) < 0.3).astype(np.float32)
        sink.append(np.full(100_000, per_row, np.int64), idx, None, y, np.ones(100_000, np.float32))
    data = sink.finish(d)
    params = SolverParams(solver="hybrid", passes=3, l2=1e-4)
    tiny = CSRData(np.array([0, 2, 3], np.int64), np.array([1, 5, 2], np.int32), np.zeros(0, np.float32),
                   np.array([0, 1], np.float32), np.ones(2, np.float32), d)
    train(tiny, LocalCommunicator(), params)  # the kernels loaded before the baseline
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM
    seen = []
    result = train(data, LocalCommunicator(), params, consume_data=True,
                   progress=lambda p, r: seen.append(mapped()), on_pass_end=lambda s: seen.append(mapped()))
    print(json.dumps({"peak_mapped": max(seen), "samples": len(seen), "grew": status("VmHWM") - base,
                      "shard_bytes": data.nbytes, "chunk_rows": data.chunk_rows, "passes": result.passes,
                      "finite": bool(np.isfinite(result.weights).all())}))
''')


@pytest.mark.slow
def test_the_shards_resident_bytes_stay_within_the_budget_over_whole_passes(tmp_path):
    budget = 32 << 20
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), str(budget)], capture_output=True,
                         text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["passes"] == 3 and r["finite"] and r["samples"] > 40
    # a block: the budget less a 2 MiB folio at both edges of the 4 arrays, over 80 B rows
    assert r["shard_bytes"] > 150e6 and r["chunk_rows"] == (budget - edge_bytes(4)) // (16 + 4 * 16)
    # one block of rows (the chunk cap, 2^17 rows of 80 B = 10.5 MB) and the folios at its edges
    assert r["peak_mapped"] <= (1 << 17) * 80 + edge_bytes(4) <= budget
    # the whole run: the budget, the 8 B-per-row columns summed whole (16 MB), the model state
    # of 2^14 features and the kernels' temporaries; not the shard's 160 MB
    assert r["grew"] < budget + 8 * 2_000_000 + (16 << 20) < 0.45 * r["shard_bytes"]


def test_the_coarse_preconditioners_sample_is_gathered_with_the_same_bits(tmp_path):
    """L-BFGS's coarse matrix sums a sample of runs spread over the shard in one kernel call; from
    the cache those rows are gathered into memory first (Shard.sampled), with the same bits.
    140k rows: the sample takes every 4th run of 512 rows."""
    rng = np.random.default_rng(81)
    n, d = 140_000, 60
    per = rng.integers(1, 6, n)
    indptr = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    indices = np.concatenate([np.sort(rng.choice(d, k, replace=False)) for k in per]).astype(np.int32)
    values = np.where(rng.random(indices.size) < 0.05, 3.0, 1.0).astype(np.float32)
    labels = (rng.random(n) < 0.3).astype(np.float32)
    data = CSRData(indptr, indices, values, labels, np.ones(n, np.float32), d)
    groups = (np.arange(d) % 7).astype(np.uint8)
    groups[::11] = 255  # no group
    mem, disk = _twins(data, tmp_path, "0-0", rows_per_chunk=9000)
    assert mem.vpos.size > 0
    params = SolverParams(solver="lbfgs", passes=4, l2=1e-4, early_stop_passes=0)
    want = train_local(mem, params, groups=groups, consume_data=True)
    got = train_local(disk, params, groups=groups, consume_data=True)
    assert want.history[0]["coarse_groups"] == 7
    _same(got, want)
