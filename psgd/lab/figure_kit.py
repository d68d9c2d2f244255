"""The look every figure of the lab shares, and how a figure is saved with its numbers.

Contract:
- `save(fig, path, header, rows)`: the figure as PNG at `path` and its numbers as a CSV beside it
  (same name, .csv): every figure psgd draws (psgd/lab/plots.py, forest.py, trace.py) goes through it.
  Inside `numbers_only()` it writes the CSV and renders no PNG: a claim's reading at its other scoring
  (psgd/lab/readings.py) runs the analysis again for its verdict alone, into a folder thrown away.
- `Series(label, mode, runs)`: one line drawn from one or more runs (seeds); `band` gives their mean
  and min..max on a common x grid (`BAND`, which every caption quotes).
- `styles` (a line style per series: modes that can coincide, sync and all-reduce, differ in dash),
  `refs` (grey reference lines), `legend` (outside the axes, so it never covers data). Colours and
  markers come from psgd/core/palette.py.
- Imports matplotlib with the file-only backend (Agg): no display needed, safe in CI; `plt` is
  that pyplot.
"""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, safe in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from psgd.core.palette import LINESTYLES, REF_COLOR  # noqa: E402
from psgd.lab.results import RunData  # noqa: E402

__all__ = ["plt", "BAND", "AXIS_LABELS", "axis_label", "Series", "styles", "refs", "legend", "band", "save"]

BAND = "band: min-max over seeds"
AXIS_LABELS = {
    "elapsed_s": "wall time (s)", "version": "global updates", "samples": "training samples processed",
    "test_accuracy": "test accuracy", "test_loss": "test loss (cross-entropy)",
    "train_loss": "train loss (cross-entropy)",
}

LOSS_NAMES = {"cross_entropy": "cross-entropy"}   # how an axis names a built-in --loss


def axis_label(key: str, runs: Sequence[RunData] = ()) -> str:
    """The axis name of `key`; a loss is named by the loss its runs trained with (config
    model.loss: "test loss (mse)"), cross-entropy where they do not say."""
    if key in ("test_loss", "train_loss", "val_loss") and runs:
        losses = sorted({str(((r.summary.get("config") or {}).get("model") or {}).get("loss") or "cross_entropy")
                         for r in runs})
        return f"{key.split('_')[0]} loss ({', '.join(LOSS_NAMES.get(n, n) for n in losses)})"
    return AXIS_LABELS.get(key, key)


@dataclass
class Series:
    label: str
    mode: str                 # a mode (coloured by MODE_COLORS), or "" with `variant` set
    runs: list[RunData] = field(default_factory=list)
    variant: int = -1         # index into VARIANT_COLORS for series that are not modes


def styles(series: list[Series]) -> list[str]:
    seen: dict[str, int] = {}
    styles = []
    for s in series:
        key = s.mode if s.variant < 0 else f"variant{s.variant}"
        # All-reduce draws dashed: it coincides with sync by design, and both must stay visible.
        first = "--" if s.mode == "allreduce" and s.variant < 0 else "-"
        styles.append(first if seen.get(key, 0) == 0 else LINESTYLES[seen[key] % len(LINESTYLES)])
        seen[key] = seen.get(key, 0) + 1
    return styles


def refs(ax, refs: list[tuple[float, str]] | None, horizontal: bool = True) -> None:
    for value, text in refs or []:
        if horizontal:
            ax.axhline(value, color=REF_COLOR, linestyle=":", linewidth=1.2, label=text)


def legend(ax, handles: list | None = None) -> None:
    # Outside the axes, to the right: a legend never covers data (bbox_inches="tight" keeps it).
    # `handles` (labelled artists) sets the order; by default, the order they were drawn in.
    handles = handles if handles is not None else ax.get_legend_handles_labels()[0]
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def band(runs: list[RunData], x: str, y: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, min and max of y over runs on a common x grid (interpolated when seeds differ in x)."""
    xs = [np.array([e[x] for e in r.evals], dtype=float) for r in runs]
    ys = [np.array([e[y] for e in r.evals], dtype=float) for r in runs]
    if len(runs) == 1 or all(len(a) == len(xs[0]) and np.allclose(a, xs[0]) for a in xs):
        grid = xs[0]
        stack = np.vstack([v[:len(grid)] for v in ys])
    else:
        lo, hi = max(a.min() for a in xs), min(a.max() for a in xs)
        grid = np.linspace(lo, hi, 50)
        stack = np.vstack([np.interp(grid, a, v) for a, v in zip(xs, ys, strict=True)])
    return grid, stack.mean(0), stack.min(0), stack.max(0)


_render = [True]  # False inside `numbers_only`


@contextlib.contextmanager
def numbers_only() -> Iterator[None]:
    """`save` writes the numbers and renders no figure meanwhile (see the module docstring)."""
    was, _render[0] = _render[0], False
    try:
        yield
    finally:
        _render[0] = was


def save(fig, path: Path, header: list[str], rows: list[list]) -> None:
    """Write the figure to `path` (.png) and its numbers, `header` then `rows`, to the .csv beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if _render[0]:  # rendering is most of a figure's cost: about 0.2 s of PNG per figure
        fig.savefig(path, dpi=110, bbox_inches="tight")
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
