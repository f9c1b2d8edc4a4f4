"""``make bench``: run the benchmarks (all, or those named) and write bench-results/<name>.json.

    python -m tests.benchmarks [featurize ...]
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

from tests.benchmarks.common import write_result


def available() -> list[str]:
    import tests.benchmarks as pkg

    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
    names = argv or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {available()}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"== bench {name}", flush=True)
        try:
            figures = importlib.import_module(f"tests.benchmarks.bench_{name}").main()
        except Exception:  # noqa: BLE001 - report and go on with the other benchmarks
            traceback.print_exc()
            failed.append(name)
            continue
        print(f"   -> {write_result(name, figures)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
