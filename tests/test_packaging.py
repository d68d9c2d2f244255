"""psgd as a Python package keeps the conventions a user's tools expect (issue 54, item 10).

The wheel is built from a copy of the tracked sources in tmp_path (setuptools writes build/ and
*.egg-info beside what it builds, and a test does not write into the checkout), then read as a zip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def build_wheel(tmp_path: Path) -> zipfile.ZipFile:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "psgd", src / "psgd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "experiments", src / "experiments")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                        "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("psgd-*.whl")
    return zipfile.ZipFile(wheel)


def test_the_wheel_carries_the_license_the_metadata_names_and_the_type_marker(tmp_path):
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "MIT"
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    names = build_wheel(tmp_path).namelist()
    assert "psgd/py.typed" in names  # PEP 561: mypy reads psgd's hints
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_psgd_version_prints_the_installed_version_and_a_source_tree_falls_back_to_pyproject(capsys, monkeypatch):
    import importlib.metadata

    import psgd
    from psgd import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"psgd {importlib.metadata.version('psgd')}\n"
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert psgd._SOURCE_VERSION == meta["version"]  # the fallback cannot drift from the metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert psgd.__version__ == meta["version"]


def test_an_installed_psgd_runs_its_suites_by_name_and_names_its_own_version(tmp_path):
    """Issue 54, item 9: from a wheel, `psgd suite experiments/default.toml` had no suite to run, and
    inside a user's own git repository psgd named the user's commit as its code version
    ("aa32e40-dirty"). The wheel ships experiments/*.toml as psgd/experiments; unpacked into a
    user's repository (as a venv there would hold it), psgd lists and resolves its suites by name
    and names its own version."""
    wheel = build_wheel(tmp_path)
    names = wheel.namelist()
    assert {f"psgd/experiments/{p.name}" for p in (REPO / "experiments").glob("*.toml")} <= set(names)
    user = tmp_path / "user-repo"
    site = user / ".venv" / "site-packages"
    wheel.extractall(site)
    git = ["git", "-c", "user.name=u", "-c", "user.email=u@u"]
    subprocess.run([*git, "init", "-q", str(user)], check=True)
    (user / "train.py").write_text("print('mine')\n")
    subprocess.run([*git, "-C", str(user), "add", "train.py"], check=True)
    subprocess.run([*git, "-C", str(user), "commit", "-qm", "mine"], check=True)
    (user / "train.py").write_text("print('mine, edited')\n")   # the user's tree is dirty too
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    probe = ("from psgd.lab import provenance, suites; print(provenance.code_version()); "
             "print(provenance.run_code_version()); print(suites.resolve('default'))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    code, run, default = r.stdout.split()
    assert code.startswith("psgd-0.1.0-") and run.startswith("psgd-0.1.0-") and code != run, r.stdout
    assert Path(default) == site / "psgd" / "experiments" / "default.toml"
    r = subprocess.run([sys.executable, "-m", "psgd", "suite", "--list"], cwd=user, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.match(r"default +\S+default.toml  \d+ experiments: E0 E1 ", r.stdout), r.stdout
    assert "\npapers " in r.stdout and "\ntransformer " in r.stdout
