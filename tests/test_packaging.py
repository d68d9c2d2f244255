"""psgd as a Python package keeps the conventions a user's tools expect (issue 54, item 10).

The wheel is built from a copy of the tracked sources in tmp_path (setuptools writes build/ and
*.egg-info beside what it builds, and a test does not write into the checkout), then read as a zip.
"""

from __future__ import annotations

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
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "psgd", src / "psgd", ignore=shutil.ignore_patterns("__pycache__"))
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
