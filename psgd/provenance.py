"""Which code produced a result: `git describe --always --dirty`, restricted to the code.

Contract: `code_version(root)` names the commit of the source tree and appends `-dirty` when the
code paths (the package, the experiment files, pyproject.toml) differ from it, with a hash of that
difference (two uncommitted states never share a version); results, docs and
README edits do not count, so writing results/ during a suite does not change the version the
suite started with. Outside a git checkout (an sdist, a copied folder) it returns
"unknown-<hash of the package's sources>", which still changes whenever the code does.
The suite stamps it on every run, REPORT.md and results/summary.json, and includes it in the
run cache key: a run made by other code is never reused.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

CODE_PATHS = ("psgd", "experiments", "protos", "pyproject.toml")


def _git(root: Path, *args: str) -> str:
    r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(r.stderr.strip())
    return r.stdout.strip()


def code_version(root: Path | None = None) -> str:
    root = root or Path(__file__).resolve().parent.parent
    try:
        head = _git(root, "describe", "--always")
        dirty = _git(root, "status", "--porcelain", "--", *CODE_PATHS)
        if not dirty:
            return head
        # Two different uncommitted states must not share a cache: name the difference too.
        digest = hashlib.sha256(_git(root, "diff", "HEAD", "--", *CODE_PATHS).encode())
        for name in _git(root, "ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS).splitlines():
            digest.update(name.encode() + (root / name).read_bytes())
        return f"{head}-dirty-{digest.hexdigest()[:8]}"
    except (OSError, subprocess.SubprocessError):
        digest = hashlib.sha256()
        for path in sorted((root / "psgd").rglob("*.py")):
            digest.update(path.read_bytes())
        return "unknown-" + digest.hexdigest()[:10]
