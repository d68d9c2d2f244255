"""Where `psgd suite` finds its suites: a file you name, or a suite psgd ships, by name.

Contract:
- `folder()`: the experiment files at hand: a checkout's experiments/ (beside the package), else
  the copy an installed psgd carries (psgd/experiments/*.toml, put there by setup.py's build step).
- `available()`: the suites there, name -> file: every .toml holding a `[suite]` table (an
  experiment file's `suite` key is a string, so it is never one), named by its file's stem.
- `resolve(arg)`: an existing file is itself; a bare name (`default`, `papers`) is that suite;
  anything else is a one-line UsageError naming the suites there are, so `psgd suite default` runs
  from a wheel as `psgd suite experiments/default.toml` does in a clone.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from psgd.core.errors import UsageError

PACKAGE = Path(__file__).resolve().parents[1]   # psgd/


def folder() -> Path:
    checkout = PACKAGE.parent / "experiments"
    return checkout if checkout.is_dir() else PACKAGE / "experiments"


def available() -> dict[str, Path]:
    suites = {}
    for path in sorted(folder().glob("*.toml")):
        try:
            if isinstance(tomllib.loads(path.read_text()).get("suite"), dict):
                suites[path.stem] = path
        except (OSError, tomllib.TOMLDecodeError):
            continue   # a broken file is reported when it is run, not while listing
    return suites


def resolve(arg: str) -> Path:
    path = Path(arg)
    if path.is_file():
        return path
    suites = available()
    if arg in suites:
        return suites[arg]
    names = ", ".join(suites) or "none"
    raise UsageError(f"{arg}: no such suite file, and not the name of a suite psgd has (in {folder()}: {names}); "
                     "e.g. psgd suite default, or psgd suite --list")


def listing() -> str:
    """`psgd suite --list`: a line per suite: its name, its file and the experiments it runs."""
    from psgd.lab.loader import read_toml, suite_files
    from psgd.lab.settings import SuiteError

    lines = []
    for name, path in available().items():
        try:
            doc = read_toml(path)["suite"]
            ids = [str(read_toml(f).get("id", f.stem)) for f in suite_files(path, doc.get("name", "default"),
                                                                             doc.get("experiments", []))]
            runs = f"{len(ids)} experiments: {' '.join(ids)}"
        except SuiteError as e:
            runs = f"(cannot be read: {e})"
        lines.append(f"{name:<12} {path}  {runs}")
    return "\n".join(lines) or f"no suites in {folder()}"
