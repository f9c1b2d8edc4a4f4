"""Evaluate a model on a featurized dataset (a thin spark-submit entry point).

    spark-submit --master local[4] jobs/submit/evaluate.py \
        --input data/test --model models/ctr --out metrics.json

The same as ``terascale evaluate ...``; see ``terascale evaluate --help`` for the flags.
An existing output is replaced only with ``--overwrite`` and only when it is this job's own
kind of artifact; anything else there is refused before Spark starts (exit code 2).
"""

from __future__ import annotations

import sys

from terascale.jobs.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["evaluate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
