"""Score a featurized dataset with a model (a thin spark-submit entry point).

    spark-submit --master local[4] jobs/submit/predict.py \
        --input data/test --model models/ctr --output predictions/

The same as ``terascale predict ...``; see ``terascale predict --help`` for the flags.
An existing output is replaced only with ``--overwrite`` and only when it is this job's own
kind of artifact; anything else there is refused before Spark starts (exit code 2).
"""

from __future__ import annotations

import sys

from terascale.jobs.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["predict", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
