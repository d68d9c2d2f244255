"""docs/tutorial.md as a notebook (tools/tutorial_notebook.py): every command of it a cell, and a
notebook of two of its steps (less the cells tests/test_examples.py runs verbatim: RUN_ELSEWHERE)
executed top to bottom by the headless command README.md names (`jupyter execute`, nbclient's,
which the notebook extra installs).

It needs the `notebook` extra, which `make install` (and so `make test`) installs: without it the test
fails and says so, rather than skip on every machine that lacks it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_with_env
from tests.test_examples import CASES

ROOT = Path(__file__).resolve().parents[1]
HEADLESS = "jupyter execute --inplace"  # runs a notebook's cells and writes their outputs into it
# The steps executed here: a `psgd run` with its inline figure (05) and an example that reads that run
# (07). Every other command of the tutorial runs in tests/test_examples.py (each example) and
# tests/test_readme.py; running them all again here cost a minute of `make test`.
STEPS = "05,07"
# Cells of those steps left out of the executed notebook: tests/test_examples.py runs each command
# verbatim (the same example, no arguments; what it prints checked there against the tutorial's
# text), and nothing below reads its output. Example 05 is two `psgd run`s of its own (about 7 s);
# step 05's own `psgd run` cell, with its inline figure, still runs here, as does 07, whose
# "checked:" line is asserted below.
RUN_ELSEWHERE = ("python examples/05_processes_straggler.py",)


def tutorial_commands() -> list[str]:
    """The commands of the tutorial's ```bash blocks, as the notebook takes them (comments cut)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "docs" / "tutorial.md").read_text(), re.M | re.S)
    lines = (line.split("  #")[0].strip() for block in blocks for line in block.splitlines())
    return [c for c in lines if c and not c.startswith(("#", ". ", "make install"))]


def test_the_tutorial_is_a_notebook_whose_steps_run_with_their_figures(tmp_path):
    try:
        import ipykernel  # noqa: F401  (the kernel nbclient starts)
        import nbclient  # noqa: F401  (its `jupyter execute` runs the notebook)
        import nbformat
    except ImportError as e:
        pytest.fail(f"{e.name} is missing: `make install` installs the notebook extra "
                    "(or pip install -e '.[notebook]')", pytrace=False)
    whole, path = tmp_path / "whole.ipynb", tmp_path / "tutorial.ipynb"
    for out, more in ((whole, []), (path, ["--steps", STEPS])):
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "tutorial_notebook.py"), "--out", str(out), *more],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    code = [c for c in nbformat.read(whole, as_version=4).cells if c.cell_type == "code"]
    cells = "".join(c.source for c in code)
    assert all(f"sh({c!r})" in cells for c in tutorial_commands()), "every tutorial command is a cell"
    assert not any("make install" in c.source for c in code), "the set-up block is not run"
    assert set(RUN_ELSEWHERE) <= {f"python examples/{name}" for name, args, _ in CASES if not args}
    nb = nbformat.read(path, as_version=4)
    sources = {f"sh({command!r})" for command in RUN_ELSEWHERE}
    elsewhere = [c for c in nb.cells if c.cell_type == "code" and c.source in sources]
    assert len(elsewhere) == len(RUN_ELSEWHERE), "the steps no longer hold a cell RUN_ELSEWHERE names"
    nb.cells = [c for c in nb.cells if all(c is not e for e in elsewhere)]
    nbformat.write(nb, path)
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
