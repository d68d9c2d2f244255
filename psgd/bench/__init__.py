"""`psgd bench NAME ...`: benchmarks, each in its own module psgd/bench/NAME.py with a main(argv).

Benchmarks report figures measured side by side in one run (ratios against a raw ceiling), never
timing thresholds; tests only check that they run and produce well-formed output.
"""

from __future__ import annotations

import importlib

NAMES = ("transport", "allreduce", "scaling", "calibrate")


def main(argv: list[str]) -> int:
    from psgd.core.errors import UsageError

    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: psgd bench {{{','.join(NAMES)}}} [flags]   (psgd bench NAME -h for each)")
        return 0 if argv else 2
    if argv[0] not in NAMES:
        raise UsageError(f"unknown benchmark {argv[0]!r}; choose one of {', '.join(NAMES)}")
    return importlib.import_module(f"psgd.bench.{argv[0]}").main(argv[1:])
