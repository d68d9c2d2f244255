"""docs/tutorial.md as a notebook (tools/tutorial_notebook.py), executed top to bottom (the `notebook` extra)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tutorial_notebook_runs_top_to_bottom_with_its_figures(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    path = tmp_path / "tutorial.ipynb"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "tutorial_notebook.py"), "--out", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any("examples/01_one_process.py" in c.source for c in code), "the tutorial's commands are cells"
    assert not any("make install" in c.source for c in code), "the set-up block is not run"
    # The kernel's environment: MPLBACKEND so the figures are inline images, PSGD_ROOT the checkout.
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    env = dict(os.environ, PSGD_ROOT=str(ROOT), OMP_NUM_THREADS="1",
               MPLBACKEND="module://matplotlib_inline.backend_inline")
    client.execute(env=env)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    images = [c for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert images and all("show_run()" in c.source for c in images), "each psgd run's figure is inline"
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "checked:" in text, "the examples printed their checks"
    json.dumps(nb)  # a notebook that serialises
