"""The whole pipeline through ``jobs.cli.main`` in one process, for tests/test_secrets.py.

    python -m tests.secrets_app RUN_DIR CONF_YAML SPARK_CONF_SET KEYS_FILE

Runs generate, featurize, train (2 workers; the first attempt fails after pass 1, so that a
checkpoint and a progress file are written and the retry resumes from them), evaluate, predict,
report, publish and config, in RUN_DIR, with ``--conf CONF_YAML`` and, for train,
``--set spark.conf=SPARK_CONF_SET``. Everything is real; two pieces of instrumentation only
watch: every attempt key ``allreduce.spark`` draws is appended (hex) to KEYS_FILE (outside
RUN_DIR), and a thread copies every file that appears in the model's checkpoint directory
(checkpoints and progress files, removed when training succeeds) into RUN_DIR/_seen/, so the
test can scan them. An executor task prints a probe line to stderr, to show that the Python
workers' stderr reaches the captured stream; the command line of the JVM pyspark launched
(readable by any local user) is saved beside KEYS_FILE as ``jvm_cmdline``. Exits with the first non-zero status.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading


def _watch(src: str, dst: str, stop: threading.Event) -> None:
    os.makedirs(dst, exist_ok=True)
    n = 0
    while not stop.wait(0.05):
        for root, _, files in os.walk(src):
            for name in files:
                try:
                    shutil.copyfile(os.path.join(root, name), os.path.join(dst, f"{n:05d}-{name}"))
                    n += 1
                except OSError:
                    pass  # replaced or removed meanwhile


def main() -> int:
    run, conf, spark_conf_set, keys_file = sys.argv[1:5]
    import terascale.allreduce.spark as ars
    from terascale.jobs.cli import main as cli

    draw = ars.new_key

    def recorded_key() -> bytes:
        key = draw()
        with open(keys_file, "a") as f:
            f.write(key.hex() + "\n")
        return key

    ars.new_key = recorded_key
    j = lambda *p: os.path.join(run, *p)  # noqa: E731
    steps = [
        ["generate", "--rows", "3000", "--out", j("raw"), "--seed", "5"],
        ["featurize", "--input", j("raw"), "--output", j("data"), "--conf", conf],
        None,  # the executor probe, once the session exists
        ["train", "--input", j("data"), "--model", j("model"), "--conf", conf, "--set", f"spark.conf={spark_conf_set}",
         "--set", "train.inject.fail_shard=1", "--set", "train.inject.fail_pass=2"],
        ["evaluate", "--input", j("data"), "--model", j("model"), "--out", j("metrics.json"), "--conf", conf],
        ["predict", "--input", j("data"), "--model", j("model"), "--output", j("pred"), "--conf", conf],
        ["report", j("model"), "--eval", j("metrics.json"), "--out", j("report")],
        ["publish", "--model", j("model"), "--pointer", j("current"), "--metrics", j("metrics.json")],
        ["config", "--conf", conf, "--set", f"spark.conf={spark_conf_set}"],
    ]
    for argv in steps:
        if argv is None:
            from pyspark.sql import SparkSession

            def probe(it):
                print("terascale-executor-probe", file=sys.stderr, flush=True)
                return it

            SparkSession.getActiveSession().sparkContext.parallelize([1, 2], 2).mapPartitions(probe).count()
            from pyspark import SparkContext

            with open(os.path.join(os.path.dirname(keys_file), "jvm_cmdline"), "wb") as f:
                f.write(open(f"/proc/{SparkContext._gateway.proc.pid}/cmdline", "rb").read())
            continue
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(j("model.checkpoint"), j("_seen"), stop), daemon=True)
        if argv[0] == "train":
            watcher.start()
        rc = cli(argv)
        stop.set()
        if watcher.is_alive():
            watcher.join()
        sys.stdout.flush()
        sys.stderr.flush()
        if rc != 0:
            print(f"secrets_app: {argv[0]} exited {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
