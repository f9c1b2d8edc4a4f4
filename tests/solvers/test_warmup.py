"""The kernel warm-up loads every kernel specialization the real run then calls: in a fresh
process, a run on a shard read from Parquet after :func:`solvers.warmup.warm_up` adds no
compiled overload to any kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import pyarrow as pa
    from numba.core.registry import CPUDispatcher
    import terascale.solvers.kernels.coarse, terascale.solvers.kernels.features, terascale.solvers.kernels.objective
    import terascale.solvers.kernels.online, terascale.solvers.kernels.vector, terascale.solvers.shard
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.pipeline.dataset import tables_to_csr
    from terascale.solvers.api import train
    from terascale.solvers.holdout import held_out
    from terascale.solvers.params import SolverParams
    from terascale.solvers.warmup import warm_up

    def overloads():
        out = {}
        for name, mod in list(sys.modules.items()):
            if name.startswith("terascale.solvers"):
                for attr, f in vars(mod).items():
                    if isinstance(f, CPUDispatcher):
                        out[f"{f.__module__}.{attr}"] = len(f.overloads)
        return out

    solver, period, groups = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    params = SolverParams(solver=solver, l2=1e-3, passes=5)
    warm_up(params, period, groups)
    before = overloads()
    rng = np.random.default_rng(1)
    n, d = 300, 1 << 10
    rows = [np.sort(rng.choice(d, 6, replace=False)).astype(np.int32) for _ in range(n)]
    table = pa.table({
        "label": pa.array((rng.random(n) < 0.4).astype(np.float32)),
        "weight": pa.array(np.ones(n, np.float32)),
        "indices": pa.array(rows, type=pa.list_(pa.int32())),
    })
    data, holdout = tables_to_csr([table], d), None
    if period:  # as the train task splits a shard read from one file (pipeline.dataset.holdout_mask)
        data, holdout = data.split_held_out(held_out("part-00000.parquet", 0, n, period, 0))
    gmap = (np.arange(d) % 5).astype(np.uint8) if groups else None
    train(data, LocalCommunicator(), params, holdout=holdout, groups=gmap)
    after = overloads()
    loaded = sum(before.values())
    grown = {k: (before.get(k, 0), v) for k, v in after.items() if v != before.get(k, 0)}
    print(loaded, grown)
    assert loaded >= 3, before
    assert not grown, grown
    """
)


@pytest.mark.parametrize(("solver", "period", "groups"), [
    ("hybrid", 10, True), ("hybrid", 0, False), ("lbfgs", 0, True), ("online", 10, False), ("cocoa", 0, False),
])
def test_a_warmed_up_process_loads_no_kernel_during_training(solver, period, groups):
    done = subprocess.run([sys.executable, "-c", SCRIPT, solver, str(period), "1" if groups else "0"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
