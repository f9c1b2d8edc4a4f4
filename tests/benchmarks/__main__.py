"""``make bench``: run the benchmarks (all, or those named) and write bench-results/<name>.json.

    python -m tests.benchmarks [NAME ...] [NAME --option ...]

Arguments that begin with a dash start the last named benchmark's own arguments: from the first
of them on, the rest of the line goes to that benchmark, as ``main(argv)`` (``scale --rows
1000000 --keep``). Names before it are run without arguments, each through ``main()``; a
benchmark whose ``main`` takes no arguments refuses them. With no names, every benchmark runs
except those that set ``EXPLICIT_ONLY = True`` (the scale benchmark: hours at its default
size; ``make bench-scale``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import traceback

from tests.benchmarks.common import write_result


def available() -> list[str]:
    import tests.benchmarks as pkg

    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_"))


def _module(name: str):
    return importlib.import_module(f"tests.benchmarks.bench_{name}")


def split_argv(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``[(name, its arguments)]`` in order: from the first argument that begins with a dash on,
    the rest of ``argv`` belongs to the name before it. ValueError when a dash comes first."""
    runs: list[tuple[str, list[str]]] = []
    for i, a in enumerate(argv):
        if a.startswith("-"):
            if not runs:
                raise ValueError(f"{a!r} before any benchmark name")
            runs[-1] = (runs[-1][0], list(argv[i:]))
            break
        runs.append((a, []))
    return runs


def _explicit_only(name: str) -> bool:
    try:
        return bool(getattr(_module(name), "EXPLICIT_ONLY", False))
    except Exception:  # noqa: BLE001 - it fails again, with its traceback, when it runs
        return False


def _takes_argv(name: str) -> bool:
    return bool(inspect.signature(_module(name).main).parameters)


def main(argv: list[str]) -> int:
    try:
        runs = split_argv(argv)
    except ValueError as e:
        print(f"usage: python -m tests.benchmarks [NAME ...] [NAME --option ...]: {e}", file=sys.stderr)
        return 2
    if not runs:
        runs = [(n, []) for n in available() if not _explicit_only(n)]
    unknown = sorted({n for n, _ in runs} - set(available()))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {available()}", file=sys.stderr)
        return 2
    refused = [n for n, args in runs if args and not _takes_argv(n)]
    if refused:
        print(f"benchmark(s) {refused} take no arguments", file=sys.stderr)
        return 2
    failed = []
    for name, args in runs:
        print(f"== bench {name}{' ' + ' '.join(args) if args else ''}", flush=True)
        try:
            figures = _module(name).main(args) if args else _module(name).main()
        except SystemExit as e:  # a benchmark's argparse (--help, bad arguments) or its refusal
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            if e.code not in (0, None):
                failed.append(name)
            continue
        except Exception:  # noqa: BLE001 - report and go on with the other benchmarks
            traceback.print_exc()
            failed.append(name)
            continue
        print(f"   -> {write_result(name, figures)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
