"""docs/tutorial.md as a Jupyter notebook, generated from the one source when you want it.

    python tools/tutorial_notebook.py                # writes results/tmp/tutorial.ipynb (git ignores it)
    jupyter lab results/tmp/tutorial.ipynb           # or: --out PATH; run it top to bottom
    jupyter execute --inplace results/tmp/tutorial.ipynb   # or headless: outputs and figures written into it
    python tools/tutorial_notebook.py --steps 05,07  # only those steps (their "## NN" headings)

Generated, not committed: the tutorial stays the one text (its outputs are rewritten by
psgd/lab/docs_outputs.py), and a notebook made from it is never stale.

The tutorial's prose becomes markdown cells; each ```bash block becomes a code cell that runs its
commands (`python ...` and `psgd ...` with the kernel's own interpreter, from the repository
root, failing the cell on a non-zero exit); the printed outputs of a real run (```text) and the
diffs stay as markdown beside them, to compare with what the cell printed. The set-up block
(`make install`) is skipped: the notebook runs in an installed psgd. A step that runs `psgd run`
gets its figure inline: the run's training loss per update (and its staleness histogram where
the shards counted one), from the run folder. Needs nothing but the standard library;
opening and running it needs the `notebook` extra (pip install -e '.[notebook]').
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "tutorial.md"
TARGET = ROOT / "results" / "tmp" / "tutorial.ipynb"
SKIP = ("make install",)  # set-up commands the notebook does not run

SETUP = '''# Generated from docs/tutorial.md by tools/tutorial_notebook.py: edit the tutorial, then regenerate.
import json, os, shlex, subprocess, sys
from pathlib import Path

# Run from the repository root: $PSGD_ROOT, else the nearest folder above that holds examples/.
ROOT = Path(os.environ.get("PSGD_ROOT") or next(p for p in [Path.cwd(), *Path.cwd().parents]
                                               if (p / "examples").is_dir() and (p / "pyproject.toml").exists()))
os.chdir(ROOT)
ENV = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def sh(command):
    """Run one tutorial command with this kernel's python (psgd: python -m psgd); fail the cell on error."""
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "psgd":
        argv[:1] = [sys.executable, "-m", "psgd"]
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    print(r.stdout + r.stderr, end="")
    if r.returncode != 0:
        raise RuntimeError(f"{command!r} exited with code {r.returncode}")


def show_run(out="results/runs/latest"):
    """The run's figure: training loss per update (mean over workers), and its staleness histogram."""
    import matplotlib.pyplot as plt

    out = Path(out)
    steps = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "step":
            steps.setdefault(e["clock"], []).append(e["loss"])
    summary = json.loads((out / "summary.json").read_text())
    hist = {int(k): v for k, v in ((summary.get("staleness") or {}).get("hist") or {}).items()}
    fig, axes = plt.subplots(1, 2 if hist else 1, figsize=(10 if hist else 5, 3.2), squeeze=False)
    clocks = sorted(steps)
    axes[0][0].plot(clocks, [sum(steps[c]) / len(steps[c]) for c in clocks])
    axes[0][0].set(xlabel="update (clock)", ylabel="training loss", title=f"{summary['mode']}: {out.resolve().name}")
    if hist:
        axes[0][1].bar(list(hist), list(hist.values()))
        axes[0][1].set(xlabel="staleness (updates)", ylabel="gradients", title="staleness")
    fig.tight_layout()
    plt.show()
'''


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def cells(markdown: str) -> list[dict]:
    """The notebook's cells from the tutorial's text (see the module docstring)."""
    out: list[dict] = [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                        "source": _lines(SETUP)}]
    prose: list[str] = []

    def flush() -> None:
        text = "".join(prose).strip("\n")
        if text:
            out.append({"cell_type": "markdown", "metadata": {}, "source": _lines(text)})
        prose.clear()

    blocks = re.split(r"(^```[a-z]*\n.*?^```\n?)", markdown, flags=re.M | re.S)
    for block in blocks:
        m = re.match(r"```([a-z]*)\n(.*?)^```", block, flags=re.M | re.S)
        if not m or m.group(1) != "bash":
            prose.append(block)
            continue
        commands = [c.split("  #")[0].strip() for c in m.group(2).splitlines()]
        commands = [c for c in commands if c and not c.startswith(("#", ". ")) and not c.startswith(SKIP)]
        if not commands:
            continue
        flush()
        source = "\n".join(f"sh({c!r})" for c in commands)
        if any(c.startswith("psgd run") for c in commands):
            source += "\nshow_run()"
        out.append({"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                    "source": _lines(source)})
    flush()
    return out


def steps(markdown: str, chosen: set[int]) -> str:
    """The tutorial's text before its first step and the steps numbered in `chosen` ("## 05 — ...";
    "## 08-10 — ..." is steps 8 to 10); the sections after them that are no step ("## Where next") drop."""
    parts = re.split(r"(?=^## )", markdown, flags=re.M)
    kept = [parts[0]]
    for part in parts[1:]:
        m = re.match(r"## (\d+)(?:-(\d+))? ", part)
        if m and chosen & set(range(int(m[1]), int(m[2] or m[1]) + 1)):
            kept.append(part)
    return "".join(kept)


def notebook(markdown: str) -> str:
    nb = {"cells": cells(markdown), "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                       "language_info": {"name": "python"}}}
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"cell-{i}"
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=TARGET, help=f"where to write it (default {TARGET.relative_to(ROOT)})")
    ap.add_argument("--steps", help="comma-separated step numbers to keep, e.g. 05,07 (default: all)")
    a = ap.parse_args(argv)
    text = SOURCE.read_text()
    if a.steps:
        try:
            chosen = {int(n) for n in a.steps.split(",")}
        except ValueError:
            ap.error(f"--steps takes step numbers such as 05,07, not {a.steps!r}")
        text = steps(text, chosen)
    made = notebook(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(made)
    print(f"wrote {a.out} ({len(json.loads(made)['cells'])} cells)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
