"""One featurize task outside Spark: where its CPU time goes, beside the scorer on the same lines.

    python -m tests.benchmarks.featurize_phases FILE [FILE ...]

For each file: ``run_task`` (the function the Spark job runs) on the whole file as one piece,
with the default configuration, twice (the first loads numba's cache; the second is reported):
its CPU seconds per million rows in all and per phase (``featurize_task.PHASES``). Then the raw
scorer's fused kernel (``Scorer.predict_block``, 8 MiB blocks, a model of zeros: the weights do
not change its cost) on the file's lines in memory, and the bare kernels on those bytes:
``BlockParser.parse`` (featurize's parser and hasher) and, for a gzip file, inflating it with
zlib. Prints one JSON object; run it with ``NUMBA_NUM_THREADS=1``.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tempfile
import time
import zlib

import numpy as np


def _lines(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    return gzip.decompress(raw) if path.endswith(".gz") else raw


def _blocks(data: bytes, size: int = 8 << 20) -> list[memoryview]:
    out, pos = [], 0
    while pos < len(data):
        end = data.rfind(b"\n", pos, pos + size) + 1 or len(data)
        out.append(memoryview(data)[pos:end])
        pos = end
    return out


def measure(path: str) -> dict:
    from terascale.jobs.config import feature_spec, load_config
    from terascale.pipeline.blocks import BlockParser, Piece
    from terascale.pipeline.featurize_task import TaskOptions, run_task, task_times
    from terascale.pipeline.scorer import Scorer

    cfg = load_config([], [])
    spec, fc = feature_spec(cfg), cfg.featurize
    opts = TaskOptions(max_line_bytes=fc.max_line_bytes, block_bytes=fc.block_mb << 20, on_error=fc.on_error,
                       compression=fc.compression)
    gz = path.endswith(".gz")
    piece = Piece(path, 0, -1 if gz else os.path.getsize(path), 1, gz)
    work = tempfile.mkdtemp(prefix="featurize-phases-")
    try:
        for i in range(2):
            r = run_task(0, [piece], spec, opts, os.path.join(work, f"t{i}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"file": path, "task": task_times([r])}
    rows = r["rows"]
    data = _lines(path)
    blocks = _blocks(data)
    arrays = [np.frombuffer(b, dtype=np.uint8) for b in blocks]
    scorer = Scorer(np.zeros(1 << spec.bits, np.float32), 0.0,
                    {"spec": spec.to_json(), "config": {"train": {"loss": "logistic"}, "featurize": {}}}, "raw")
    scorer.predict_block(arrays[0], skip_bad=True)
    c = time.process_time()
    lines = sum(scorer.predict_block(a, skip_bad=True).shape[0] for a in arrays)
    out["scorer_cpu_s_per_m_lines"] = (time.process_time() - c) / lines * 1e6
    parser = BlockParser(spec, fc.max_line_bytes)
    parser.parse(arrays[0])
    c = time.process_time()
    for a in arrays:
        parser.parse(a)
    out["parse_kernel_cpu_s_per_m_rows"] = (time.process_time() - c) / rows * 1e6
    if gz:
        with open(path, "rb") as f:
            raw = f.read()
        c = time.process_time()
        d = zlib.decompressobj(31)
        for i in range(0, len(raw), 1 << 20):
            d.decompress(raw[i : i + (1 << 20)])
        out["zlib_inflate_cpu_s_per_m_rows"] = (time.process_time() - c) / rows * 1e6
    return out


if __name__ == "__main__":
    print(json.dumps([measure(p) for p in sys.argv[1:]]))
