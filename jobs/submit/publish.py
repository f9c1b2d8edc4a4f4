"""Publish a model: atomically point the ``current`` pointer at it (a thin entry point).

    spark-submit --master yarn --deploy-mode client jobs/submit/publish.py \
        --model hdfs:///models/ctr/dt=2024-03-05 --pointer hdfs:///models/ctr/current \
        --metrics hdfs:///models/ctr/metrics/dt=2024-03-05.json

Refuses a directory that is not a complete model. It writes one small file and starts no Spark
session, so spark-submit stays cheap. Use client mode on YARN: in cluster mode YARN fails an
application that never creates a SparkContext.
The same as ``terascale publish ...``; see ``terascale publish --help``.
"""

from __future__ import annotations

import sys

from terascale.jobs.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["publish", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
