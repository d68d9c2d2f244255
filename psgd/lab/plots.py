"""Figures from run results, each saved as PNG together with a CSV of the numbers it shows.

Contract:
- `Series(label, mode, runs)`: one line on a figure, drawn from one or more runs (seeds); with
  several seeds the line is the mean and the shaded band spans min..max over the seeds (`BAND`,
  which every caption quotes).
- `curves(series, x, y, path)` plots eval metrics (`test_accuracy`, `test_loss`, `val_accuracy`,
  ...) against `elapsed_s`, `version` (global updates) or `samples`; `bars(...)` (quantities
  whose zero means something: throughput, bytes), `dots(...)` (a value with its interval per
  category, on an axis that spans the data: accuracies), `lines(...)` (points with error bars for
  categories), `histograms(...)` (bars), `grid_map(...)`, `stacked(...)` and `forest(...)` (the
  report's first figure, psgd/lab/forest.py) cover the rest. Every function returns the matplotlib
  Figure (tests inspect its content) and writes `path` (.png) and the same name with .csv
  (psgd/lab/figure_kit.py `save`, with the look every figure shares: `Series`, styles, legends).
- `psgd plot RUN... --view curves | staleness | time`: convergence curves (the default), each
  run's staleness histogram (summary.json `staleness.hist`; a run with embedding rows by key adds
  its per-row one, `rows.staleness.hist`, as "NAME (per row)"), or where each run's worker time
  went (summary.json `time_breakdown_s`, stacked in loop order, wall time as a grey mark).
- One palette everywhere (psgd/core/palette.py: Okabe & Ito 2008, colour-blind safe): a colour per mode
  (`MODE_COLORS`) that nothing else uses; other variables (dtype, skew, batch, link) take
  `VARIANT_COLORS`. Every line has a marker, and modes that can coincide (sync and all-reduce
  compute the same numbers) differ in marker and style, so both stay visible. `refs` draws
  reference lines (chance loss, the paper's accuracy, ideal speedup) in grey. Legends sit
  outside the axes, so they never cover data.

    psgd plot results/runs/E1/sync-s0 results/runs/E1/async-s0 --x elapsed_s --y test_accuracy --out fig.png
    psgd plot results/runs/E1/sync-s0 results/runs/E1/async-s0 --view time --out time.png
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from psgd.core.palette import (
    LINESTYLES,
    MODE_COLORS,
    MODE_MARKERS,
    REF_COLOR,
    SEGMENT_COLORS,
    VARIANT_COLORS,
    VARIANT_MARKERS,
    color,
    marker,
)
from psgd.lab import figure_kit as kit
from psgd.lab.figure_kit import AXIS_LABELS, BAND, Series, plt, save
from psgd.lab.forest import forest
from psgd.lab.results import RunData, load_run

__all__ = ["RunData", "load_run", "Series", "BAND", "curves", "bars", "dots", "forest", "grid_map", "pooled", "lines",
           "histograms", "stacked", "save", "color", "marker", "LINESTYLES", "MODE_COLORS", "MODE_MARKERS",
           "REF_COLOR", "SEGMENT_COLORS", "VARIANT_COLORS", "VARIANT_MARKERS"]


def curves(series: list[Series], x: str, y: str, path: Path, title: str = "", logy: bool = False,
           refs: list[tuple[float, str]] | None = None):
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    rows = []
    for s, style in zip(series, kit.styles(series), strict=True):
        grid, mean, lo, hi = kit.band(s.runs, x, y)
        n = len(s.runs)
        c = color(s.mode, s.variant)
        ax.plot(grid, mean, style, color=c, marker=marker(s.mode, s.variant), markersize=4,
                markevery=max(1, len(grid) // 12), label=s.label + (f" ({n} seeds)" if n > 1 else ""))
        if n > 1:
            ax.fill_between(grid, lo, hi, color=c, alpha=0.15, linewidth=0)
        rows += [[s.label, s.mode, float(g), float(m), float(a), float(b)] for g, m, a, b in zip(grid, mean, lo, hi,
                                                                                                 strict=True)]
    kit.refs(ax, refs)
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(kit.axis_label(y, [r for s in series for r in s.runs]))
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    kit.legend(ax)
    save(fig, path, ["series", "mode", x, f"{y}_mean", f"{y}_min", f"{y}_max"], rows)
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
        # A value that is nan was never measured (a run not made): no bar, not a bar at zero.
        shown = [j for j, v in enumerate(values) if np.isfinite(v)]
        if yerr is not None and not isinstance(yerr, list | tuple):
            yerr = yerr[:, shown]
        elif yerr is not None:
            yerr = [yerr[j] for j in shown]
        ax.bar(pos[shown], [values[j] for j in shown], width, yerr=yerr, color=color(mode, variant), hatch=hatch,
               label=name, edgecolor="white", capsize=3)
        rows += [[name, mode, groups[j], values[j], (errors[j] if errors else "")] for j in shown]
    kit.refs(ax, refs)
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    kit.legend(ax)
    save(fig, path, ["bar", "mode", "group", "value", "error"], rows)
    plt.close(fig)
    return fig


def dots(groups: list[str], series: dict[str, tuple[str, list[float], list[tuple[float, float]] | None]],
         ylabel: str, path: Path, title: str = "", xlabel: str = "", refs: list[tuple[float, str]] | None = None):
    """A dot plot: series[name] = (mode or "variant:I", a value per group, optional (lo, hi) per
    group), each value a marker with its interval, nudged apart per series. The y axis spans the
    data, not zero to the top: a one-point difference between 0.61 and 0.62 stays visible (bars from
    zero would hide it). A nan value was not measured and is left out. Long group names wrap."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 1.5 * len(groups)), 4.2))
    rows = []
    for i, (name, (mode, values, ends)) in enumerate(series.items()):
        variant = int(mode.split(":")[1]) if mode.startswith("variant:") else -1
        c = color(mode, variant)
        nudge = (i - (len(series) - 1) / 2) * 0.12
        for j, v in enumerate(values):
            if not np.isfinite(v):
                continue
            lo, hi = ends[j] if ends is not None else (v, v)
            err = [[max(0.0, v - lo)], [max(0.0, hi - v)]] if np.isfinite(lo) and np.isfinite(hi) else None
            ax.errorbar([j + nudge], [v], yerr=err, fmt=marker(mode, variant), color=c, markersize=7, capsize=4,
                        label=name if j == next(k for k, x in enumerate(values) if np.isfinite(x)) else None)
            rows.append([name, mode, groups[j], v, lo, hi])
    kit.refs(ax, refs)
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, 16) for g in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    kit.legend(ax)
    save(fig, path, ["series", "mode", "group", "value", "lo", "hi"], rows)
    plt.close(fig)
    return fig


def pooled(hists: list[dict[str, int]]) -> dict[str, int]:
    """value -> count maps summed (the seeds of one configuration pooled into one histogram)."""
    out: dict[str, int] = {}
    for h in hists:
        for k, n in h.items():
            out[str(k)] = out.get(str(k), 0) + int(n)
    return out


def clip_at(hist: dict[str, int], quantile: float = 0.995) -> int:
    """The smallest value with at least `quantile` of the counts at or below it."""
    total, seen = sum(hist.values()), 0
    for k in sorted(int(k) for k in hist):
        seen += hist[str(k)]
        if seen >= quantile * total:
            return k
    return max(int(k) for k in hist)


def histograms(hists: dict[str, tuple[str, dict[str, int]]], path: Path, title: str = "",
               xlabel: str = "staleness (updates)", logy: bool = False):
    """Normalised histograms (fraction of gradients) of value -> count maps, as solid bars side by
    side at each value (a count is discrete: no line between values; together 0.85 wide). The x axis
    ends at the pooled 99.5th percentile (`clip_at`) when a thin tail runs further, and a note on
    the figure states the maximum and how many gradients lie beyond (the CSV keeps them all), so a
    single gradient at 109 does not shrink every bar to a sliver; `logy` keeps small fractions
    visible. Repeated modes are told apart by hatching."""
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    rows = []
    width = 0.85 / max(1, len(hists))
    modes = [m for m, _ in hists.values()]
    for i, (name, (mode, hist)) in enumerate(hists.items()):
        keys = sorted(int(k) for k in hist)
        total = sum(hist.values()) or 1
        fractions = [hist[str(k)] / total for k in keys]
        hatch = ["", "//", "..", "xx"][modes[:i].count(mode) % 4]
        ax.bar(np.array(keys, dtype=float) + (i - (len(hists) - 1) / 2) * width, fractions, width, color=color(mode),
               hatch=hatch, edgecolor="white" if hatch else color(mode), linewidth=0.5 if hatch else 0, label=name)
        rows += [[name, mode, k, hist[str(k)], f] for k, f in zip(keys, fractions, strict=True)]
    everything = pooled([h for _, h in hists.values()])
    if everything:
        top, edge = max(int(k) for k in everything), clip_at(everything)
        if top > edge:
            beyond = sum(n for k, n in everything.items() if int(k) > edge)
            ax.set_xlim(min(int(k) for k in everything) - 0.6, edge + 0.6)
            ax.text(0.99, 0.97, f"axis ends at the 99.5th percentile, {edge}; {beyond} gradient(s) beyond it, "
                    f"up to {top}", transform=ax.transAxes, ha="right", va="top", fontsize=8, color=REF_COLOR)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # staleness is a whole number of updates
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of applied gradients" + (" (log scale)" if logy else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    kit.legend(ax)
    save(fig, path, ["series", "mode", "value", "count", "fraction"], rows)
    plt.close(fig)
    return fig


def lines(xs: list[float], ys: dict[str, tuple], xlabel: str, ylabel: str, path: Path,
          title: str = "", logx: bool = False, logy: bool = False, refs: list[tuple[float, str]] | None = None,
          xticklabels: list[str] | None = None, points: bool | None = None, ymin0: bool = False):
    """Simple x-y lines sharing one x axis: ys[name] = (mode, values) or (mode, values, (lo, hi) per
    point) for an interval band. Mode "ideal" is a grey reference line; "variant:I" a variant colour.
    `points` (the default when `xticklabels` names categories): markers with error bars, nudged
    apart per series, and no line or band, since nothing lies between two categories. `ymin0`: the
    y axis starts at zero (a throughput's scale)."""
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    rows = []
    points = xticklabels is not None if points is None else points
    styled = [Series(n, v[0] if not v[0].startswith("variant:") else "", variant=int(v[0].split(":")[1])
                     if v[0].startswith("variant:") else -1) for n, v in ys.items()]
    drawn = [n for n, v in ys.items() if v[0] != "ideal"]
    for (name, spec), st, style in zip(ys.items(), styled, kit.styles(styled), strict=True):
        mode, values = spec[0], spec[1]
        band = spec[2] if len(spec) > 2 else None
        c = color(st.mode, st.variant)
        if mode == "ideal":
            ax.plot(xs, values, ":", color=REF_COLOR, label=name)
        elif points:
            nudge = (drawn.index(name) - (len(drawn) - 1) / 2) * 0.06
            at = [x * 10 ** nudge for x in xs] if logx else [x + nudge for x in xs]
            err = None if band is None else np.array(
                [[max(0.0, v - a) for v, (a, _) in zip(values, band, strict=True)],
                 [max(0.0, b - v) for v, (_, b) in zip(values, band, strict=True)]])
            ax.errorbar(at, values, yerr=err, fmt=marker(st.mode, st.variant), color=c, capsize=3, markersize=6,
                        linestyle="none", label=name)
        else:
            ax.plot(xs, values, style, marker=marker(st.mode, st.variant), color=c, label=name)
            if band is not None:
                ax.fill_between(xs, [a for a, _ in band], [b for _, b in band], color=c, alpha=0.15, linewidth=0)
        rows += [[name, mode, x, v] for x, v in zip(xs, values, strict=True)]
    kit.refs(ax, refs)
    if logx:
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # label the measured points, not powers of 10
        ax.minorticks_off()
    if xticklabels is not None:  # categories at positions xs (e.g. IID, Dir(1), Dir(0.1))
        ax.set_xticks(xs, xticklabels)
    if points and not logx:
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    if logy:
        ax.set_yscale("log")
    if ymin0:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    kit.legend(ax)
    save(fig, path, ["series", "mode", "x", "y"], rows)
    plt.close(fig)
    return fig


VIEWS = ("curves", "staleness", "time")


def _default_y(runs: dict[str, RunData]) -> str:
    """Test accuracy where every run records one; else (a regression --loss: psgd reports accuracy for
    cross-entropy alone) the test loss."""
    return "test_accuracy" if all(any(e.get("test_accuracy") is not None for e in d.evals) for d in runs.values()) \
        else "test_loss"


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd plot", description="Compare runs on one figure (PNG + CSV). Views: curves (an eval "
               "metric against --x), staleness (each run's staleness histogram), time (where each run's worker "
               "time went: compute / pull / push / wait). One run's timeline: psgd trace RUN.")
    p.add_argument("runs", nargs="+", help="run folders (with summary.json and metrics.jsonl)")
    p.add_argument("--view", default="curves", choices=VIEWS, help="what to compare (default: %(default)s)")
    p.add_argument("--x", default=None, choices=("elapsed_s", "version", "samples"),
                   help="x axis of --view curves (default: elapsed_s)")
    p.add_argument("--y", default=None, choices=("test_accuracy", "test_loss", "train_loss"),
                   help="y axis of --view curves (default: test_accuracy; test_loss for runs without accuracy, "
                        "e.g. --loss mse)")
    p.add_argument("--out", type=Path, default=None,
                   help="PNG path, a CSV is written beside (default: results/plot.png, results/plot-VIEW.png "
                        "for the other views)")
    p.add_argument("--title", default="", help="figure title")
    a = p.parse_args(argv)
    if a.view != "curves" and (a.x or a.y):
        raise UsageError(f"--x and --y choose the axes of --view curves; --view {a.view} has fixed axes")
    out = a.out or Path("results/plot.png" if a.view == "curves" else f"results/plot-{a.view}.png")
    runs = {}
    for run in a.runs:
        try:
            runs[Path(run).name] = load_run(run)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(str(e)) from None
    if a.view == "curves":
        x, y = a.x or "elapsed_s", a.y or _default_y(runs)
        if lacking := [name for name, data in runs.items() if not any(e.get(y) is not None for e in data.evals)]:
            raise UsageError(f"{', '.join(lacking)}: no {AXIS_LABELS.get(y, y)} recorded"
                             + (" (a run whose --loss is not cross_entropy has no accuracy): use --y test_loss"
                                if y == "test_accuracy" else ""))
        curves([Series(name, data.mode, [data]) for name, data in runs.items()], x, y, out,
               a.title or f"{kit.axis_label(y, list(runs.values()))} against {AXIS_LABELS.get(x, x)}: "
                          f"{', '.join(runs)}")
    elif a.view == "staleness":
        # Sync and all-reduce apply every gradient fresh: one bar at 0, or none at all (no shards).
        hists = {name: (data.mode, data.summary["staleness"]["hist"]) for name, data in runs.items()}
        # With embedding rows by key (--embeddings rows / hybrid): each row gradient's own staleness beside it.
        hists.update({f"{name} (per row)": (data.summary["rows"]["mode"], data.summary["rows"]["staleness"]["hist"])
                      for name, data in runs.items() if "rows" in data.summary})
        histograms(hists, out, a.title or "staleness of applied gradients")
    else:
        # Stacked in loop order (the palette lists the parts so), as psgd trace draws a step.
        parts = {k: [data.summary["time_breakdown_s"][k] for data in runs.values()] for k in SEGMENT_COLORS}
        stacked(list(runs), parts,
                "seconds per worker (mean over workers)", out, a.title or "where the workers' time went",
                marks=("wall time", [data.summary["wall_time_s"] for data in runs.values()]))
    print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


def stacked(groups: list[str], parts: dict[str, list[float]], ylabel: str, path: Path, title: str = "",
            marks: tuple[str, list[float]] | None = None):
    """One stacked bar per group: parts[name] = a value per group, stacked in the dict's order and
    coloured by SEGMENT_COLORS (the parts of a step). `marks` = (label, a value per group) draws a
    grey tick across each bar (e.g. wall time, whose gap to the stack is time no part accounts for)."""
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 + 1.1 * len(groups)), 4.2))
    pos = np.arange(len(groups))
    base = np.zeros(len(groups))
    rows, handles = [], []
    for name, values in parts.items():
        handles.insert(0, ax.bar(pos, values, 0.6, bottom=base, color=SEGMENT_COLORS.get(name, REF_COLOR), label=name,
                                 edgecolor="white"))
        base += np.asarray(values, dtype=float)
        rows += [[g, name, v] for g, v in zip(groups, values, strict=True)]
    if marks is not None:
        label, values = marks
        handles.insert(0, ax.hlines(values, pos - 0.4, pos + 0.4, color=REF_COLOR, linestyle="--", linewidth=1.5,
                                    label=label))
        rows += [[g, label, v] for g, v in zip(groups, values, strict=True)]
    ax.set_xticks(pos, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    kit.legend(ax, handles)  # top down, as the stack shows its parts
    save(fig, path, ["group", "part", "value"], rows)
    plt.close(fig)
    return fig


def grid_map(rows: list[str], cols: list[str], values: list[list[float]], texts: list[list[str]], path: Path,
             title: str = "", xlabel: str = "", cbar: str = "", cmap: str = "Greys", vmin: float = 0.0,
             vmax: float = 1.0, hatched: list[list[bool]] | None = None):
    """A table of cells shaded by value in [vmin, vmax] (greys by default: no mode colour; `cmap`
    another colour-blind-safe map, e.g. "cividis" for accuracy), each with its text; `hatched`
    marks cells (e.g. runs that diverged) with a hatch on top of their shade, so a second variable
    reads beside the first."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(cols), 0.9 + 0.55 * len(rows) + 0.2 * (hatched is not None)))
    data = np.array(values, dtype=float)
    im = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    mapper = matplotlib.colormaps[cmap]
    for i, row in enumerate(texts):
        for j, text in enumerate(row):
            shade = (data[i, j] - vmin) / max(1e-12, vmax - vmin) if np.isfinite(data[i, j]) else 0.0
            r, g, b, _ = mapper(shade)
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5   # the text's colour against the cell's luminance
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
            if hatched is not None and hatched[i][j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor=REF_COLOR,
                                       linewidth=0))
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=cbar, fraction=0.05)
    save(fig, path, ["row", "column", "value", "text"],
          [[r, c, data[i, j], texts[i][j]] for i, r in enumerate(rows) for j, c in enumerate(cols)])
    plt.close(fig)
    return fig
