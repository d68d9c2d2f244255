"""What a benchmark writes beside its numbers: command.txt's provenance, and its CSVs.

Contract: `provenance(argv, bench)` is command.txt's text: the command (`psgd bench BENCH ARGV`),
the date, the machine (cores, load average, system, Python) and the code commit, marked "with
uncommitted changes" when the code's own paths (`BENCH_CODE`; not results/, which a suite rewrites
while it runs) differ from it. `write_csv(path, rows, fields)`: rows as a CSV with that header,
fields a row lacks left empty and extra keys ignored.
"""

from __future__ import annotations

import csv
import os
import platform
import subprocess
import time
from pathlib import Path

__all__ = ["BENCH_CODE", "provenance", "write_csv"]

BENCH_CODE = ("psgd", "protos", "pyproject.toml")  # what a benchmark's numbers depend on (results/ is not)


def provenance(argv: list[str], bench: str = "cluster") -> str:
    """command.txt's text: `psgd bench BENCH ARGV`, the date, the machine and the code commit."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else "unknown"

    # The code's own paths only: a suite rewrites results/ while it runs, which is no code change.
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no", "--",
                                                 *BENCH_CODE) else ""
    return (f"psgd bench {bench} {' '.join(argv)}\n# date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
            f"# machine: {len(os.sched_getaffinity(0))} CPU cores, shared with other jobs (load average at start "
            f"{os.getloadavg()[0]:.1f}); {platform.system()} {platform.release()}; Python {platform.python_version()}"
            f"\n# training code: commit {git('rev-parse', 'HEAD')}{dirty}\n")


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
