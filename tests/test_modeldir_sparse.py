"""The model directory's two weight storages (``pipeline.modeldir``): dense ``weights.npy`` for
models with at least half their weights non-zero (unchanged), sparse ``weights_sparse.npz``
(indices + values) below that; every reader (load_model, the pointer check, the raw-line scorer,
inspect) gives the same weights and scores from either, bit for bit; malformed files are refused."""

from __future__ import annotations

import io

import numpy as np
import pytest

from terascale.jobs.config import load_config
from terascale.pipeline import modeldir
from terascale.pipeline.modelinspect import top_features
from terascale.pipeline.pointer import check_complete
from terascale.pipeline.scorer import Scorer
from terascale.pipeline.spec import FeatureSpec

BITS = 12


def _model(path, w: np.ndarray, storage: str = "auto") -> tuple[str, dict]:
    stage = str(path) + ".tmp"
    info = modeldir.write_weights(stage, w, storage)
    cfg = load_config([], ["featurize.format=libsvm", f"featurize.bits={BITS}"])
    modeldir.commit(stage, str(path), {"spec": FeatureSpec(format="libsvm", bits=BITS, seed=0).to_json(),
                                       "intercept": -0.25, "weights": info,
                                       "config": {"train": {"loss": "logistic"},
                                                  "featurize": {"max_line_bytes": cfg.featurize.max_line_bytes}}})
    return str(path), info


def _weights(nonzero_fraction: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=1 << BITS) * 0.3).astype(np.float32)
    w[rng.random(1 << BITS) >= nonzero_fraction] = 0.0
    return w


def test_the_storage_follows_the_half_rule(tmp_path):
    n = 1 << BITS
    for k, storage in ((n // 2 - 1, "sparse"), (n // 2, "dense"), (n, "dense"), (0, "sparse")):
        w = np.zeros(n, np.float32)
        w[:k] = 1.5
        info = modeldir.write_weights(str(tmp_path / f"w{k}"), w)
        assert info == {"storage": storage, "nonzeros": k, "length": n}
        files = sorted(p.name for p in (tmp_path / f"w{k}").iterdir())
        assert files == [modeldir.WEIGHTS_SPARSE if storage == "sparse" else modeldir.WEIGHTS]
        assert modeldir.load_weights(str(tmp_path / f"w{k}"), n).tobytes() == w.tobytes()
    # the dense file is what it always was: np.save of the float32 vector
    w = np.full(n, 0.5, np.float32)
    modeldir.write_weights(str(tmp_path / "dense"), w)
    buf = io.BytesIO()
    np.save(buf, w, allow_pickle=False)
    assert (tmp_path / "dense" / modeldir.WEIGHTS).read_bytes() == buf.getvalue()


def test_every_reader_gives_the_same_weights_and_scores_from_either_storage(tmp_path):
    w = _weights(0.1)
    sparse, info = _model(tmp_path / "sparse", w)
    dense, dinfo = _model(tmp_path / "dense", w, storage="dense")
    assert info["storage"] == "sparse" and dinfo["storage"] == "dense"
    assert info["nonzeros"] == dinfo["nonzeros"] == np.count_nonzero(w)
    assert modeldir.load_metadata(sparse)["weights"] == info
    assert (tmp_path / "sparse" / modeldir.WEIGHTS_SPARSE).stat().st_size < (tmp_path / "dense" / modeldir.WEIGHTS).stat().st_size
    ws, bs, _ = modeldir.load_model(sparse)
    wd, bd, _ = modeldir.load_model(dense)
    assert ws.dtype == np.float32 and ws.tobytes() == wd.tobytes() == w.tobytes() and bs == bd
    assert check_complete(sparse)["weights"] == info
    rng = np.random.default_rng(4)
    lines = []
    for _ in range(300):
        idx = np.unique(rng.integers(1, 1 << BITS, size=rng.integers(1, 25)))
        lines.append("1 " + " ".join(f"{a}:{rng.choice(['1', '0.5', '-2'])}" for a in idx))
    got = Scorer.from_model_dir(sparse).predict_lines(lines)
    want = Scorer.from_model_dir(dense).predict_lines(lines)
    assert got.tobytes() == want.tobytes()
    a, b = top_features(sparse, 20), top_features(dense, 20)
    assert a["top"] == b["top"] and a["nonzeros"] == b["nonzeros"] == info["nonzeros"]


@pytest.mark.parametrize("case, message", [
    ("length", "4095 weights, the spec wants 4096"),
    ("order", "strictly increasing"),
    ("range", "strictly increasing in \\[0, 4096\\)"),
    ("dtype", "float32 values"),
    ("nan", "non-finite weights"),
    ("junk", "not a sparse weights file"),
])
def test_a_malformed_sparse_file_is_refused(tmp_path, case, message):
    path, _ = _model(tmp_path / "m", _weights(0.05))
    f = tmp_path / "m" / modeldir.WEIGHTS_SPARSE
    with np.load(f) as z:
        idx, val, n = z["indices"].copy(), z["values"].copy(), int(z["length"])
    if case == "length":
        n -= 1
    elif case == "order":
        idx[[0, 1]] = idx[[1, 0]]
    elif case == "range":
        idx[-1] = n
    elif case == "dtype":
        val = val.astype(np.float64)
    elif case == "nan":
        val[3] = np.nan
    if case == "junk":
        f.write_bytes(b"not a zip")
    else:
        with open(f, "wb") as out:
            np.savez(out, indices=idx, values=val, length=np.int64(n))
    with pytest.raises(modeldir.ModelError, match=message):
        modeldir.load_model(path)
    with pytest.raises(modeldir.ModelError, match=message):
        check_complete(path)


def test_a_model_without_either_weights_file_is_incomplete(tmp_path):
    path, _ = _model(tmp_path / "m", _weights(0.05))
    (tmp_path / "m" / modeldir.WEIGHTS_SPARSE).unlink()
    with pytest.raises(modeldir.ModelError, match="no weights.npy or weights_sparse.npz"):
        modeldir.load_model(path)
