"""Which code produced a result: `git describe --always --dirty`, restricted to the code.

Contract:
- `code_version(root)` names the commit of the source tree and appends `-dirty-<hash>` when the
  code paths (the package, the experiment files, the .proto, pyproject.toml) differ from it: the
  hash names the difference, so two uncommitted states never share a version. Results, docs and
  README edits do not count, so writing results/ during a suite does not change the version the
  suite started with. REPORT.md and results/summary.json record it.
- `run_code_version(root)` is the same for the code that *makes runs*: every module except the
  lab's reporting ones (LAB_FILES: analyses, plots, report, results, stats, verdicts, the suite
  and experiment schema) and the benchmarks (not cached). It names the last commit that touched
  that code. The suite keys its run cache on it: a run made by other training code is never
  reused, while a fix to a figure or a verdict rule re-analyses the finished runs instead of
  repeating them. (A run's settings are in the key already, through its config.)
- Outside a git checkout (an sdist, a copied folder) both return "unknown-<hash of the sources>",
  which still changes whenever the code does.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

CODE_PATHS = ("psgd", "experiments", "protos", "pyproject.toml")
# Code no run's results depend on: the lab, the benches, the cost model, the palette, and the
# TensorBoard view (psgd/train/tboard.py reads metrics.jsonl and writes only its own folder; its
# thread never fails a run). A change there does not make the committed runs stale.
LAB_FILES = ("psgd/lab", "psgd/bench", "psgd/core/costmodel.py", "psgd/core/palette.py", "psgd/train/tboard.py")
RUN_PATHS = ("psgd", "protos", "pyproject.toml", *(f":(exclude){p}" for p in LAB_FILES))


def _git(root: Path, *args: str) -> str:
    r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(r.stderr.strip())
    return r.stdout.strip()


def _version(root: Path | None, paths: tuple[str, ...], head_args: tuple[str, ...]) -> str:
    root = root or Path(__file__).resolve().parents[2]  # psgd/lab/provenance.py -> the repository
    try:
        head = _git(root, *head_args, "--", *paths) if head_args[0] == "log" else _git(root, *head_args)
        dirty = _git(root, "status", "--porcelain", "--", *paths)
        if not dirty:
            return head
        # Two different uncommitted states must not share a version: name the difference too.
        digest = hashlib.sha256(_git(root, "diff", "HEAD", "--", *paths).encode())
        for name in _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths).splitlines():
            digest.update(name.encode() + (root / name).read_bytes())
        return f"{head}-dirty-{digest.hexdigest()[:8]}"
    except (OSError, subprocess.SubprocessError):
        digest = hashlib.sha256()
        for path in sorted((root / "psgd").rglob("*.py")):
            digest.update(path.read_bytes())
        return "unknown-" + digest.hexdigest()[:10]


def code_version(root: Path | None = None) -> str:
    return _version(root, CODE_PATHS, ("describe", "--always"))


def run_code_version(root: Path | None = None) -> str:
    return _version(root, RUN_PATHS, ("log", "-1", "--format=%h"))
