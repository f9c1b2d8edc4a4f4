"""A synthetic ad-log table with a planted logistic truth, for ``featurize.format = table``.

``generate_adlog(rows, seed, click_rate)`` returns the table (Arrow) and the true click
probability of every row; ``write_adlog(out_dir, rows, ...)`` writes it as Parquet files
``out_dir/parquet/part-00000.parquet ...`` and JSON lines ``out_dir/json/part-00000.json ...``
(rows split evenly, in order) plus ``out_dir/truth.json``. ``ADLOG_SPEC_YAML`` is a featurize
configuration for it (a table spec, ``pipeline.table_spec``). numpy and pyarrow only.

The columns (``SCHEMA``)
    ``ts`` timestamp[us] (UTC wall time, whole seconds), 7 days from 2026-11-20 00:00, non-
    decreasing with the row number (later rows are later traffic) with a diurnal shape;
    ``hour`` int32, the hour of ts; ``site_id`` string (Zipf over 20,000 ids like ``s3f9a1``,
    5% null); ``app_id`` string (Zipf over 5,000 ids like ``a07c2e``, 30% null); ``device_id``
    int64 (Zipf over 200,000 ids, 10% null); ``device_type`` string (5 values); ``banner_pos``
    int32 (0..7); ``price`` double (lognormal, 8% null); ``user_segments`` list<string> (0 to 8
    distinct of 300 segments ``seg000``.., popular ones first, ascending popularity rank; 15%
    empty, 3% null); ``interests`` map<string, double> (0 to 4 distinct topics, score in
    (0, 1] with 3 decimals); ``clicked`` bool; ``weight`` double (2.0 for about 10% of the rows,
    else 1.0, independent of everything else).

The planted truth
    logit = intercept + site effect + app effect (a null app_id has an effect of its own) +
    device_type effect + banner_pos effect + hour effect (a daily wave plus noise) + the
    effects of 12 of the user segments (summed over the row's segments) + a site_id x
    banner_pos effect + c * log1p(price) (0 for a null price); a null site_id has no site or
    cross effect. device_id, interests, ts (beyond its hour) and weight carry no signal. All
    effects are drawn from ``SeedSequence(seed, spawn_key=(0,))``, so two seeds are two
    different worlds (split one data set by ts for a train and a test set). The intercept is
    solved by bisection so that the mean probability over a fixed calibration sample of
    ``CALIBRATION_ROWS`` rows (``spawn_key=(1,)``) is ``click_rate``; clicked ~ Bernoulli(p).

Determinism
    Rows are drawn in blocks of ``BLOCK_ROWS``: block b uses its own generator from
    ``SeedSequence(seed, spawn_key=(2, b))``, so the rows are a function of (rows, seed,
    click_rate) only: the same whatever ``chunk_rows`` (the rows held in memory at once,
    default ``CHUNK_ROWS``), the number of files or the order they are written in (``rows``
    matters only through ts: the 7 days are spread over all the rows).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

GENERATOR_VERSION = 1
BLOCK_ROWS = 1 << 16  # the unit of randomness (part of the data's definition: do not change)
CHUNK_ROWS = 1 << 20  # rows generated and held at once by default (a multiple of BLOCK_ROWS)
ROW_GROUP_ROWS = 1 << 17
CALIBRATION_ROWS = 200_000
START = _dt.datetime(2026, 11, 20, tzinfo=_dt.UTC)
DAYS = 7
N_SITES, N_APPS, N_DEVICES, N_SEGMENTS = 20_000, 5_000, 200_000, 300
DEVICE_TYPES = ("phone", "tablet", "desktop", "ctv", "unknown")
DEVICE_TYPE_P = (0.62, 0.14, 0.18, 0.03, 0.03)
BANNER_POS_P = (0.55, 0.25, 0.07, 0.05, 0.03, 0.02, 0.02, 0.01)
SEGMENT_COUNT_P = (0.15, 0.15, 0.15, 0.13, 0.12, 0.10, 0.08, 0.07, 0.05)  # 0..8 segments
INTERESTS = ("autos", "beauty", "books", "business", "cooking", "crypto", "diy", "education",
             "fashion", "finance", "fitness", "food", "gaming", "gardening", "health", "home",
             "movies", "music", "news", "outdoors", "parenting", "pets", "photography", "politics",
             "realestate", "science", "shopping", "sports", "tech", "travel", "tv", "weddings")
INTEREST_COUNT_P = (0.3, 0.3, 0.2, 0.12, 0.08)  # 0..4 interests
NULL_RATE = {"site_id": 0.05, "app_id": 0.30, "device_id": 0.10, "price": 0.08, "user_segments": 0.03}
WEIGHTED_RATE = 0.10

SCHEMA = pa.schema([
    ("ts", pa.timestamp("us")), ("hour", pa.int32()), ("site_id", pa.string()), ("app_id", pa.string()),
    ("device_id", pa.int64()), ("device_type", pa.string()), ("banner_pos", pa.int32()),
    ("price", pa.float64()), ("user_segments", pa.list_(pa.string())),
    ("interests", pa.map_(pa.string(), pa.float64())), ("clicked", pa.bool_()), ("weight", pa.float64()),
])

ADLOG_SPEC_YAML = """\
featurize:
  format: table
  bits: 20
  label: clicked
  weight: weight
  columns:
    - site_id
    - {name: app_id, missing: token}
    - device_id
    - device_type
    - banner_pos
    - hour
    - {name: price, kind: numeric, bucketing: quantile, quantiles: 16}
    - {name: user_segments, kind: multi, max_values: 16}
    - {name: interests, kind: map}
  crosses: [[site_id, banner_pos]]
"""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))


def _zipf_cdf(n: int, s: float) -> np.ndarray:
    c = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -s)
    return c / c[-1]


def _zipf(rng: np.random.Generator, cdf: np.ndarray, size) -> np.ndarray:
    """Ranks 0..len(cdf)-1 (0 the most popular)."""
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), cdf.shape[0] - 1)


def _diurnal_grid() -> tuple[np.ndarray, np.ndarray]:
    """(cumulative traffic share, second) per minute of the 7 days: traffic peaks at 15:00 UTC."""
    minutes = np.arange(DAYS * 1440)
    rate = 1.0 + 0.6 * np.sin(2 * np.pi * ((minutes % 1440) / 60.0 - 9.0) / 24.0)
    cum = np.concatenate([[0.0], np.cumsum(rate)])
    return cum / cum[-1], np.arange(DAYS * 1440 + 1) * 60.0


@functools.lru_cache(maxsize=8)
def _model(seed: int, click_rate: float) -> dict:
    """The vocabularies and planted effects of a seed, and the intercept for ``click_rate``."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(0,))))
    m = {
        "site_text": pa.array([f"s{v:05x}" for v in rng.choice(16**5, N_SITES, replace=False)]),
        "app_text": pa.array([f"a{v:05x}" for v in rng.choice(16**5, N_APPS, replace=False)]),
        "device_ids": rng.choice(9 * 10**11, N_DEVICES, replace=False) + 10**11,
        "segment_text": pa.array([f"seg{k:03d}" for k in range(N_SEGMENTS)]),
        "interest_text": pa.array(INTERESTS),
        "site_cdf": _zipf_cdf(N_SITES, 1.05), "app_cdf": _zipf_cdf(N_APPS, 1.1),
        "device_cdf": _zipf_cdf(N_DEVICES, 1.0), "segment_cdf": _zipf_cdf(N_SEGMENTS, 0.8),
        "interest_cdf": _zipf_cdf(len(INTERESTS), 0.6), "diurnal": _diurnal_grid(),
        "site_eff": rng.normal(0, 0.5, N_SITES), "app_eff": rng.normal(0, 0.4, N_APPS),
        "app_null_eff": rng.normal(0, 0.4), "type_eff": rng.normal(0, 0.3, len(DEVICE_TYPES)),
        "pos_eff": rng.normal(0, 0.4, len(BANNER_POS_P)),
        "hour_eff": rng.uniform(0.2, 0.4) * np.cos(2 * np.pi * (np.arange(24) - rng.uniform(0, 24)) / 24)
        + rng.normal(0, 0.1, 24),
        "seg_eff": np.zeros(N_SEGMENTS), "cross_eff": rng.normal(0, 0.4, (N_SITES, len(BANNER_POS_P))),
        "price_coef": rng.uniform(0.2, 0.5) * rng.choice((-1.0, 1.0)),
    }
    m["seg_eff"][rng.choice(60, 12, replace=False)] = rng.normal(0, 0.6, 12)
    crng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(1,))))
    _, z = _draw(m, crng, np.arange(CALIBRATION_ROWS), CALIBRATION_ROWS)
    lo, hi = -30.0, 30.0
    for _ in range(60):  # mean sigmoid(b + z) increases with b
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _sigmoid(mid + z).mean() < click_rate else (lo, mid)
    m["intercept"] = 0.5 * (lo + hi)
    return m


def _distinct(ranks: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the distinct ones of its first ``counts`` ranks in ascending order: (int32
    offsets, flat ranks)."""
    big = np.iinfo(np.int64).max
    r = np.where(np.arange(ranks.shape[1]) < counts[:, None], ranks, big)
    r.sort(axis=1)
    keep = r != big
    keep[:, 1:] &= r[:, 1:] != r[:, :-1]
    offsets = np.zeros(ranks.shape[0] + 1, np.int32)
    np.cumsum(keep.sum(axis=1), out=offsets[1:])
    return offsets, r[keep]


def _draw(m: dict, rng: np.random.Generator, idx: np.ndarray, rows: int) -> tuple[dict, np.ndarray]:
    """The feature columns of rows ``idx`` (of ``rows``) and their logit without the intercept."""
    n = idx.shape[0]
    cum, grid = m["diurnal"]
    sec = np.floor(np.interp((idx + rng.random(n)) / max(rows, 1), cum, grid)).astype(np.int64)
    hour = (sec // 3600) % 24
    site, site_null = _zipf(rng, m["site_cdf"], n), rng.random(n) < NULL_RATE["site_id"]
    app, app_null = _zipf(rng, m["app_cdf"], n), rng.random(n) < NULL_RATE["app_id"]
    dev, dev_null = _zipf(rng, m["device_cdf"], n), rng.random(n) < NULL_RATE["device_id"]
    dtype = rng.choice(len(DEVICE_TYPES), n, p=DEVICE_TYPE_P)
    pos = rng.choice(len(BANNER_POS_P), n, p=BANNER_POS_P)
    price, price_null = rng.lognormal(0.3, 0.9, n), rng.random(n) < NULL_RATE["price"]
    seg_null = rng.random(n) < NULL_RATE["user_segments"]
    seg_k = np.where(seg_null, 0, rng.choice(len(SEGMENT_COUNT_P), n, p=SEGMENT_COUNT_P))
    seg_off, seg = _distinct(_zipf(rng, m["segment_cdf"], (n, 8)), seg_k)
    int_off, topic = _distinct(_zipf(rng, m["interest_cdf"], (n, 4)),
                               rng.choice(len(INTEREST_COUNT_P), n, p=INTEREST_COUNT_P))
    score = np.ceil(rng.random(topic.shape[0]) * 1000.0) / 1000.0  # (0, 1]
    score = np.where(score > 0, score, 0.001)
    weight = np.where(rng.random(n) < WEIGHTED_RATE, 2.0, 1.0)
    z = (np.where(site_null, 0.0, m["site_eff"][site] + m["cross_eff"][site, pos])
         + np.where(app_null, m["app_null_eff"], m["app_eff"][app])
         + m["type_eff"][dtype] + m["pos_eff"][pos] + m["hour_eff"][hour]
         + np.bincount(np.repeat(np.arange(n), np.diff(seg_off)), m["seg_eff"][seg], minlength=n)
         + np.where(price_null, 0.0, m["price_coef"] * np.log1p(price)))
    cols = {
        "ts": pa.array((int(START.timestamp()) + sec) * 1_000_000, pa.int64()).cast(pa.timestamp("us")),
        "hour": pa.array(hour.astype(np.int32)),
        "site_id": m["site_text"].take(pa.array(site, mask=site_null)),
        "app_id": m["app_text"].take(pa.array(app, mask=app_null)),
        "device_id": pa.array(m["device_ids"][dev], pa.int64(), mask=dev_null),
        "device_type": pa.array(DEVICE_TYPES).take(pa.array(dtype)),
        "banner_pos": pa.array(pos.astype(np.int32)),
        "price": pa.array(price, pa.float64(), mask=price_null),
        "user_segments": pa.ListArray.from_arrays(pa.array(seg_off), m["segment_text"].take(pa.array(seg)),
                                                  mask=pa.array(seg_null)),
        "interests": pa.MapArray.from_arrays(pa.array(int_off), m["interest_text"].take(pa.array(topic)),
                                             pa.array(score)),
        "weight": pa.array(weight),
    }
    return cols, z


def _block(seed: int, click_rate: float, rows: int, b: int) -> tuple[pa.Table, np.ndarray]:
    """Block b of the data: its rows as a table of ``SCHEMA`` and their click probabilities."""
    m = _model(seed, click_rate)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(2, b))))
    idx = np.arange(b * BLOCK_ROWS, min((b + 1) * BLOCK_ROWS, rows))
    cols, z = _draw(m, rng, idx, rows)
    p = _sigmoid(m["intercept"] + z)
    cols["clicked"] = pa.array(rng.random(idx.shape[0]) < p)
    return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA), p


def _check(rows: int, seed: int, click_rate: float, chunk_rows: int = CHUNK_ROWS) -> None:
    for name, v, lo in (("rows", rows, 0), ("seed", seed, 0), ("chunk_rows", chunk_rows, 1)):
        if not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= lo):
            raise ValueError(f"{name} = {v!r}: must be an integer >= {lo}")
    if not 0.0 < click_rate < 1.0:
        raise ValueError(f"click_rate = {click_rate!r}: must be in (0, 1)")


def iter_adlog(rows: int, seed: int = 0, click_rate: float = 0.05, start: int = 0, stop: int | None = None,
               chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """Rows [start, stop) of the data set of ``rows`` rows, in windows of at most ``chunk_rows``
    rows: (table, true click probabilities) per window, each block drawn once."""
    _check(rows, seed, click_rate, chunk_rows)
    stop = rows if stop is None else min(stop, rows)
    cache: dict[int, tuple[pa.Table, np.ndarray]] = {}
    for lo in range(start, stop, chunk_rows):
        hi = min(lo + chunk_rows, stop)
        first, last = lo // BLOCK_ROWS, (hi - 1) // BLOCK_ROWS
        parts = [cache[b] if b in cache else _block(seed, click_rate, rows, b) for b in range(first, last + 1)]
        cache = {last: parts[-1]}  # a window ending inside a block: the next one starts there
        off = lo - first * BLOCK_ROWS
        t = pa.concat_tables([t for t, _ in parts]).slice(off, hi - lo).combine_chunks()
        yield t, np.concatenate([p for _, p in parts])[off:off + hi - lo]


def generate_adlog(rows: int, seed: int = 0, click_rate: float = 0.05,
                   chunk_rows: int = CHUNK_ROWS) -> tuple[pa.Table, np.ndarray]:
    """The whole data set in memory: (table of ``SCHEMA``, float64 true click probability per
    row). The same rows for any ``chunk_rows``."""
    windows = list(iter_adlog(rows, seed, click_rate, chunk_rows=chunk_rows))
    if not windows:
        return SCHEMA.empty_table(), np.zeros(0)
    return pa.concat_tables([t for t, _ in windows]), np.concatenate([p for _, p in windows])


# ---------------------------------------------------------------------------------------------
# Files


def _quoted(a: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise('"', a, '"', "")  # ids and names: no character to escape


def _float_text(a: pa.Array) -> pa.Array:
    """Doubles as JSON numbers that read back as doubles (``2.0``, not ``2``)."""
    s = pc.cast(a, pa.string())
    return pc.if_else(pc.match_substring_regex(s, "[.eEn]"), s, pc.binary_join_element_wise(s, ".0", ""))


def _joined(a: pa.Array, flat_items: pa.Array, open_: str, close: str) -> pa.Array:
    """Each list of ``a`` as ``open_ item,item close`` (null for a null list); ``flat_items`` is
    the JSON text of ``pc.list_flatten(a)``."""
    lengths = pc.fill_null(pc.list_value_length(a), 0).to_numpy(zero_copy_only=False)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    lists = pa.ListArray.from_arrays(pa.array(offsets), flat_items, mask=a.is_null())
    return pc.binary_join_element_wise(open_, pc.binary_join(lists, ","), close, "")


def _json_lines(t: pa.Table) -> bytes:
    """The rows of a ``SCHEMA`` table as JSON lines: one object per line, keys the column
    names in order, ts as ``"2026-11-20T03:04:05"``, a list an array, a map an object, a null
    ``null``."""
    c = {name: t.column(name).combine_chunks() for name in t.column_names}
    mt = c["interests"].type
    c["interests"] = c["interests"].cast(pa.list_(pa.field("entries", pa.struct([mt.key_field, mt.item_field]),
                                                           nullable=False)))
    entries = pc.list_flatten(c["interests"])
    text = {
        "ts": _quoted(pc.strftime(c["ts"].cast(pa.timestamp("s")), format="%Y-%m-%dT%H:%M:%S")),
        "user_segments": _joined(c["user_segments"], _quoted(pc.list_flatten(c["user_segments"])), "[", "]"),
        "interests": _joined(c["interests"], pc.binary_join_element_wise(
            _quoted(entries.field("key")), _float_text(entries.field("value")), ":"), "{", "}"),
        "clicked": pc.if_else(c["clicked"], "true", "false"),
    }
    for name in ("site_id", "app_id", "device_type"):
        text[name] = _quoted(c[name])
    parts: list = []
    for i, name in enumerate(t.column_names):
        if name in text:
            v = text[name]
        else:
            v = _float_text(c[name]) if pa.types.is_floating(c[name].type) else pc.cast(c[name], pa.string())
        parts += [("{" if i == 0 else ",") + f'"{name}":', pc.fill_null(v, "null")]
    lines = pc.binary_join_element_wise(*parts, "}\n", "").cast(pa.large_string())
    if len(lines) == 0:
        return b""
    off = np.frombuffer(lines.buffers()[1], np.int64)[lines.offset:lines.offset + len(lines) + 1]
    return lines.buffers()[2].slice(int(off[0]), int(off[-1] - off[0])).to_pybytes()


def _sums(y: np.ndarray, p: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(rows, positives, weight, weighted positives, logloss sum, weighted logloss sum)."""
    ll = -np.where(y, np.log(p), np.log1p(-p))
    return np.array([y.shape[0], y.sum(), w.sum(), (w * y).sum(), ll.sum(), (w * ll).sum()], np.float64)


def _entropy(r: float) -> float:
    return 0.0 if r <= 0.0 or r >= 1.0 else float(-(r * np.log(r) + (1 - r) * np.log1p(-r)))


def truth_of(clicked: np.ndarray, p: np.ndarray, weight: np.ndarray | None = None) -> dict:
    """The drawn labels' positive rate and the Bayes logloss (mean logloss of the true
    probabilities ``p``), unweighted and weighted, with the constant predictor's logloss (the
    entropy of the positive rate) beside each."""
    w = np.ones(p.shape[0]) if weight is None else np.asarray(weight, np.float64)
    return _summary(_sums(np.asarray(clicked, bool), np.asarray(p, np.float64), w))


def _summary(s: np.ndarray) -> dict:
    n, pos, w, wpos, ll, wll = (float(x) for x in s)
    rate, wrate = (pos / n if n else 0.0), (wpos / w if w else 0.0)
    return {"rows": int(n), "positives": int(pos), "positive_rate": rate, "positive_rate_weighted": wrate,
            "bayes_logloss": ll / n if n else 0.0, "bayes_logloss_weighted": wll / w if w else 0.0,
            "base_logloss": _entropy(rate), "base_logloss_weighted": _entropy(wrate)}


FORMATS = {"parquet": ".parquet", "json": ".json"}


def write_adlog(out_dir, rows: int, seed: int = 0, files: int = 2, click_rate: float = 0.05,
                formats=("parquet", "json"), chunk_rows: int = CHUNK_ROWS) -> dict:
    """Write the data set of ``rows`` rows as ``files`` files per format (file i holds rows
    [i * rows // files, (i + 1) * rows // files)), each under a temporary name renamed when
    complete, and ``truth.json``; returns what truth.json holds. ``out_dir`` must be empty or
    missing (nothing is overwritten). Memory: about ``chunk_rows`` rows at a time."""
    _check(rows, seed, click_rate, chunk_rows)
    if not (isinstance(files, int) and files >= 1):
        raise ValueError(f"files = {files!r}: must be an integer >= 1")
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"formats = {formats!r}: must be some of {', '.join(FORMATS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty (write_adlog writes into an empty or new directory)")
    for f in formats:
        (out / f).mkdir(parents=True, exist_ok=True)
    sums = np.zeros(6)
    names: dict[str, list[str]] = {f: [] for f in formats}
    for i in range(files):
        lo, hi = i * rows // files, (i + 1) * rows // files
        final = {f: out / f / f"part-{i:05d}{FORMATS[f]}" for f in formats}
        tmp = {f: p.with_name(f".{p.name}.tmp") for f, p in final.items()}
        writer = pq.ParquetWriter(tmp["parquet"], SCHEMA) if "parquet" in formats else None
        fh = open(tmp["json"], "wb") if "json" in formats else None
        try:
            for t, p in iter_adlog(rows, seed, click_rate, lo, hi, chunk_rows):
                sums += _sums(t.column("clicked").to_numpy(), p, t.column("weight").to_numpy())
                if writer is not None:
                    writer.write_table(t, row_group_size=ROW_GROUP_ROWS)
                if fh is not None:  # in slices: the text's intermediates stay small
                    for k in range(0, t.num_rows, ROW_GROUP_ROWS):
                        fh.write(_json_lines(t.slice(k, ROW_GROUP_ROWS)))
        except BaseException:
            for closeable in (writer, fh):
                if closeable is not None:
                    closeable.close()
            for path in tmp.values():
                path.unlink(missing_ok=True)
            raise
        for closeable in (writer, fh):
            if closeable is not None:
                closeable.close()
        for f in formats:
            os.replace(tmp[f], final[f])
            names[f].append(f"{f}/{final[f].name}")
    truth = {"generator": "gen_adlog", "version": GENERATOR_VERSION, "seed": seed, "click_rate": click_rate,
             "intercept": _model(seed, click_rate)["intercept"], **_summary(sums), "files": names}
    tmp = out / ".truth.json.tmp"
    tmp.write_text(json.dumps(truth, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "truth.json")
    return truth
