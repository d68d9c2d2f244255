"""Analyses of the remedies: what the field does about each problem the suite shows, measured
beside that problem on the same model, data and seeds (backup workers against stragglers,
staleness-aware rates and DC-ASGD against stale gradients, sparsified pushes against the
central server's link). Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here.

E12 (`staleness_remedies`): E3's stability map (async with N workers across rising rates, the
same runs where the configs are equal) with three more arms at each cell, the remedies applied by
the shard (psgd/core/staleness.py): `--staleness-lr`, `--dc-lambda`, and momentum 0 (Mitliagkas
et al. 2016: asynchrony already acts as momentum). Per cell: each arm's accuracy minus plain
async's, and the fraction of plain async's gap to sync (same N, same rate) that it closes.
"""

from __future__ import annotations

import math

import numpy as np

from psgd.core import staleness
from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, acc_ci, diff
from psgd.lab.results import Figure, Group, diverged, table

PLAIN, SYNC = "async", "sync"
REMEDIES = ("staleness-aware rate", "DC-ASGD")   # the claim's; momentum 0 is shown beside them
MOMENTUM0 = "async, momentum 0"


def arm(g: Group) -> str:
    """Which arm of the map a run is, from its config."""
    cfg = g.cfg
    if g.mode == "sync":
        return SYNC
    names = [n for n, on in (("staleness-aware rate", cfg.get("staleness_lr")), ("DC-ASGD", cfg.get("dc_lambda")))
             if on]
    if names:
        return " + ".join(names)
    return MOMENTUM0 if cfg["optim"]["momentum"] == 0 else PLAIN


def _remedy(g: Group, key: str) -> float:
    """A field of summary.json's `remedies` averaged over seeds (nan when the run had none)."""
    values = [(r.summary.get("remedies") or {}).get(key) for r in g.runs]
    return float(np.mean(values)) if all(v is not None for v in values) else float("nan")


def staleness_remedies(ctx: Context):
    exp, out = ctx.exp, ctx.out
    margin = float(ctx.params.get("margin", 0.02))
    cell: dict[tuple[str, int, float], Group] = {(arm(g), g.cfg["workers"], g.lr): g for g in ctx.groups.values()}
    arms = [a for a in (SYNC, PLAIN, *REMEDIES, MOMENTUM0) if any(k[0] == a for k in cell)]
    arms += sorted({k[0] for k in cell} - set(arms))
    ns = sorted({k[1] for k in cell})
    lrs = sorted({k[2] for k in cell})

    # The verdict's cells and every arm's share of the gap it closes.
    cells, closed = [], {}
    for (a, n, lr), g in sorted(cell.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        plain, ref = cell.get((PLAIN, n, lr)), cell.get((SYNC, n, lr))
        if a in (PLAIN, SYNC) or plain is None or ref is None:
            continue
        gap, gain = diff(ref, plain), diff(g, plain)
        closed[(a, n, lr)] = (stats.gap_closed_ci(plain.finals(), g.finals(), ref.finals())
                              if V.effect(gap, margin) == V.CONFIRMED else None)
        if a in REMEDIES:
            cells.append(V.RemedyCell(a, n, lr, gap, gain, closed[(a, n, lr)]))
    verdict = V.remedies_close_the_gap(cells, margin)

    # Figure 1: E3's map with the remedies as more rows; shade = seeds diverged, text = accuracy.
    rows = [(a, n) for n in ns for a in arms if any((a, n, lr) in cell for lr in lrs)]
    names = [f"{a} N={n}" for a, n in rows]
    frac = [[float(np.mean([diverged(r) for r in cell[(a, n, lr)].runs])) if (a, n, lr) in cell else float("nan")
             for lr in lrs] for a, n in rows]
    texts = [[f"{acc_ci(cell[(a, n, lr)]).estimate:.2f}" if (a, n, lr) in cell else "" for lr in lrs]
             for a, n in rows]
    f1 = out / "stability_map.png"
    plots.grid_map(names, [f"{lr:g}" for lr in lrs], frac, texts, f1, f"{exp.id}: remedies on the stability map",
                   xlabel="learning rate", cbar="fraction of seeds diverged")
    # Figure 2: the fraction of the gap each arm closes, where there is a gap.
    where = sorted({(n, lr) for (_, n, lr), c in closed.items() if c is not None})
    f2 = out / "gap_closed.png"
    shown = [a for a in arms if a not in (PLAIN, SYNC)]
    plots.bars([f"N={n} lr {lr:g}" for n, lr in where],
               {a: (f"variant:{i}", [_est(closed.get((a, n, lr))) for n, lr in where],
                    [_ends(closed.get((a, n, lr))) for n, lr in where]) for i, a in enumerate(shown)},
               "fraction of async's gap to sync closed", f2, f"{exp.id}: how much of the gap each arm closes",
               refs=[(1.0, "sync"), (0.0, "plain async")])

    header = ["arm", "N", "lr", "mean staleness", "momentum: set -> effective", "mean step scale",
              "DC term, relative to g", "w_then held (peak)", "test accuracy [95% CI]", "minus plain async",
              "gap to sync closed", "diverged"]
    body_rows = []
    for a, n in rows:
        for lr in lrs:
            g = cell.get((a, n, lr))
            if g is None:
                continue
            plain = cell.get((PLAIN, n, lr))
            mom, tau = float(g.cfg["optim"]["momentum"]), g.mean("staleness.mean")
            c = closed.get((a, n, lr))
            body_rows.append([
                a, n, f"{lr:g}", f"{tau:.2f}",
                f"{mom:g} -> {staleness.effective_momentum(mom, tau):.3f}" if g.mode != "sync" else f"{mom:g}",
                _num(_remedy(g, "mean_step_scale"), 2), _num(_remedy(g, "dc_relative_correction"), 3),
                _bytes(_remedy(g, "dc_memory_peak_bytes")), acc_ci(g).fmt(),
                diff(g, plain).fmt(signed=True) if plain is not None and a not in (PLAIN, SYNC) else "",
                c.fmt(2) if c is not None else "", f"{sum(diverged(r) for r in g.runs)}/{len(g.runs)}"])
    body = table(header, body_rows)
    body += "\n\n" + _notes(cell)
    headline = _headline(cells, closed, margin) or verdict.reason
    headline += "".join(f"; plain async at lr {near:g}, near the staleness-aware rate's mean step ({scale:.2f}x lr "
                        f"{lr:g}), reaches {acc_ci(p).fmt()} (N={n})"
                        for n, lr, scale, _, near, p in _rate_matched(cell))
    figs = [Figure(f1, f"Fraction of seeds ({ctx.seeds_note()}) that diverged, per arm and learning rate; cell text: "
                       "mean final test accuracy (no text: not run)."),
            Figure(f2, "Fraction of plain async's accuracy gap to sync (same N and rate) that each arm closes, "
                       "where that gap exceeds the margin; error bars: 95% bootstrap interval over seeds "
                       "(the three groups resampled apart).")]
    key = {"cells": [dict(remedy=c.remedy, workers=c.workers, lr=c.lr, gap=c.gap.estimate, gain=c.gain.estimate,
                          gain_ci=[c.gain.lo, c.gain.hi],
                          closed=None if c.closed is None else c.closed.estimate,
                          closed_ci=None if c.closed is None else [c.closed.lo, c.closed.hi]) for c in cells],
           "momentum0_closed": {f"N={n} lr={lr:g}": c.estimate for (a, n, lr), c in closed.items()
                                if a == MOMENTUM0 and c is not None}}
    return verdict, headline, body, figs, key


def _headline(cells: list[V.RemedyCell], closed: dict, margin: float) -> str:
    parts = [f"{c.remedy} closes {c.closed.fmt(2)} of it" for c in cells if c.closed is not None]
    parts += [f"momentum 0 closes {c.fmt(2)}" for (a, _, _), c in closed.items() if a == MOMENTUM0 and c is not None]
    gaps = sorted({(c.workers, c.lr, c.gap.fmt()) for c in cells if c.closed is not None})
    if not parts:
        return ""
    where = ", ".join(f"N={n} lr {lr:g} ({gap})" for n, lr, gap in gaps)
    return f"where plain async trails sync by more than {margin} in accuracy ({where}): " + ", ".join(parts)


def _rate_matched(cell: dict) -> list[tuple[int, float, float, Group, float, Group]]:
    """(N, lr, mean step scale, the staleness-aware group, the plain async rate nearest lr x scale,
    its group) per staleness-aware cell: the staleness-aware rate is also a smaller rate, and plain
    async at a smaller rate is the control that tells the two apart."""
    out = []
    for (a, n, lr), g in sorted(cell.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        scale = _remedy(g, "mean_step_scale")
        plains = {k[2]: v for k, v in cell.items() if k[0] == PLAIN and k[1] == n}
        if "staleness-aware" in a and math.isfinite(scale) and plains:
            near = min(plains, key=lambda x: abs(math.log(x / (lr * scale))))
            out.append((n, lr, scale, g, near, plains[near]))
    return out


def _notes(cell: dict) -> str:
    """The caveats that keep the table honest: the staleness-aware rate is also a smaller rate."""
    lines = [f"At N={n}, lr {lr:g} the staleness-aware rate takes a mean step of {scale:.2f}x, about plain async's "
             f"step at lr {lr * scale:.2g}; plain async at lr {near:g} ends at {acc_ci(p).fmt()} (staleness-aware at "
             f"lr {lr:g}: {acc_ci(g).fmt()}): compare these two to tell the remedy from a smaller step."
             for n, lr, scale, g, near, p in _rate_matched(cell)]
    dc = [(n, g) for (a, n, _), g in cell.items() if "DC-ASGD" in a]
    if dc:
        n, g = max(dc, key=lambda t: t[0])
        bound = _remedy(g, "dc_memory_bound_bytes")
        lines.append(f"DC-ASGD's memory: each shard keeps, per worker, the snapshot that worker pulled until its push "
                     f"(shared by workers on one version); measured peak {_bytes(_remedy(g, 'dc_memory_peak_bytes'))} "
                     f"at N={n}, bound N x parameters x wire bytes = {_bytes(bound)}. No remedy sends an extra "
                     "byte: bytes pushed and pulled per gradient are plain async's.")
    lines.append("Effective momentum (Mitliagkas et al. 2016, psgd/core/staleness.py): 1 - 1/(1/(1 - mu) + mean "
                 "staleness), the single momentum whose mean delay equals that of momentum mu followed by the "
                 "measured staleness; with mu = 0 and staleness N - 1 it is their implicit momentum 1 - 1/N. Their "
                 "queueing model (exponential compute times) is an assumption, not a measurement.")
    return "\n\n".join(lines)


def _est(ci: stats.Interval | None) -> float:
    return ci.estimate if ci is not None else float("nan")


def _ends(ci: stats.Interval | None) -> tuple[float, float]:
    return (ci.lo, ci.hi) if ci is not None else (float("nan"), float("nan"))


def _num(x: float, digits: int) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else ""


def _bytes(x: float) -> str:
    return f"{x / 2**20:.2f} MiB" if math.isfinite(x) else ""


ANALYSES: dict = {"staleness_remedies": staleness_remedies}
