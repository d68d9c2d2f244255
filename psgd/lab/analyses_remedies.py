"""Analyses of the remedies: what the field does about each problem the suite shows, measured
beside that problem on the same model, data and seeds (backup workers against stragglers,
staleness-aware rates and DC-ASGD against stale gradients, sparsified pushes against the
central server's link). Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here.

E12 (`staleness_remedies`): remedies for stale gradients applied by the shard (psgd/core/staleness.py:
`--staleness-lr`, `--dc-lambda` with `--dc-adaptive`, and momentum 0), on E3's runs where the configs
are equal. A cell is N workers with plain async at one rate; its arms are the remedies at that rate
(the staleness-aware rate at the rate whose mean step matches it), its reference the one-worker
control at that rate (same batch per update, nothing stale). The verdict's cell is plain async at
its best rate; each remedy is judged by its accuracy minus plain async's, paired by seed (t
intervals, psgd/lab/stats.py; DC-ASGD's settings with Bonferroni intervals, as the best of them is
chosen on the accuracy it is judged on), against the margin: confirmed, refuted or inconclusive.

E13 (`topk`): sparsified pushes per arm (label) against dense at equal samples: with error feedback
(plain, or with Deep Gradient Compression's momentum correction and warm-up) within the margin of
dense, without it below; which arms were still rising at the end.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import numpy as np

from psgd.core import staleness
from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, acc_ci, diff, series_of, variant_series
from psgd.lab.results import LAST_K, PLATEAU, Figure, Group, diverged, table, time_to

CONDITIONS = ("no straggler", "persistent straggler", "random jitter")
MIB = 2**20


# -- E11: backup workers -------------------------------------------------------------------------
def _arm(cfg: dict) -> str:
    """sync, sync b=1, async, ssp s=2: what a run does about a slow worker."""
    if cfg["mode"] == "ssp":
        return f"ssp s={cfg['staleness']}"
    b = cfg.get("backup_workers", 0)
    return f"sync b={b}" if cfg["mode"] == "sync" and b else cfg["mode"]


def _condition(cfg: dict) -> str:
    if cfg.get("straggler"):
        return "persistent straggler"
    return "random jitter" if cfg.get("jitter") else "no straggler"


def _dropped_share(summary: dict) -> float:
    """Share of the gradients pushed that were dropped (late) rather than applied: the shards
    count each dropped slice, so a whole gradient dropped by K shards is K of K x worker_steps."""
    pushed = summary["worker_steps"] * max(1, summary["servers"])
    return summary.get("dropped_gradients", 0) / pushed if pushed else 0.0


def applied_samples_per_s(g: Group) -> list[float]:
    """Per seed, the training samples per second that went into updates (a dropped gradient's do
    not): comparable across sync, sync with backup workers, async and SSP."""
    return [r.summary["samples_per_s"] * (1.0 - _dropped_share(r.summary)) for r in g.runs]


def backup_workers(ctx: Context):
    exp, out = ctx.exp, ctx.out
    by: dict[tuple[str, str], Group] = {(_arm(g.cfg), _condition(g.cfg)): g for g in ctx.groups.values()}
    arms = sorted({a for a, _ in by}, key=lambda a: (a.split()[0] != "sync", a))
    conditions = [c for c in CONDITIONS if any(c == k for _, k in by)]
    target = float(ctx.params.get("target_accuracy", 0.5))
    tput = {k: applied_samples_per_s(g) for k, g in by.items()}
    rows = []
    for c in conditions:
        for a in arms:
            if (a, c) not in by:
                continue
            g = by[(a, c)]
            tt = [time_to(r, target) for r in g.runs]
            rows.append([a, c, f"{g.lr:g}", stats.mean_ci(tput[(a, c)]).fmt(0), f"{g.mean('updates_per_s'):.0f}",
                         f"{100 * np.mean([_dropped_share(r.summary) for r in g.runs]):.1f}%",
                         f"{np.mean(tt):.1f}" if all(map(math.isfinite, tt)) else "not reached by all",
                         acc_ci(g).fmt()])
    body = table(["run", "condition", "lr", "applied samples/s [95% CI]", "updates/s", "gradients dropped",
                  f"s to {target:.0%} test acc", "test accuracy [95% CI]"], rows)
    f1 = out / "throughput.png"
    cis = {k: stats.mean_ci(v) for k, v in tput.items()}
    nan = float("nan")  # a condition an arm never ran: no bar (not a bar at zero)
    plots.bars(conditions, {a: (_style(a, arms), [cis[(a, c)].estimate if (a, c) in cis else nan for c in conditions],
                                [(cis[(a, c)].lo, cis[(a, c)].hi) if (a, c) in cis else (nan, nan)
                                 for c in conditions]) for a in arms},
               "applied samples/s (steady state)", f1, f"{exp.id}: throughput with a slow worker")
    shown = [g for c in conditions for a in arms if (a, c) in by and c != "random jitter" for g in [by[(a, c)]]]
    f2 = out / "accuracy_vs_elapsed_s.png"
    plots.curves(series_of(shown, [f"{_arm(g.cfg)}, {_condition(g.cfg)}" for g in shown]), "elapsed_s",
                 "test_accuracy", f2, f"{exp.id}: accuracy at equal wall time", refs=[(target, f"target {target:.0%}")])

    hurt = by[("sync", "persistent straggler")]
    backups = sorted(a for a in arms if a.startswith("sync b=") and (a, "persistent straggler") in by)
    base_t, hurt_t = tput[("sync", "no straggler")], tput[("sync", "persistent straggler")]
    loss = stats.Interval(*(1.0 - x for x in _ratio(hurt_t, base_t)), n=min(len(base_t), len(hurt_t)))
    b1 = backups[0]
    cost = diff(by[(b1, "persistent straggler")], hurt)
    key, lines, counted, avoided = {}, [], [], {}
    for b in backups:
        g = by[(b, "persistent straggler")]
        r = stats.recovered_ci(base_t, hurt_t, tput[(b, "persistent straggler")])
        d = diff(g, hurt)
        share = float(np.mean([_dropped_share(x.summary) for x in g.runs]))
        wasted = float(np.mean([x.summary["bytes_pushed"] * _dropped_share(x.summary) / x.summary["global_updates"]
                                for x in g.runs]))
        own = ""
        if (b, "no straggler") in tput:
            # Against its own run without the straggler: a backup arm is faster than sync even
            # without one (it never waits for the slowest of N), so "recovered" can pass 100%.
            own_t = tput[(b, "no straggler")]
            avoided[b] = stats.avoided_ci(base_t, hurt_t, own_t, tput[(b, "persistent straggler")])
            # Not a loss for certain: the straggler's late pushes are fewer, so a shard that drops
            # them can end up with less work than with four punctual workers.
            own_ratio = _ratio(tput[(b, "persistent straggler")], own_t)[0]
            own = (f" (with the straggler {b} runs at {own_ratio:.2f}x its own throughput without one, so it avoids "
                   f"{_scaled(avoided[b]).fmt(0)}% of sync's loss)")
            key.setdefault(b, {})["avoided"] = avoided[b].estimate
        lines.append(f"{b} recovers {_scaled(r).fmt(0)}% of the straggler's throughput loss{own} at "
                     f"{_scaled(d).fmt(1, signed=True)} accuracy points, dropping {100 * share:.0f}% of the gradients "
                     f"pushed ({wasted / 1e3:.0f} kB per update pushed for nothing)")
        per_s = stats.recovered_ci(by[("sync", "no straggler")].values("updates_per_s"), hurt.values("updates_per_s"),
                                   g.values("updates_per_s"))
        counted.append(f"{b}: {_scaled(per_s).fmt(0)}%")
        key[b] = {**key.get(b, {}), "recovered": r.estimate, "recovered_ci": [r.lo, r.hi],
                  "accuracy_points": 100 * d.estimate,
                  "accuracy_points_ci": [100 * d.lo, 100 * d.hi], "dropped_share": share,
                  "wasted_bytes_per_update": wasted}
    # The verdict's share: the avoided one where b=1 ran without the straggler too (its fair
    # baseline), else the recovered one.
    verdict = (V.backup_recovers(loss, avoided[b1], cost, measure="avoided") if b1 in avoided else
               V.backup_recovers(loss, stats.recovered_ci(base_t, hurt_t, tput[(b1, "persistent straggler")]), cost))
    per_update = float(np.mean([x.summary["bytes_pushed"] / x.summary["global_updates"] for x in hurt.runs]))
    headline = (f"one worker {_delay(ctx)} ms slower per step costs sync {100 * loss.estimate:.0f}% of its throughput; "
                + "; ".join(lines) + f"; sync pushes {per_update / 1e3:.0f} kB per update; no memory beyond sync's own")
    body += ("\n\nApplied samples/s: training samples per second that went into updates (a dropped gradient's "
             "samples do not count). Recovered share = (backup's - sync's with the straggler) / (sync's without - "
             "with), t interval over seeds; avoided share = 1 - (backup's without - with the straggler) / "
             "(sync's without - with), paired by seed: the part of sync's loss the backup arm does not suffer, "
             "measured from its own footing (it is faster than sync without a straggler too, so the recovered "
             "share can pass 100%); counted in updates/s instead, whatever their size, the "
             f"share recovered is {', '.join(counted)}. Accuracy points: backup minus sync, both with the straggler. "
             "Memory: a shard holds a step's first N-b gradients until it sums them in worker order, as sync does, "
             "and N integers of bookkeeping; bytes: every dropped gradient was pushed in full. "
             "Rates: the tuning table above; a straggler or jitter run takes the rate of its arm without one (as in "
             "E2), and the runs without a straggler are E2's (in the same CPU quota).")
    figs = [Figure(f1, "Steady-state applied samples/s per arm; error bars: 95% t interval over seeds."),
            Figure(f2, ctx.caption("Test accuracy against steady-state wall time; dotted: the target."))]
    key["straggler_loss"] = loss.estimate
    return verdict, headline, body, figs, key


def _style(arm: str, arms: list[str]) -> str:
    """A mode's colour for sync, async and SSP; a variant colour for each sync with backup workers."""
    return f"variant:{arms.index(arm)}" if " b=" in arm else arm.split()[0]


def _scaled(ci: stats.Interval, by: float = 100.0) -> stats.Interval:
    """The interval in percent (or points): 0.7 -> 70."""
    return stats.Interval(by * ci.estimate, by * ci.lo, by * ci.hi, ci.n)


def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) / mean(b) as (estimate, hi, lo): flipped so that 1 - x keeps lo below hi."""
    ci = stats.ratio_ci(a, b)
    return ci.estimate, ci.hi, ci.lo


def _delay(ctx: Context) -> int:
    return max((ms for g in ctx.groups.values() for _, ms in g.cfg.get("straggler", [])), default=0)


PLAIN, SYNC, CONTROL = "async", "sync", "one worker (control)"
SA = "staleness-aware rate"
MOMENTUM0 = "async, momentum 0"
LEVEL = stats.LEVEL


def arm(g: Group) -> str:
    """Which arm a run is, from its config: the control, sync, plain async, or its remedies."""
    cfg = g.cfg
    if g.mode == "sync":
        return SYNC
    if cfg["workers"] == 1:
        return CONTROL
    names = [SA] if cfg.get("staleness_lr") else []
    lam = cfg.get("dc_lambda") or 0.0
    if lam:
        names.append(f"DC-ASGD-a λ0={lam:g}" if cfg.get("dc_adaptive") else f"DC-ASGD λ={lam:g}")
    if names:
        return " + ".join(names)
    return MOMENTUM0 if cfg["optim"]["momentum"] == 0 else PLAIN


def _is_dc(a: str) -> bool:
    return "DC-ASGD" in a


def _remedy(g: Group, key: str) -> float:
    """A field of summary.json's `remedies` averaged over seeds (nan when the run had none)."""
    values = [(r.summary.get("remedies") or {}).get(key) for r in g.runs]
    return float(np.mean(values)) if all(v is not None for v in values) else float("nan")


@dataclass
class Cell:
    """One cell of the design: N workers, plain async at rate `lr`, and the arms judged against it.
    A DC-ASGD arm runs at the same rate; a staleness-aware arm at the rate whose mean step (lr x
    its measured mean step scale) is nearest `lr` (`matched`: that step / lr)."""
    workers: int
    lr: float
    plain: Group
    control: Group | None
    sync: Group | None
    arms: dict[str, Group]
    matched: dict[str, float]

    def judged(self, a: str) -> bool:
        """A staleness-aware arm counts in the verdict when its mean step is within 25% of plain's."""
        return a not in self.matched or abs(math.log(self.matched[a])) < math.log(1.25)


def _cells(cell: dict[tuple[str, int, float], Group]) -> list[Cell]:
    out = []
    for n in sorted({k[1] for k in cell if k[0] == PLAIN}):
        plains = {lr: g for (a, m, lr), g in cell.items() if a == PLAIN and m == n}
        for lr, plain in sorted(plains.items()):
            arms = {a: g for (a, m, r), g in cell.items() if m == n and r == lr and a not in (PLAIN, SYNC, CONTROL)
                    and SA not in a}
            matched = {}
            for (a, m, r), g in cell.items():
                scale = _remedy(g, "mean_step_scale")
                if m == n and SA in a and math.isfinite(scale):
                    # Beside the plain async rate nearest its mean step; judged only when the two are
                    # within 25% (`matched`), else shown with the ratio: no control for it.
                    if min(plains, key=lambda x: abs(math.log(x / (r * scale)))) == lr:
                        name = f"{a} at lr {r:g}"
                        arms[name], matched[name] = g, r * scale / lr
            if arms:
                out.append(Cell(n, lr, plain, cell.get((CONTROL, 1, lr)), cell.get((SYNC, n, lr)), arms, matched))
    return out


def _primary(cells: list[Cell]) -> Cell | None:
    """The verdict's cell: at the smallest N with remedies, the cell whose plain async is best (the
    design puts the remedies at plain async's best rate; `_verdict` says when it is not)."""
    if not cells:
        return None
    n = min(c.workers for c in cells)
    return max((c for c in cells if c.workers == n), key=lambda c: acc_ci(c.plain).estimate)


def _verdict(c: Cell | None, grid: dict[float, Group], margin: float) -> tuple[V.Verdict, dict]:
    """Per remedy at the primary cell, gained on plain async (paired by seed, t intervals):
    DC-ASGD confirmed when any of its k settings gains more than the margin at the Bonferroni level
    1 - 0.05 / k (the best of k is chosen on the same test accuracy), refuted when every setting's
    interval is below the margin, else inconclusive; the staleness-aware rate against plain async
    at the matched mean step, by `effect`. No gap between the control and plain async: nothing to
    close, inconclusive."""
    if c is None or c.control is None:
        return V.Verdict(V.INCONCLUSIVE, "no cell with plain async, its one-worker control and a remedy at one "
                                         "rate"), {}
    gap = diff(c.control, c.plain)
    best = max(grid, key=lambda lr: acc_ci(grid[lr]).estimate)
    rates = "{" + ", ".join(f"{x:g}" for x in sorted(grid)) + "}"
    if best != c.lr:
        which = (f"not plain async's best rate of {rates} here ({best:g}: {acc_ci(grid[best]).fmt()}; at {c.lr:g}: "
                 f"{acc_ci(c.plain).fmt()})")
    else:
        edge = (": the lowest of the grid, a smaller rate may do better" if c.lr == min(grid) else
                ": the highest of the grid" if c.lr == max(grid) else "")
        which = f"plain async's best rate of {rates}{edge}"
    where = (f"at N={c.workers}, lr {c.lr:g} ({which}), the one-worker control minus plain async is "
             f"{gap.fmt(signed=True)}")
    key = {"workers": c.workers, "lr": c.lr, "gap": gap.estimate, "gap_ci": [gap.lo, gap.hi]}
    margin = V.accuracy_margin(margin)[0]  # raised to the noise floor, as every accuracy rule's
    cost = V.effect(gap, margin)
    if cost != V.CONFIRMED:
        why = (f"staleness costs plain async less than {margin} there" if cost == V.REFUTED else
               f"that staleness costs plain async more than {margin} there is not established (the interval "
               f"reaches below it)")
        # The gap is the number that decided it: the forest shows it (a claim with no part would be
        # missing from it).
        return V.Verdict(V.INCONCLUSIVE, f"{where}: {why}, so there is no measured gap for a remedy to close",
                         (V.part(f"{CONTROL} - plain async (the gap), {where}", gap, margin, "effect"),)), key
    parts, texts = [], []
    dcs = {a: g for a, g in c.arms.items() if _is_dc(a)}
    if dcs:
        level = 1 - (1 - LEVEL) / len(dcs)
        gains = {a: stats.diff_ci(g.finals(), c.plain.finals(), level=level, paired=g.seeds == c.plain.seeds)
                 for a, g in dcs.items()}
        effects = {a: V.effect(ci, margin) for a, ci in gains.items()}
        best = max(gains, key=lambda a: gains[a].estimate)
        dc = (V.CONFIRMED if V.CONFIRMED in effects.values() else
              V.REFUTED if all(e == V.REFUTED for e in effects.values()) else V.INCONCLUSIVE)
        parts.append(dc)
        texts.append(f"DC-ASGD {dc}: best of {len(dcs)} settings {best} {gains[best].fmt(signed=True)} "
                     f"({100 * level:.1f}% intervals, Bonferroni over the settings; all: "
                     + ", ".join(f"{a} {ci.fmt(signed=True)}" for a, ci in gains.items()) + ")")
        key["dc"] = {a: {"gain": ci.estimate, "ci": [ci.lo, ci.hi], "level": level} for a, ci in gains.items()}
    for a, g in c.arms.items():
        if a in c.matched and not c.judged(a):
            texts.append(f"{a} not judged: its mean step is {c.matched[a]:.2f}x plain async's, not matched")
        elif a in c.matched:
            gain = diff(g, c.plain)
            sa = V.effect(gain, margin)
            parts.append(sa)
            texts.append(f"{SA} {sa}: {a} (mean step {c.matched[a]:.2f}x plain async's) minus plain async "
                         f"{gain.fmt(signed=True)}")
            key["staleness_aware"] = {"arm": a, "gain": gain.estimate, "ci": [gain.lo, gain.hi],
                                      "step_ratio": c.matched[a]}
    if not parts:
        return V.Verdict(V.INCONCLUSIVE, f"{where}: no remedy ran there"), key
    return V.Verdict(V.combine(parts), f"{where}; " + "; ".join(texts) + f" (margin {margin})"), key


def staleness_remedies(ctx: Context):
    exp, out = ctx.exp, ctx.out
    margin = float(ctx.params.get("margin", 0.02))
    cell: dict[tuple[str, int, float], Group] = {(arm(g), g.cfg["workers"], g.lr): g for g in ctx.groups.values()}
    cells = _cells(cell)
    primary = _primary(cells)
    grid = {lr: g for (a, n, lr), g in cell.items() if a == PLAIN and primary is not None and n == primary.workers}
    verdict, key = _verdict(primary, grid, margin)

    # Figure 1: every arm's accuracy on the rates it ran (shade and text: accuracy; "d/n": diverged seeds).
    order = [CONTROL, SYNC, PLAIN]
    arms = [a for a in order if any(k[0] == a for k in cell)] + sorted({k[0] for k in cell} - set(order))
    rows = [(a, n) for a in arms for n in sorted({k[1] for k in cell if k[0] == a})]
    lrs = sorted({k[2] for k in cell})
    acc = [[acc_ci(cell[(a, n, lr)]).estimate if (a, n, lr) in cell else float("nan") for lr in lrs] for a, n in rows]
    texts = [[_map_text(cell[(a, n, lr)]) if (a, n, lr) in cell else "" for lr in lrs] for a, n in rows]
    f1 = out / "stability_map.png"
    top = max((v for row in acc for v in row if v == v), default=1.0)
    plots.grid_map([f"{a} N={n}" for a, n in rows], [f"{lr:g}" for lr in lrs], acc, texts, f1,
                   f"{exp.id}: remedies across rates", xlabel="learning rate", cbar="final test accuracy",
                   cmap="cividis", vmax=max(0.1, top))
    figs = [Figure(f1, f"Mean final test accuracy ({ctx.seeds_note()}) per arm and learning rate (shade and text; "
                       "'d/n': seeds diverged, on the training loss; no text: not run).")]

    # Figure 2: the verdict's cell: each arm minus plain async (paired), the control's first (the gap).
    if primary is not None:
        shown = [(CONTROL, primary.control), (f"{SYNC} N={primary.workers}", primary.sync), *primary.arms.items()]
        shown = [(a, g) for a, g in shown if g is not None]
        # Each bar at the interval its verdict uses: the DC-ASGD settings at the Bonferroni level over
        # the settings, the others at 95%.
        n_dc = sum(1 for a, _ in shown if _is_dc(a))
        cis = [stats.diff_ci(g.finals(), primary.plain.finals(), level=1 - (1 - LEVEL) / n_dc if _is_dc(a) else LEVEL,
                             paired=g.seeds == primary.plain.seeds) for a, g in shown]
        f2 = out / "remedies_at_best_rate.png"
        plots.bars([textwrap.fill(a, 10) for a, _ in shown],
                   {"minus plain async": ("variant:2", [c.estimate for c in cis], [(c.lo, c.hi) for c in cis])},
                   "final test accuracy minus plain async's", f2,
                   f"{exp.id}: N={primary.workers}, plain async at lr {primary.lr:g} ({acc_ci(primary.plain).fmt()})",
                   refs=[(0.0, "plain async"), (margin, f"+margin {margin:g}"), (-margin, "-margin")])
        figs.append(Figure(f2, "The verdict's cell: each arm's mean final test accuracy minus plain async's, seed by "
                               f"seed; error bars: t intervals at the level each verdict uses (95%; DC-ASGD's "
                               f"Bonferroni over its settings) ({ctx.seeds_note()}). The first bar is the "
                               "one-worker control (the same batch per update, nothing stale): the gap a remedy "
                               "could close. Dotted: 0 and +-margin."))

    header = ["cell", "arm", "N", "lr", "mean staleness", "momentum: set -> effective", "mean step scale",
              "DC term, relative to g", "test accuracy [95% CI]", "minus plain async (paired)",
              "share of the control's gap closed", "diverged"]
    body_rows = []
    for c in cells:
        gap = diff(c.control, c.plain) if c.control is not None else None
        here = f"N={c.workers}, plain lr {c.lr:g}"
        refs = [(CONTROL, c.control), (SYNC, c.sync), (PLAIN, c.plain)]
        for a, g in [*refs, *c.arms.items()]:
            if g is None:
                continue
            judged = a not in (CONTROL, SYNC, PLAIN)
            closed = (stats.gap_closed_ci(c.plain.finals(), g.finals(), c.control.finals())
                      if judged and gap is not None and V.effect(gap, margin) == V.CONFIRMED else None)
            mom, tau = float(g.cfg["optim"]["momentum"]), g.mean("staleness.mean")
            body_rows.append([
                here, a, g.cfg["workers"], f"{g.lr:g}", f"{tau:.2f}",
                f"{mom:g} -> {staleness.effective_momentum(mom, tau):.3f}" if g.mode != "sync" else f"{mom:g}",
                _num(_remedy(g, "mean_step_scale"), 2), _num(_remedy(g, "dc_relative_correction"), 4),
                acc_ci(g).fmt(), diff(g, c.plain).fmt(signed=True) if judged else (
                    gap.fmt(signed=True) + " (the gap)" if a == CONTROL and gap is not None else ""),
                closed.fmt(2) if closed is not None else "", f"{sum(diverged(r) for r in g.runs)}/{len(g.runs)}"])
    body = table(header, body_rows)
    body += "\n\n" + _notes(cell, cells, primary)
    headline = verdict.reason
    for c in cells:
        if c is primary:
            continue
        parts = [f"{a} {diff(g, c.plain).fmt(signed=True)}" for a, g in c.arms.items()]
        headline += (f"; where plain async is not at its best (N={c.workers}, lr {c.lr:g}: "
                     f"{acc_ci(c.plain).fmt()}), minus plain async: " + ", ".join(parts))
    return verdict, headline, body, figs, key


def _map_text(g: Group) -> str:
    d = sum(diverged(r) for r in g.runs)
    return f"{acc_ci(g).estimate:.2f}" + (f"\n{d}/{len(g.runs)} div." if d else "")


def _notes(cell: dict, cells: list[Cell], primary: Cell | None) -> str:
    """What keeps the table honest: the matched rates, DC-ASGD's memory, the implicit momentum."""
    lines = ["Design: plain async is judged at its best rate of the map, against the one-worker control "
             "(async with 1 worker: the same batch of 32 per update, nothing stale; E3's runs), so the gap is "
             "what staleness costs there; each remedy runs on top of plain async and is judged by its accuracy "
             "minus plain async's, seed by seed (every arm of a seed has the same initialisation and data order). "
             "Sync with N workers (batch N x 32 per update) is shown where it ran; it differs from async in "
             "batch per update as well as in staleness."]
    for c in cells:
        for a, ratio in c.matched.items():
            lines.append(f"The staleness-aware rate divides each gradient's step by its staleness: at N={c.workers} "
                         f"{a} takes a mean step of {ratio:.2f}x plain async's at lr {c.lr:g} (lr x the measured mean "
                         "step scale), so the two differ in how the step is spread over stale and fresh gradients, "
                         "not in its mean size.")
    dc = [(n, g) for (a, n, _), g in cell.items() if _is_dc(a)]
    if dc:
        n, g = max(dc, key=lambda t: t[0])
        lines.append("DC-ASGD (Zheng et al. 2017) adds lambda g (.) g (.) (w_now - w_then) to each gradient; its "
                     "adaptive variant DC-ASGD-a divides lambda_0 per coordinate by the root of a moving mean square "
                     "of the gradients (decay 0.95 unless the table's run says otherwise). The constant lambda is "
                     "swept by factors of 10 because the term's size, relative to g (the table's column), grows "
                     "with lambda and with the rate; the settings are chosen on the test accuracy they are "
                     "judged on, hence the Bonferroni intervals in the verdict. Memory: each shard keeps, per "
                     f"worker, the snapshot that worker pulled until its push; measured peak "
                     f"{_bytes(_remedy(g, 'dc_memory_peak_bytes'))} at N={n}, bound N x parameters x wire bytes = "
                     f"{_bytes(_remedy(g, 'dc_memory_bound_bytes'))} (DC-ASGD-a: one more fp32 per parameter). No "
                     "remedy sends an extra byte.")
    lines.append("Effective momentum (Mitliagkas et al. 2016, psgd/core/staleness.py): 1 - 1/(1/(1 - mu) + mean "
                 "staleness), the single momentum whose mean delay equals that of momentum mu followed by the "
                 "measured staleness; with mu = 0 and staleness N - 1 it is their implicit momentum 1 - 1/N. Their "
                 "queueing model (exponential compute times) is an assumption, not a measurement.")
    return "\n\n".join(lines)


def _num(x: float, digits: int, signed: bool = False) -> str:
    return f"{x:{'+' if signed else ''}.{digits}f}" if math.isfinite(x) else ""


def _bytes(x: float) -> str:
    return f"{x / 2**20:.2f} MiB" if math.isfinite(x) else ""



# -- E13 -----------------------------------------------------------------------------------------
def _fraction(g: Group) -> str:
    return "dense" if g.cfg["topk"] >= 1 else f"top {g.cfg['topk'] * 100:g}%"


def _feedback(g: Group) -> str:
    """What a sparse arm does with what it did not send (and whether it runs DGC's two fixes)."""
    cfg = g.cfg
    if cfg["topk"] >= 1:
        return "-"
    if cfg["no_error_feedback"]:
        return "no"
    fixes = [name for name, on in (("momentum correction", cfg.get("topk_momentum_correction")),
                                   (f"warm-up {cfg.get('topk_warmup_epochs', 0):g} epochs",
                                    cfg.get("topk_warmup_epochs", 0) > 0)) if on]
    return "yes" + (" + " + " + ".join(fixes) if fixes else "")


def _trend(g: Group) -> float:
    """Mean over seeds of the accuracy's change over the last evaluations (the last LAST_K's mean
    minus the LAST_K before: what `converged` compares; validation accuracy where there is one)."""
    out = []
    for r in g.runs:
        key = "val_accuracy" if r.evals and r.evals[-1].get("val_accuracy") is not None else "test_accuracy"
        acc = [e[key] for e in r.evals]
        if len(acc) >= 2 * LAST_K:
            out.append(float(np.mean(acc[-LAST_K:]) - np.mean(acc[-2 * LAST_K:-LAST_K])))
    return float(np.mean(out)) if out else float("nan")


def _step_ms(g: Group) -> list[float]:
    """Milliseconds per worker step of each seed: steady-state wall time / steps per worker."""
    return [1e3 * r.summary["wall_time_s"] * r.summary["workers"] / max(1, r.summary["worker_steps"]) for r in g.runs]


def _rising(g: Group) -> bool:
    """Still rising at the end: on average over seeds, by at least what `converged` calls a plateau."""
    return _trend(g) >= PLATEAU


def topk(ctx: Context):
    margin = float(ctx.params.get("margin", 0.02))
    learning = [g for g in ctx.groups.values() if not g.cfg.get("link")]
    dense = next(g for g in learning if g.cfg["topk"] >= 1)
    sparse = sorted((g for g in learning if g.cfg["topk"] < 1),
                    key=lambda g: (-g.cfg["topk"], g.cfg["no_error_feedback"], g.label))
    with_ef = {g.label: g for g in sparse if not g.cfg["no_error_feedback"]}
    without = {g.label: g for g in sparse if g.cfg["no_error_feedback"]}
    order = [dense, *sparse]

    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series(order), "samples", "test_accuracy", f1, f"{ctx.exp.id}: accuracy at equal samples")
    # Each sparse arm minus dense, paired (categories: bars, not lines), named with the bytes it pushed.
    cis = [diff(g, dense) for g in sparse]
    f2 = ctx.out / "accuracy_vs_bytes.png"
    plots.bars([f"{textwrap.fill(g.label, 14)}\n{g.mean('bytes_pushed') / dense.mean('bytes_pushed'):.3f}x bytes"
                for g in sparse],
               {"minus dense": ("variant:2", [c.estimate for c in cis], [(c.lo, c.hi) for c in cis])},
               "final test accuracy minus dense's", f2,
               f"{ctx.exp.id}: accuracy and bytes pushed against dense ({acc_ci(dense).fmt()})",
               refs=[(0.0, "dense"), (-margin, f"-margin {margin:g}")])
    rows = []
    for g in order:
        d = diff(g, dense)
        server_mom = 0.0 if g.cfg.get("topk_momentum_correction") else g.cfg["optim"]["momentum"]
        share = g.mean("bytes_pushed") / dense.mean("bytes_pushed")
        rows.append([g.label, _fraction(g), _feedback(g), f"{server_mom:g}", f"{g.lr:g}",
                     f"{g.mean('bytes_pushed') / MIB:.2f}", f"{share:.3f}x",
                     acc_ci(g).fmt(), "" if g is dense else d.fmt(signed=True), g.converged(),
                     _num(_trend(g), 3, signed=True) + (" (rising)" if _rising(g) else "")])
    body = table(["run", "sent", "error feedback", "server momentum", "lr", "MiB pushed", "vs dense",
                  "test accuracy [95% CI]", "minus dense (paired)", "converged", "last change"], rows)

    ef_d = {f: diff(g, dense) for f, g in with_ef.items()}
    no_d = {f: diff(dense, g) for f, g in without.items()}
    verdict = V.error_feedback_keeps_accuracy(ef_d, no_d, margin)
    params = dense.runs[0].summary["params"]
    pushed = {f: g.mean("bytes_pushed") / dense.mean("bytes_pushed") for f, g in with_ef.items()}
    rising = [g.label for g in order if _rising(g)]
    headline = ("at equal samples, accuracy minus dense: with error feedback "
                + ", ".join(f"{f} {d.fmt(signed=True)}" for f, d in ef_d.items()) + "; without "
                + ", ".join(f"{f} {diff(g, dense).fmt(signed=True)}" for f, g in without.items())
                + " (dense " + acc_ci(dense).fmt() + "); pushed bytes "
                + ", ".join(f"{f} {r:.3f}x" for f, r in pushed.items())
                + f" of dense (measured), for a residual of {4 * params / 1024:.0f} KiB per worker"
                + (f"; still rising at the end: {', '.join(rising)}" if rising else "; every arm at a plateau"))
    figs = [Figure(f1, ctx.caption("Test accuracy against training samples, each run at its rate (tuning table).")),
            Figure(f2, "Each sparse arm's mean final test accuracy minus dense's, seed by seed; error bars 95% t "
                       "intervals; under each, the bytes its workers pushed in all, as a multiple of dense's "
                       "(measured, summary.json; warm-up sends more in its first epochs). Dotted: 0 and -margin.")]
    key = {"ef_minus_dense": {f: d.estimate for f, d in ef_d.items()},
           "no_feedback_minus_dense": {f: -d.estimate for f, d in no_d.items()},
           "bytes_vs_dense": pushed, "still_rising": rising,
           "residual_bytes_per_worker": 4 * params}

    linked = [g for g in ctx.groups.values() if g.cfg.get("link")]
    if linked:
        text, fig, speedup = _link_timing(ctx, linked)
        body += "\n\n" + text
        figs.append(fig)
        if speedup is not None:
            key["step_speedup_on_link"] = speedup.estimate
            headline += f"; on an EMULATED {linked[0].cfg['link']} link a step takes {speedup.fmt(2)}x less time"
    body += ("\n\nAccounting, not a finding: a sparse push of a fraction f of an n-element slice sends round(f n) "
             "entries of an int32 index and a value each, so 8 bytes per entry in fp32 (tests/test_sparsify.py checks "
             "the bytes and that fraction 1 equals dense pushes bit for bit); with error feedback each worker keeps a "
             f"residual of one fp32 per parameter ({4 * params:,} bytes here), and with momentum correction a "
             "velocity of the same size. Pulls stay dense: the parameters are not sparse, so the bytes a worker "
             "receives do not change. What is measured is whether accuracy at equal samples survives sending only "
             "the largest entries, with the rest carried over (error feedback: Stich et al. 2018; Lin et al. 2018) or "
             "dropped. Momentum: without momentum correction it is the server's, applied to the sum of the sparse "
             "gradients; with it (Deep Gradient Compression) each worker's velocity is what is accumulated and "
             "sent, and the server steps without momentum (the 'server momentum' column). Warm-up: in epoch e of "
             "its first E the fraction sent is max(f, 0.25^(e+1)), so its bytes include those epochs. DGC's local "
             "gradient clipping is not done (nothing clips here). 'last change': the mean accuracy of the last "
             f"{LAST_K} evaluations minus the {LAST_K} before (validation accuracy where there is one), averaged over "
             f"seeds; 'rising' where it is at least {PLATEAU} (what 'converged' calls a plateau). A run still rising "
             "at the end may still close its gap: the claim is judged at equal samples.")
    return verdict, headline, body, figs, key


def _link_timing(ctx: Context, linked: list[Group]) -> tuple[str, Figure, stats.Interval | None]:
    """Time per step of the link runs: the table, the stacked figure, and dense / sparse step time."""
    linked = sorted(linked, key=lambda g: -g.cfg["topk"])
    parts = {k: [] for k in ("compute", "push", "pull", "wait")}
    rows, marks = [], []
    dense = next((g for g in linked if g.cfg["topk"] >= 1), None)
    for g in linked:
        steps = g.mean("worker_steps") / g.cfg["workers"]
        for k in parts:
            parts[k].append(1e3 * g.mean(f"time_breakdown_s.{k}") / max(1.0, steps))
        ms = stats.mean_ci(_step_ms(g))
        marks.append(ms.estimate)
        vs = "" if dense is None or g is dense else stats.ratio_ci(_step_ms(dense), _step_ms(g)).fmt(2) + "x"
        rows.append([g.label, g.cfg["link"], f"{g.mean('bytes_pushed') / g.mean('worker_steps') / 1024:.1f}",
                     f"{g.mean('bytes_pulled') / g.mean('worker_steps') / 1024:.1f}", ms.fmt(1),
                     *(f"{parts[k][-1]:.1f}" for k in parts), vs])
    f = ctx.out / "step_time_on_link.png"
    plots.stacked([g.label for g in linked], parts, "ms per worker step", f,
                  f"{ctx.exp.id}: a step on an EMULATED {linked[0].cfg['link']} link", marks=("time per step", marks))
    text = table(["run", "link (EMULATED)", "KiB pushed / step", "KiB pulled / step", "ms per step [95% CI]",
                  "compute ms", "push ms", "pull ms", "wait ms", "dense / this"], rows)
    text += ("\n\nThe link is EMULATED: psgd/core/link.py paces every worker's and the shard's sends and receives on "
             "loopback; the shard's one NIC carries all workers' pushes in and pulls out. Time per step = steady-state "
             "wall time / steps per worker; 'dense / this' is how many times faster a step is (t interval over seeds).")
    speedup = None
    sparse = [g for g in linked if g.cfg["topk"] < 1]
    if dense is not None and sparse:
        speedup = stats.ratio_ci(_step_ms(dense), _step_ms(sparse[-1]))
    fig = Figure(f, "Milliseconds per worker step on the emulated link, split into compute, push, pull and wait "
                    "(means over seeds); dashed: the whole step.")
    return text, fig, speedup




ANALYSES: dict = {"backup_workers": backup_workers, "staleness_remedies": staleness_remedies, "topk": topk}
