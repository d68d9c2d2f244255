"""psgd builds with setuptools from pyproject.toml (all its metadata is there); this file adds one
step: the suite and experiment files of experiments/ ship inside the package, as
psgd/experiments/*.toml, so an installed psgd runs `psgd suite default` and `psgd suite --list`
(psgd/lab/suites.py finds them; a checkout reads experiments/ itself)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithSuites(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "psgd" / "experiments"
        self.mkpath(str(target))
        for f in sorted((HERE / "experiments").glob("*.toml")):
            self.copy_file(str(f), str(target / f.name))


setup(cmdclass={"build_py": BuildWithSuites})
