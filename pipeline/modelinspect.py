"""A model's heaviest features by |weight|, named by its token dictionary (``terascale inspect``).

A hashed bucket is named by the tokens the training data hashed to it (``pipeline.tokendict``),
copied into the model directory by train when the dataset was featurized with
``featurize.token_dictionary=true``. Several tokens may share a bucket (a hash collision): all
kept ones are listed, and ``more_possible`` says the per-bucket cap was reached. A LibSVM model
names a bucket by its feature index (bucket + ``libsvm_index_base``) and needs no dictionary.

``names``: None names features when the model can, True requires names (a model without a
dictionary is a :class:`~pipeline.modeldir.ModelError`), False lists buckets only.
"""

from __future__ import annotations

import numpy as np

from terascale.pipeline import fsutil, modeldir, tokendict
from terascale.pipeline.pointer import resolve_model
from terascale.pipeline.sampling import model_negative_rate


def top_features(model: str, top: int, names: bool | None = None) -> dict:
    path = resolve_model(model)
    w, b, meta = modeldir.load_model(path)
    spec = meta["spec"]
    entry = meta.get("dictionary")
    libsvm = spec.get("format") == "libsvm"
    if names and not libsvm and not entry:
        raise modeldir.ModelError(
            f"{model}: the model has no token dictionary, so its features cannot be named; featurize the training "
            "data with featurize.token_dictionary=true and train again (without --names, inspect lists buckets)")
    nz = np.flatnonzero(w)
    order = nz[np.argsort(-np.abs(w[nz]), kind="stable")][: max(0, top)]
    named: dict[int, list[str]] = {}
    if names is not False and entry and not libsvm:
        table = tokendict.read_table(fsutil.join(fsutil.normalize(path), entry["path"]))
        named = tokendict.lookup(table, [int(i) for i in order])
    rows = []
    for rank, i in enumerate(order.tolist(), 1):
        row = {"rank": rank, "bucket": i, "weight": float(w[i])}
        if libsvm and names is not False:
            row["tokens"] = [str(i + int(spec.get("libsvm_index_base", 1)))]
        elif entry and names is not False:
            row["tokens"] = named.get(i, [])
            row["more_possible"] = len(row["tokens"]) >= int(entry["per_bucket"])
        rows.append(row)
    return {"model": fsutil.normalize(path), "intercept": b, "features": int(w.shape[0]), "nonzeros": int(nz.shape[0]),
            "negative_rate": model_negative_rate(meta),
            "named": bool(libsvm or entry) and names is not False, "buckets_asked": names is False, "top": rows}


def render(r: dict) -> str:
    lines = [f"model {r['model']}: {r['nonzeros']:,} non-zero of {r['features']:,} weights, intercept {r['intercept']:.6g}"]
    if not r["named"]:
        lines.append("(buckets only: --no-names)" if r.get("buckets_asked") else "(no token dictionary: buckets only)")
    lines.append(f"{'rank':>4}  {'bucket':>10}  {'weight':>12}  tokens" if r["named"] else f"{'rank':>4}  {'bucket':>10}  {'weight':>12}")
    for row in r["top"]:
        s = f"{row['rank']:>4}  {row['bucket']:>10}  {row['weight']:>12.6f}"
        if r["named"]:
            toks = " | ".join(row["tokens"]) or "(not in the dictionary's sample)"
            s += "  " + toks + (" | ..." if row.get("more_possible") else "")
        lines.append(s)
    return "\n".join(lines)
