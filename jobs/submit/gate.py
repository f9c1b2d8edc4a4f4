"""Quality gate: fail when the new model regresses against the published one (a thin entry point).

    spark-submit --master yarn --deploy-mode client jobs/submit/gate.py \
        --metrics hdfs:///models/ctr/metrics/dt=2024-03-05.json \
        --baseline hdfs:///models/ctr/current --metric logloss --max-regression 0.01

It reads two small JSON files and starts no Spark session, so spark-submit stays cheap. Use
client mode on YARN: in cluster mode YARN fails an application that never creates a SparkContext.
The same as ``terascale gate ...``; see ``terascale gate --help``. Exit 1 when the gate fails.
"""

from __future__ import annotations

import sys

from terascale.jobs.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["gate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
