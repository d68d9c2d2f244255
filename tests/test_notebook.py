"""docs/tutorial.md as a notebook (tools/tutorial_notebook.py), executed top to bottom by the headless
command README.md names (`jupyter execute`, nbclient's, which the notebook extra installs).

It needs the `notebook` extra, which `make install` (and so `make test`) installs: without it the test
fails and says so, rather than skip on every machine that lacks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_with_env

ROOT = Path(__file__).resolve().parents[1]
HEADLESS = "jupyter execute --inplace"  # runs a notebook's cells and writes their outputs into it


def test_the_tutorial_notebook_runs_top_to_bottom_with_its_figures(tmp_path):
    try:
        import ipykernel  # noqa: F401  (the kernel nbclient starts)
        import nbclient  # noqa: F401  (its `jupyter execute` runs the notebook)
        import nbformat
    except ImportError as e:
        pytest.fail(f"{e.name} is missing: `make install` installs the notebook extra "
                    "(or pip install -e '.[notebook]')", pytrace=False)
    path = tmp_path / "tutorial.ipynb"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "tutorial_notebook.py"), "--out", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any("examples/01_one_process.py" in c.source for c in code), "the tutorial's commands are cells"
    assert not any("make install" in c.source for c in code), "the set-up block is not run"
    # The notebook runs from a root of its own that holds the checkout's examples/ and pyproject.toml
    # (what it looks for), so its `psgd run` cells write results/runs/ there, not in the checkout.
    root = tmp_path / "root"
    root.mkdir()
    for name in ("examples", "pyproject.toml"):
        (root / name).symlink_to(ROOT / name)
    # The kernel's environment: MPLBACKEND so the figures are inline images, PSGD_ROOT that root;
    # every process the cells start inherits a marker that the orphan check below looks for.
    marker = f"psgd-notebook-{tmp_path}"
    env = dict(os.environ, PSGD_ROOT=str(root), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path),
               PSGD_EXAMPLE_TEST=marker, MPLBACKEND="module://matplotlib_inline.backend_inline")
    assert f"`{HEADLESS} results/tmp/tutorial.ipynb`" in (ROOT / "README.md").read_text(), "README names it"
    jupyter = Path(sys.executable).parent / "jupyter"  # the environment's, as `make install` put it there
    r = subprocess.run([str(jupyter), *HEADLESS.split()[1:], "--timeout=600", str(path)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert processes_with_env("PSGD_EXAMPLE_TEST", marker) == [], "the notebook left processes behind"
    assert (root / "results" / "runs" / "latest" / "summary.json").exists(), "its runs went to its own root"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    images = [c for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert images and all("show_run()" in c.source for c in images), "each psgd run's figure is inline"
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "checked:" in text, "the examples printed their checks"
    json.dumps(nb)  # a notebook that serialises
