"""Figures from run results, each saved as PNG together with a CSV of the numbers it shows.

Contract:
- `Series(label, mode, runs)`: one line on a figure, drawn from one or more runs (seeds); with
  several seeds the line is the mean and the shaded band spans min..max over the seeds (`BAND`,
  which every caption quotes).
- `curves(series, x, y, path)` plots eval metrics (`test_accuracy`, `test_loss`, `val_accuracy`,
  ...) against `elapsed_s`, `version` (global updates) or `samples`; `bars(...)`, `lines(...)`
  and `histograms(...)` cover the rest. Every function returns the matplotlib Figure (tests
  inspect its content) and writes `path` (.png) and the same name with .csv.
- One palette everywhere (psgd/core/palette.py: Okabe & Ito 2008, colour-blind safe): a colour per mode
  (`MODE_COLORS`) that nothing else uses; other variables (dtype, skew, batch, link) take
  `VARIANT_COLORS`. Every line has a marker, and modes that can coincide (sync and all-reduce
  compute the same numbers) differ in marker and style, so both stay visible. `refs` draws
  reference lines (chance loss, the paper's accuracy, ideal speedup) in grey. Legends sit
  outside the axes, so they never cover data.

    psgd plot results/runs/E1/sync-s0 results/runs/E1/async-s0 --x elapsed_s --y test_accuracy --out fig.png
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, safe in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from psgd.core.palette import (  # noqa: E402
    LINESTYLES,
    MODE_COLORS,
    MODE_MARKERS,
    REF_COLOR,
    VARIANT_COLORS,
    VARIANT_MARKERS,
    color,
    marker,
)
from psgd.lab.results import RunData, load_run  # noqa: E402

__all__ = ["RunData", "load_run", "Series", "curves", "bars", "lines", "histograms", "color", "marker", "LINESTYLES",
           "MODE_COLORS", "MODE_MARKERS", "REF_COLOR", "VARIANT_COLORS", "VARIANT_MARKERS"]

BAND = "band: min-max over seeds"
AXIS_LABELS = {
    "elapsed_s": "wall time (s)", "version": "global updates", "samples": "training samples processed",
    "test_accuracy": "test accuracy", "test_loss": "test loss (cross-entropy)",
    "train_loss": "train loss (cross-entropy)",
}


@dataclass
class Series:
    label: str
    mode: str                 # a mode (coloured by MODE_COLORS), or "" with `variant` set
    runs: list[RunData] = field(default_factory=list)
    variant: int = -1         # index into VARIANT_COLORS for series that are not modes


def _styles(series: list[Series]) -> list[str]:
    seen: dict[str, int] = {}
    styles = []
    for s in series:
        key = s.mode if s.variant < 0 else f"variant{s.variant}"
        # All-reduce draws dashed: it coincides with sync by design, and both must stay visible.
        first = "--" if s.mode == "allreduce" and s.variant < 0 else "-"
        styles.append(first if seen.get(key, 0) == 0 else LINESTYLES[seen[key] % len(LINESTYLES)])
        seen[key] = seen.get(key, 0) + 1
    return styles


def _refs(ax, refs: list[tuple[float, str]] | None, horizontal: bool = True) -> None:
    for value, text in refs or []:
        if horizontal:
            ax.axhline(value, color=REF_COLOR, linestyle=":", linewidth=1.2, label=text)


def _legend(ax) -> None:
    # Outside the axes, to the right: a legend never covers data (bbox_inches="tight" keeps it).
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _band(runs: list[RunData], x: str, y: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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


def _save(fig, path: Path, header: list[str], rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def curves(series: list[Series], x: str, y: str, path: Path, title: str = "", logy: bool = False,
           refs: list[tuple[float, str]] | None = None):
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    rows = []
    for s, style in zip(series, _styles(series), strict=True):
        grid, mean, lo, hi = _band(s.runs, x, y)
        n = len(s.runs)
        c = color(s.mode, s.variant)
        ax.plot(grid, mean, style, color=c, marker=marker(s.mode, s.variant), markersize=4,
                markevery=max(1, len(grid) // 12), label=s.label + (f" ({n} seeds)" if n > 1 else ""))
        if n > 1:
            ax.fill_between(grid, lo, hi, color=c, alpha=0.15, linewidth=0)
        rows += [[s.label, s.mode, float(g), float(m), float(a), float(b)] for g, m, a, b in zip(grid, mean, lo, hi,
                                                                                                 strict=True)]
    _refs(ax, refs)
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax)
    _save(fig, path, ["series", "mode", x, f"{y}_mean", f"{y}_min", f"{y}_max"], rows)
    plt.close(fig)
    return fig


def bars(groups: list[str], bars_: dict[str, tuple[str, list[float], list[float] | None]], ylabel: str,
         path: Path, title: str = "", xlabel: str = "", refs: list[tuple[float, str]] | None = None):
    """Grouped bars: bars_[name] = (mode, values per group, optional error bars). A mode of the form
    "variant:I" colours the bar with VARIANT_COLORS[I]. Errors are half-widths, or (lo, hi) pairs
    of an interval around each value."""
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    width = 0.8 / max(1, len(bars_))
    rows = []
    for i, (name, (mode, values, errors)) in enumerate(bars_.items()):
        pos = np.arange(len(groups)) + (i - (len(bars_) - 1) / 2) * width
        hatch = ["", "//", "..", "xx"][i % 4] if list(m for m, _, _ in bars_.values()).count(mode) > 1 else ""
        variant = int(mode.split(":")[1]) if mode.startswith("variant:") else -1
        yerr = None
        if errors is not None:
            if errors and isinstance(errors[0], tuple):
                yerr = np.array([[max(0.0, v - lo) for (lo, _), v in zip(errors, values, strict=True)],
                                 [max(0.0, hi - v) for (_, hi), v in zip(errors, values, strict=True)]])
            else:
                yerr = errors
        ax.bar(pos, values, width, yerr=yerr, color=color(mode, variant), hatch=hatch, label=name,
               edgecolor="white", capsize=3)
        rows += [[name, mode, g, v, (errors[j] if errors else "")] for j, (g, v) in enumerate(zip(groups, values,
                                                                                                 strict=True))]
    _refs(ax, refs)
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    _legend(ax)
    _save(fig, path, ["bar", "mode", "group", "value", "error"], rows)
    plt.close(fig)
    return fig


def histograms(hists: dict[str, tuple[str, dict[str, int]]], path: Path, title: str = "",
               xlabel: str = "staleness (updates)"):
    """Normalised histograms (fraction of gradients) of value -> count maps, one line each."""
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    rows = []
    for i, ((name, (mode, hist)), style) in enumerate(zip(hists.items(), _styles([Series(n, m) for n, (m, _)
                                                                                   in hists.items()]), strict=True)):
        keys = sorted(int(k) for k in hist)
        total = sum(hist.values()) or 1
        fractions = [hist[str(k)] / total for k in keys]
        ax.plot(keys, fractions, style, marker=VARIANT_MARKERS[i % len(VARIANT_MARKERS)], markersize=3,
                color=color(mode), label=name)
        rows += [[name, mode, k, hist[str(k)], f] for k, f in zip(keys, fractions, strict=True)]
    # The long tail (a worker descheduled for a while) would squash the body: show up to the p99.5.
    tail = [k for _, (_, h) in hists.items() for k in _quantile_keys(h, 0.995)]
    if tail:
        ax.set_xlim(-0.5, max(tail) + 0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of applied gradients")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax)
    _save(fig, path, ["series", "mode", "value", "count", "fraction"], rows)
    plt.close(fig)
    return fig


def _quantile_keys(hist: dict[str, int], q: float) -> list[int]:
    keys = sorted(int(k) for k in hist)
    total, acc = sum(hist.values()), 0
    for k in keys:
        acc += hist[str(k)]
        if acc >= q * total:
            return [k]
    return keys[-1:]


def lines(xs: list[float], ys: dict[str, tuple], xlabel: str, ylabel: str, path: Path,
          title: str = "", logx: bool = False, logy: bool = False, refs: list[tuple[float, str]] | None = None,
          xticklabels: list[str] | None = None):
    """Simple x-y lines sharing one x axis: ys[name] = (mode, values) or (mode, values, (lo, hi) per
    point) for an interval band. Mode "ideal" is a grey reference line; "variant:I" a variant colour."""
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    rows = []
    styled = [Series(n, v[0] if not v[0].startswith("variant:") else "", variant=int(v[0].split(":")[1])
                     if v[0].startswith("variant:") else -1) for n, v in ys.items()]
    for (name, spec), st, style in zip(ys.items(), styled, _styles(styled), strict=True):
        mode, values = spec[0], spec[1]
        if mode == "ideal":
            ax.plot(xs, values, ":", color=REF_COLOR, label=name)
        else:
            ax.plot(xs, values, style, marker=marker(st.mode, st.variant), color=color(st.mode, st.variant),
                    label=name)
        if len(spec) > 2 and spec[2] is not None:
            ax.fill_between(xs, [a for a, _ in spec[2]], [b for _, b in spec[2]], color=color(st.mode, st.variant),
                            alpha=0.15, linewidth=0)
        rows += [[name, mode, x, v] for x, v in zip(xs, values, strict=True)]
    _refs(ax, refs)
    if logx:
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # label the measured points, not powers of 10
        ax.minorticks_off()
    if xticklabels is not None:  # categories at positions xs (e.g. IID, Dir(1), Dir(0.1))
        ax.set_xticks(xs, xticklabels)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax)
    _save(fig, path, ["series", "mode", "x", "y"], rows)
    plt.close(fig)
    return fig


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd plot", description="Compare runs on one figure (PNG + CSV).")
    p.add_argument("runs", nargs="+", help="run folders (with summary.json and metrics.jsonl)")
    p.add_argument("--x", default="elapsed_s", choices=("elapsed_s", "version", "samples"), help="x axis")
    p.add_argument("--y", default="test_accuracy", choices=("test_accuracy", "test_loss", "train_loss"), help="y axis")
    p.add_argument("--out", type=Path, default=Path("results/plot.png"), help="PNG path (a CSV is written beside)")
    p.add_argument("--title", default="", help="figure title")
    a = p.parse_args(argv)
    series = []
    for run in a.runs:
        try:
            data = load_run(run)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(str(e)) from None
        series.append(Series(Path(run).name, data.mode, [data]))
    curves(series, a.x, a.y, a.out, a.title)
    print(f"wrote {a.out} and {a.out.with_suffix('.csv')}")
    return 0


def grid_map(rows: list[str], cols: list[str], values: list[list[float]], texts: list[list[str]], path: Path,
             title: str = "", xlabel: str = "", cbar: str = ""):
    """A table of cells shaded by value in [0, 1] (greys: no mode colour), each with its text."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(cols), 0.9 + 0.55 * len(rows)))
    data = np.array(values, dtype=float)
    im = ax.imshow(data, cmap="Greys", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(texts):
        for j, text in enumerate(row):
            dark = data[i, j] > 0.55
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=cbar, fraction=0.05)
    _save(fig, path, ["row", "column", "value", "text"],
          [[r, c, data[i, j], texts[i][j]] for i, r in enumerate(rows) for j, c in enumerate(cols)])
    plt.close(fig)
    return fig
