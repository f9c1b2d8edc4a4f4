"""``make demo``: the main pipeline end to end on generated click logs, with the results printed.

Generates Criteo-style click logs with 1% malformed lines, featurizes them on Spark in local
mode, and prints what happened. Everything lands under ``--workdir`` (default demo-output/).
"""

from __future__ import annotations

import os
import shutil
import time

from jobs.config import load_config


def run_demo(workdir: str, rows: int) -> int:
    from jobs.cli import featurize, featurize_summary
    from pipeline.generate import generate_clicklogs

    workdir = os.path.abspath(workdir)
    raw, data = os.path.join(workdir, "raw"), os.path.join(workdir, "train")
    shutil.rmtree(raw, ignore_errors=True)
    print(f"[1/2] generating {rows:,} click-log rows (1% malformed) into {raw}")
    t = time.perf_counter()
    g = generate_clicklogs(raw, rows, files=2, seed=1, malformed_rate=0.01, with_prob=True)
    print(f"      {g['rows']:,} lines, positive rate {g['positive_rate']:.3f}, "
          f"{sum(g['malformed'].values()):,} malformed, {time.perf_counter() - t:.1f} s")
    cfg = load_config([], ["spark.master=local[2]"])
    print(f"[2/2] featurizing on Spark ({cfg.spark.master}) into {data}")
    m = featurize(cfg, [raw + "/*.tsv"], data)
    print(featurize_summary(m))
    ok = m["lines"] == m["rows"] + m["quarantine"]["rows"]
    print(f"  rows in = written + quarantined: {'yes' if ok else 'NO'}")
    print(f"\ndataset: {data} (manifest: {os.path.join(data, '_manifest.json')})")
    return 0 if ok else 1
