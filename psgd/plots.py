"""Figures from run results, each saved as PNG together with a CSV of the numbers it shows.

Contract:
- `Series(label, mode, runs)`: one line on a figure, drawn from one or more runs (seeds); with
  several seeds the line is the mean and the shaded band spans min..max.
- `curves(series, x, y, path)` plots eval metrics (`test_accuracy`, `test_loss`, `train_loss`)
  against `elapsed_s`, `version` (global updates) or `samples`; `bars(...)` and `histograms(...)`
  cover the rest. Every function returns the matplotlib Figure (tests inspect its content) and
  writes `path` (.png) and the same name with .csv.
- One colour per mode in every figure (`MODE_COLORS`); variants of a mode differ by line style.

    psgd plot results/runs/E1/sync-s0 results/runs/E1/async-s0 --x elapsed_s --y test_accuracy --out fig.png
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, safe in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

MODE_COLORS = {"sync": "#1f77b4", "async": "#d62728", "ssp": "#2ca02c", "allreduce": "#9467bd",
               "ps": "#1f77b4", "ring": "#9467bd", "library": "#ff7f0e"}
LINESTYLES = ["-", "--", ":", "-."]
AXIS_LABELS = {
    "elapsed_s": "wall time (s)", "version": "global updates", "samples": "training samples processed",
    "test_accuracy": "test accuracy", "test_loss": "test loss (cross-entropy)",
    "train_loss": "train loss (cross-entropy)",
}


@dataclass
class RunData:
    summary: dict
    evals: list[dict]

    @property
    def mode(self) -> str:
        return self.summary["mode"]


def load_run(out: str | Path) -> RunData:
    out = Path(out)
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{out}: no summary.json (is this a finished run folder?)")
    summary = json.loads(summary_path.read_text())
    evals = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "eval":
            evals.append(e)
    evals.sort(key=lambda e: e["version"])
    return RunData(summary, evals)


@dataclass
class Series:
    label: str
    mode: str
    runs: list[RunData] = field(default_factory=list)


def color(mode: str) -> str:
    return MODE_COLORS.get(mode, "#7f7f7f")


def _styles(series: list[Series]) -> list[str]:
    seen: dict[str, int] = {}
    styles = []
    for s in series:
        styles.append(LINESTYLES[seen.get(s.mode, 0) % len(LINESTYLES)])
        seen[s.mode] = seen.get(s.mode, 0) + 1
    return styles


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


def curves(series: list[Series], x: str, y: str, path: Path, title: str = "", logy: bool = False):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = []
    for s, style in zip(series, _styles(series), strict=True):
        grid, mean, lo, hi = _band(s.runs, x, y)
        n = len(s.runs)
        ax.plot(grid, mean, style, color=color(s.mode), label=s.label + (f" ({n} seeds)" if n > 1 else ""))
        if n > 1:
            ax.fill_between(grid, lo, hi, color=color(s.mode), alpha=0.15, linewidth=0)
        rows += [[s.label, s.mode, float(g), float(m), float(a), float(b)] for g, m, a, b in zip(grid, mean, lo, hi,
                                                                                                 strict=True)]
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, ["series", "mode", x, f"{y}_mean", f"{y}_min", f"{y}_max"], rows)
    plt.close(fig)
    return fig


def bars(groups: list[str], bars_: dict[str, tuple[str, list[float], list[float] | None]], ylabel: str,
         path: Path, title: str = "", xlabel: str = ""):
    """Grouped bars: bars_[name] = (mode, values per group, optional error half-widths)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.8 / max(1, len(bars_))
    rows = []
    for i, (name, (mode, values, errors)) in enumerate(bars_.items()):
        pos = np.arange(len(groups)) + (i - (len(bars_) - 1) / 2) * width
        hatch = ["", "//", "..", "xx"][i % 4] if list(m for m, _, _ in bars_.values()).count(mode) > 1 else ""
        ax.bar(pos, values, width, yerr=errors, color=color(mode), hatch=hatch, label=name, edgecolor="white",
               capsize=3)
        rows += [[name, mode, g, v, (errors[j] if errors else "")] for j, (g, v) in enumerate(zip(groups, values,
                                                                                                 strict=True))]
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _save(fig, path, ["bar", "mode", "group", "value", "error"], rows)
    plt.close(fig)
    return fig


def histograms(hists: dict[str, tuple[str, dict[str, int]]], path: Path, title: str = "",
               xlabel: str = "staleness (updates)"):
    """Normalised histograms (fraction of gradients) of value -> count maps, one line each."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = []
    for (name, (mode, hist)), style in zip(hists.items(), _styles([Series(n, m) for n, (m, _) in hists.items()]),
                                           strict=True):
        keys = sorted(int(k) for k in hist)
        total = sum(hist.values()) or 1
        fractions = [hist[str(k)] / total for k in keys]
        ax.plot(keys, fractions, style, marker="o", markersize=3, color=color(mode), label=name)
        rows += [[name, mode, k, hist[str(k)], f] for k, f in zip(keys, fractions, strict=True)]
    # The long tail (a worker descheduled for a while) would squash the body: show up to the p99.5.
    tail = [k for _, (_, h) in hists.items() for k in _quantile_keys(h, 0.995)]
    if tail:
        ax.set_xlim(-0.5, max(tail) + 0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of applied gradients")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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


def lines(xs: list[float], ys: dict[str, tuple[str, list[float]]], xlabel: str, ylabel: str, path: Path,
          title: str = "", logx: bool = False, logy: bool = False):
    """Simple x-y lines sharing one x axis: ys[name] = (mode, values)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = []
    for (name, (mode, values)), style in zip(ys.items(), _styles([Series(n, m) for n, (m, _) in ys.items()]),
                                             strict=True):
        ax.plot(xs, values, style, marker="o", color=color(mode), label=name)
        rows += [[name, mode, x, v] for x, v in zip(xs, values, strict=True)]
    if logx:
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # label the measured points, not powers of 10
        ax.minorticks_off()
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, ["series", "mode", "x", "y"], rows)
    plt.close(fig)
    return fig


def main(argv: list[str]) -> int:
    from psgd.cli import Parser, UsageError

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
