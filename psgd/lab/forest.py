"""The report's first figure: every claim's effects with their intervals, on one forest plot.

Contract:
- `forest(claims, path, title)`: claims = [(id, verdict, effects)], each effect a
  psgd.lab.verdicts.Effect (label, interval, margin, null, test, unit, its part's outcome). One row
  per effect, a panel per unit (ratios, null above 0, apart from differences of ratios, null 0:
  `_panel`), a grey band null +- margin; the marker and colour are the part's own
  outcome (`VERDICT_STYLES`, readable without colour too); a row's name is cut to `LABEL_CHARS`.
  Writes the PNG and a CSV of one row per effect (psgd/lab/figure_kit.py `save`); returns the Figure.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from matplotlib.patches import Rectangle

from psgd.core.palette import REF_COLOR
from psgd.lab.figure_kit import plt, save

__all__ = ["VERDICT_STYLES", "UNIT_AXES", "forest"]


# The verdicts' look on the forest plot: a colour (none of them a mode's) and a marker each, so a
# verdict reads without colour too; inconclusive is hollow.
VERDICT_STYLES = {"confirmed": ("#000000", "o", True), "refuted": ("#8C6D31", "X", True),
                  "depends": ("#56B4E9", "D", True), "inconclusive": ("#777777", "o", False),
                  "not testable here": ("#999999", "s", False)}
UNIT_AXES = {"accuracy": "difference in test accuracy (each claim at its own scoring: end or best validation)",
             "x": "difference of two ratios (x)", "x ratio": "ratio (x)",
             "share": "share", "nats": "difference in test loss (nats per character, at each claim's scoring)"}


LABEL_CHARS = 64   # a row's name at most; the canvas widens with the longest


def _panel(e) -> str:
    """The forest's panel of an effect: its unit, with ratios (null above 0: E5's factor, E19's and E20's
    time ratios) apart from differences of ratios (null 0: E2's, E4's, E10's), so each axis says what it draws."""
    return "x ratio" if e.unit == "x" and e.null != 0 else e.unit


def _short(label: str) -> str:
    """A row's name within LABEL_CHARS: a sentence-long label squeezed the panels into a third of the
    canvas (tight_layout gave up); the CSV keeps every label whole."""
    return textwrap.shorten(label, LABEL_CHARS, placeholder=" ...")


def forest(claims: list[tuple[str, str, list]], path: Path, title: str = ""):
    """The whole comparison on one figure: per claim (id, verdict, effects: psgd.lab.verdicts.Effect
    each), one row per effect with its estimate and 95% interval, over a grey band null +- margin
    (smaller than that does not matter, or cannot be told from the noise floor); a panel per unit,
    the marker and colour the part's own outcome (a claim of parts that disagree reads "depends";
    each part shows its side). A point of one replicate (n = 1, no interval) is a cross and says
    "n=1". Claims with no effect (not testable here) are named under the plot. The CSV has one row
    per effect."""
    rows, units = [], []
    for exp_id, verdict, effects in claims:
        for e in effects:
            rows.append((exp_id, verdict, e))
            if _panel(e) not in units:
                units.append(_panel(e))
    bare = [f"{exp_id} ({verdict})" for exp_id, verdict, effects in claims if not effects]
    counts = [sum(1 for _, _, e in rows if _panel(e) == u) for u in units] or [1]
    # The canvas grows with the longest row name, so the panels keep their width beside it.
    longest = max((len(f"{i}: {_short(e.label)} (no worse)") for i, _, e in rows), default=0)
    fig, axes = plt.subplots(len(counts), 1, figsize=(max(8.4, 6.0 + 0.06 * longest),
                                                      1.1 + 0.32 * sum(counts) + 0.5 * len(counts)),
                             gridspec_kw={"height_ratios": counts}, squeeze=False)
    seen: dict[str, object] = {}
    for ax, unit in zip(axes[:, 0], units, strict=False):
        mine = [(i, v, e) for i, v, e in rows if _panel(e) == unit]
        for y, (_, _verdict, e) in enumerate(mine):
            c, mk, filled = VERDICT_STYLES.get(e.outcome, (REF_COLOR, "o", False))
            ax.add_patch(Rectangle((e.null - e.margin, y - 0.38), 2 * e.margin, 0.76,
                                                      color="#DDDDDD", linewidth=0, zorder=0))
            ax.plot([e.null, e.null], [y - 0.42, y + 0.42], color=REF_COLOR, linewidth=0.8, zorder=1)
            est, lo, hi = e.ci.estimate, e.ci.lo, e.ci.hi
            if not np.isfinite(est):
                continue
            if e.ci.n > 1 and np.isfinite(lo) and np.isfinite(hi):
                ax.plot([lo, hi], [y, y], color=c, linewidth=1.6, zorder=2)
            single = e.ci.n <= 1   # one replicate: no interval, so no zero-width bar that looks certain
            h = ax.plot([est], [y], "X" if single else mk, color=c, markersize=7 if single else 6,
                        markerfacecolor="white" if single or not filled else c, markeredgecolor=c, zorder=3,
                        label=e.outcome)[0]
            seen.setdefault(e.outcome, h)
        ax.set_yticks(range(len(mine)), [f"{i}: {_short(e.label)}" + (" (no worse)" if e.test == "no_worse" else "")
                                         + (" (n=1)" if e.ci.n <= 1 else "") for i, _, e in mine], fontsize=8)
        ax.set_ylim(len(mine) - 0.5, -0.5)
        ax.set_xlabel(UNIT_AXES.get(unit, unit), fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    if title:
        axes[0, 0].set_title(title)
    order = [v for v in VERDICT_STYLES if v in seen]
    if order:
        axes[0, 0].legend(handles=[seen[v] for v in order], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                          borderaxespad=0.0, title="part's outcome", title_fontsize=8)
    if bare:
        fig.text(0.01, 0.0, "No effect measured: " + ", ".join(bare), fontsize=8, ha="left", va="top")
    fig.tight_layout()
    save(fig, path, ["claim", "verdict", "effect", "unit", "test", "estimate", "lo", "hi", "seeds", "null", "margin",
                     "part_outcome"],
         [[i, v, e.label, e.unit, e.test, e.ci.estimate, e.ci.lo, e.ci.hi, e.ci.n, e.null, e.margin, e.outcome]
          for i, v, e in rows] + [[i, v, "", "", "", "", "", "", "", "", "", ""]
                                   for i, v, effects in claims if not effects])
    plt.close(fig)
    return fig
