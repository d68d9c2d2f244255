"""What a benchmark writes beside its numbers: command.txt's provenance, and its CSVs.

Contract: `provenance(argv, bench)` is command.txt's text: the command (`psgd bench BENCH ARGV`),
the date, the machine (cores, load average, system, Python) and the code commit, marked "with
uncommitted changes" when the code's own paths (`BENCH_CODE`; not results/, which a suite rewrites
while it runs) differ from it. `write_csv(path, rows, fields)`: rows as a CSV with that header,
fields a row lacks left empty and extra keys ignored.

Where a benchmark writes when not told: `scratch(NAME)`, results/tmp/NAME (git-ignored), for every
benchmark's and `psgd model`'s --out, so that a command copied from the docs never rewrites the
committed results/ (their command.txt files name their --out; name it to write there). The cost
model's --calibration defaults to `calibration()`: `psgd bench calibrate`'s own default output when
one exists that is newer than the committed results/bench/calibration.json (a user who calibrated
this machine gets its numbers), else the committed one.
"""

from __future__ import annotations

import csv
import os
import platform
import subprocess
import time
from pathlib import Path

__all__ = ["BENCH_CODE", "COMMITTED_CALIBRATION", "SCRATCH", "calibration", "provenance", "scratch", "write_csv"]

BENCH_CODE = ("psgd", "protos", "pyproject.toml")  # what a benchmark's numbers depend on (results/ is not)
SCRATCH = "results/tmp"  # git-ignored (.gitignore): the default --out of every benchmark and of psgd model
COMMITTED_CALIBRATION = "results/bench/calibration.json"  # this project's machine, fitted by psgd bench calibrate


def scratch(name: str) -> str:
    """A benchmark's default --out: results/tmp/NAME (see the module docstring)."""
    return f"{SCRATCH}/{name}"


def calibration() -> str:
    """The --calibration the cost model reads by default (see the module docstring): the scratch
    calibration when it exists and is no older than the committed one, else the committed one."""
    mine, committed = Path(scratch("bench/calibration.json")), Path(COMMITTED_CALIBRATION)
    if mine.is_file() and (not committed.is_file() or mine.stat().st_mtime >= committed.stat().st_mtime):
        return str(mine)
    return str(committed)


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
