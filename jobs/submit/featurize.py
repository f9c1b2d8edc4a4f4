"""Featurize raw click logs into hashed Parquet (a thin spark-submit entry point).

    spark-submit --master local[2] jobs/submit/featurize.py \
        --input 'logs/day_0/*.tsv.gz' --output data/day_0 --conf conf/featurize.yaml \
        --set featurize.bits=24

The same as ``terascale featurize ...``; see ``terascale featurize --help`` for the flags.
An existing output is replaced only with ``--overwrite`` and only when it is this job's own
kind of artifact; anything else there is refused before Spark starts (exit code 2).
"""

from __future__ import annotations

import sys

from terascale.jobs.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["featurize", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
