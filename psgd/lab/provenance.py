"""Which code produced a result: `git describe --always --dirty`, restricted to the code.

Contract:
- `code_version(root)` names the commit of the source tree and appends `-dirty-<hash>` when the
  code paths (the package, the experiment files, the .proto, pyproject.toml) differ from it: the
  hash names the difference, so two uncommitted states never share a version. Results, docs and
  README edits do not count, so writing results/ during a suite does not change the version the
  suite started with. REPORT.md and results/summary.json record it.
- `run_code_version(root)` is the same for the code that *makes runs*: every module except the lab's
  reporting ones (LAB_FILES: analyses, plots, report, results, stats, verdicts, the suite and
  experiment schema), the benchmarks (not cached), the fault drill (`psgd drill`) and the processes'
  names (proctitle.py). It names the last commit that changed what that code does: a commit whose
  changes to it are comments and docstrings only (the same Python syntax tree once docstrings are
  dropped; `same_code`) is passed over, and so is such an uncommitted change. The suite keys its run
  cache on it: a run made by other training code is never reused, while a fix to a figure, a verdict
  rule or a docstring re-analyses or keeps the finished runs instead of repeating them. (A run's
  settings are in the key already, through its config.)
- Outside psgd's own git checkout (a wheel or an sdist installed, a copied folder) both return
  "psgd-<package version>-<hash of its files>" (the run key's hash leaves out LAB_FILES, as its
  commit does), which changes whenever the code does. Git is asked only where the package's folder
  is a checkout's root (it has .git): an installed psgd whose site-packages lies inside a user's
  own repository never names that repository's commit, nor changes version as the user works.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
from pathlib import Path

CODE_PATHS = ("psgd", "experiments", "protos", "pyproject.toml")
# Code no run's results depend on: the lab, the benches, the cost model, the palette, and the
# TensorBoard view (psgd/train/tboard.py reads metrics.jsonl and writes only its own folder; its
# thread never fails a run), the fault drill (`psgd drill`: its storm only SIGKILLs a drill's own
# processes; no suite run goes through it, and a drill's summary is never cached), and the processes'
# names (psgd/train/proctitle.py: what ps and the kernel call a process, and the words of its
# messages; no number of any run depends on them). A change there does not make the committed runs stale.
LAB_FILES = ("psgd/lab", "psgd/bench", "psgd/core/costmodel.py", "psgd/core/palette.py", "psgd/train/tboard.py",
             "psgd/train/drill.py", "psgd/train/storm.py", "psgd/train/proctitle.py")
RUN_PATHS = ("psgd", "protos", "pyproject.toml", *(f":(exclude){p}" for p in LAB_FILES))
LOOK_BACK = 50  # commits of the run paths searched for the last change of code; past it, the oldest


def _git(root: Path, *args: str) -> str:
    r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(r.stderr.strip())
    return r.stdout.strip()


def _tree(source: str) -> str | None:
    """A Python source's syntax tree without its docstrings, as text (comments never reach the
    tree, nor do line numbers); None when it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:]
    return ast.dump(tree)


def same_code(path: str, before: str | None, after: str | None) -> bool:
    """Whether two versions of a file (None: absent) differ in comments and docstrings only. Only
    Python is read so: any other change, a file added or removed, or one that does not parse, counts.
    (`__doc__` feeds help text alone here: psgd/train/drill.py prints it; no run reads it.)"""
    if before is None or after is None or not path.endswith(".py"):
        return before == after
    tree = _tree(before)
    return tree is not None and tree == _tree(after)


def _show(root: Path, rev: str, path: str) -> str | None:
    r = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True, timeout=30)
    return r.stdout if r.returncode == 0 else None


def _changes_code(root: Path, commit: str) -> bool:
    """Whether `commit` changed the run paths beyond comments and docstrings (a merge or the first
    commit always counts)."""
    parents = _git(root, "rev-list", "--parents", "-n", "1", commit).split()[1:]
    if len(parents) != 1:
        return True
    names = _git(root, "diff", "--name-only", parents[0], commit, "--", *RUN_PATHS).splitlines()
    # Only Python is read (another file, a binary one above all, counts as changed unread).
    return any(not n.endswith(".py") or not same_code(n, _show(root, parents[0], n), _show(root, commit, n))
               for n in names)


def _last_code_commit(root: Path) -> str:
    commits = _git(root, "log", f"-{LOOK_BACK}", "--format=%h", "--", *RUN_PATHS).split()
    return next((c for c in commits if _changes_code(root, c)), commits[-1] if commits else "")


def _dirty_code(root: Path, paths: tuple[str, ...]) -> list[str]:
    """The uncommitted changes of `paths` that are more than comments and docstrings."""
    changed = _git(root, "diff", "HEAD", "--name-only", "--", *paths).splitlines()
    kept = [n for n in changed if not n.endswith(".py") or not same_code(
        n, _show(root, "HEAD", n), (root / n).read_text() if (root / n).exists() else None)]
    return kept + _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths).splitlines()


def installed_version(root: Path, run: bool) -> str:
    """An installed psgd's own version: the package's version and a hash of its files (the run
    key's without LAB_FILES)."""
    from psgd import __version__

    lab = tuple(root / p for p in LAB_FILES)
    digest = hashlib.sha256()
    files = [*(root / "psgd").rglob("*.py"), *(root / "psgd" / "experiments").glob("*.toml")]
    for path in sorted(files):
        if not (run and any(path == p or p in path.parents for p in lab)):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return f"psgd-{__version__}-{digest.hexdigest()[:10]}"


def _version(root: Path | None, paths: tuple[str, ...], run: bool) -> str:
    root = root or Path(__file__).resolve().parents[2]  # psgd/lab/provenance.py -> the repository
    if not (root / ".git").exists():   # not psgd's checkout: an installed psgd (see the contract)
        return installed_version(root, run)
    try:
        if run:
            head, dirty = _last_code_commit(root), bool(_dirty_code(root, paths))
        else:
            head, dirty = _git(root, "describe", "--always"), bool(_git(root, "status", "--porcelain", "--", *paths))
        if not dirty:
            return head
        # Two different uncommitted states must not share a version: name the difference too.
        digest = hashlib.sha256(_git(root, "diff", "HEAD", "--", *paths).encode())
        for name in _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths).splitlines():
            digest.update(name.encode() + (root / name).read_bytes())
        return f"{head}-dirty-{digest.hexdigest()[:8]}"
    except (OSError, subprocess.SubprocessError):   # no git program, or a broken repository
        return installed_version(root, run)


def code_version(root: Path | None = None) -> str:
    return _version(root, CODE_PATHS, run=False)


def run_code_version(root: Path | None = None) -> str:
    return _version(root, RUN_PATHS, run=True)
