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
from psgd.lab.analysis_kit import Context, acc_ci, diff, series_of, variant_series
from psgd.lab.results import Figure, Group, diverged, table, time_to

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
    plots.bars(conditions, {a: (_style(a, arms), [cis[(a, c)].estimate if (a, c) in cis else 0.0 for c in conditions],
                                [(cis[(a, c)].lo, cis[(a, c)].hi) if (a, c) in cis else (0.0, 0.0)
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
    rec = stats.recovered_ci(base_t, hurt_t, tput[(b1, "persistent straggler")])
    cost = diff(by[(b1, "persistent straggler")], hurt)
    verdict = V.backup_recovers(loss, rec, cost)
    key, lines, counted = {}, [], []
    for b in backups:
        g = by[(b, "persistent straggler")]
        r = stats.recovered_ci(base_t, hurt_t, tput[(b, "persistent straggler")])
        d = diff(g, hurt)
        share = float(np.mean([_dropped_share(x.summary) for x in g.runs]))
        wasted = float(np.mean([x.summary["bytes_pushed"] * _dropped_share(x.summary) / x.summary["global_updates"]
                                for x in g.runs]))
        lines.append(f"{b} recovers {_scaled(r).fmt(0)}% of the straggler's throughput loss at "
                     f"{_scaled(d).fmt(1, signed=True)} accuracy points, dropping {100 * share:.0f}% of the gradients "
                     f"pushed ({wasted / 1e3:.0f} kB per update pushed for nothing)")
        per_s = stats.recovered_ci(by[("sync", "no straggler")].values("updates_per_s"), hurt.values("updates_per_s"),
                                   g.values("updates_per_s"))
        counted.append(f"{b}: {_scaled(per_s).fmt(0)}%")
        key[b] = {"recovered": r.estimate, "recovered_ci": [r.lo, r.hi], "accuracy_points": 100 * d.estimate,
                  "accuracy_points_ci": [100 * d.lo, 100 * d.hi], "dropped_share": share,
                  "wasted_bytes_per_update": wasted}
    per_update = float(np.mean([x.summary["bytes_pushed"] / x.summary["global_updates"] for x in hurt.runs]))
    headline = (f"one worker {_delay(ctx)} ms slower per step costs sync {100 * loss.estimate:.0f}% of its throughput; "
                + "; ".join(lines) + f"; sync pushes {per_update / 1e3:.0f} kB per update; no memory beyond sync's own")
    body += ("\n\nApplied samples/s: training samples per second that went into updates (a dropped gradient's "
             "samples do not count). Recovered share = (backup's - sync's with the straggler) / (sync's without - "
             f"with), t interval over seeds; counted in updates/s instead, whatever their size, the "
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
                       "where that gap exceeds the margin; error bars: 95% t interval over seeds "
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



# -- E13 -----------------------------------------------------------------------------------------
def _fraction(g: Group) -> str:
    return "dense" if g.cfg["topk"] >= 1 else f"top {g.cfg['topk'] * 100:g}%"


def _step_ms(g: Group) -> list[float]:
    """Milliseconds per worker step of each seed: steady-state wall time / steps per worker."""
    return [1e3 * r.summary["wall_time_s"] * r.summary["workers"] / max(1, r.summary["worker_steps"]) for r in g.runs]


def topk(ctx: Context):
    margin = float(ctx.params.get("margin", 0.02))
    learning = [g for g in ctx.groups.values() if not g.cfg.get("link")]
    dense = next(g for g in learning if g.cfg["topk"] >= 1)
    sparse = sorted((g for g in learning if g.cfg["topk"] < 1),
                    key=lambda g: (-g.cfg["topk"], g.cfg["no_error_feedback"]))
    with_ef = {_fraction(g): g for g in sparse if not g.cfg["no_error_feedback"]}
    without = {_fraction(g): g for g in sparse if g.cfg["no_error_feedback"]}
    order = [dense, *sparse]

    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series(order), "samples", "test_accuracy", f1, f"{ctx.exp.id}: accuracy at equal samples")
    # Accuracy against the bytes each run pushed (measured): one point per fraction, both arms at
    # the same bytes (feedback changes what is sent, not how much), dense shared by both lines.
    fractions = sorted({_fraction(g): g.cfg["topk"] for g in sparse}.items(), key=lambda kv: kv[1])
    names = [f for f, _ in fractions] + ["dense"]
    xs = [_by_fraction(sparse, f).mean("bytes_pushed") / MIB for f, _ in fractions] + [dense.mean("bytes_pushed") / MIB]

    def arm(groups: dict[str, Group]) -> tuple[list[float], list[tuple[float, float]]]:
        cis = [acc_ci(groups[f]) if f in groups else stats.Interval(float("nan"), float("nan"), float("nan"))
               for f, _ in fractions] + [acc_ci(dense)]
        return [c.estimate for c in cis], [(c.lo, c.hi) for c in cis]
    f2 = ctx.out / "accuracy_vs_bytes.png"
    plots.lines(xs, {"with error feedback": ("variant:0", *arm(with_ef)), "without": ("variant:1", *arm(without))},
                "MiB pushed per run (all workers, measured)", "final test accuracy", f2,
                f"{ctx.exp.id}: bytes on the wire vs accuracy", logx=True,
                xticklabels=[f"{f}\n{x:.2f} MiB" for f, x in zip(names, xs, strict=True)])

    rows = []
    for g in order:
        d = diff(g, dense)
        rows.append([g.label, _fraction(g), "-" if g is dense else ("no" if g.cfg["no_error_feedback"] else "yes"),
                     f"{g.lr:g}", f"{g.mean('bytes_pushed') / MIB:.2f}",
                     f"{g.mean('bytes_pushed') / dense.mean('bytes_pushed'):.3f}x",
                     f"{g.mean('bytes_pulled') / MIB:.1f}", acc_ci(g).fmt(), "" if g is dense else d.fmt(signed=True),
                     g.converged()])
    body = table(["run", "sent", "error feedback", "lr (tuned)", "MiB pushed", "vs dense", "MiB pulled",
                  "test accuracy [95% CI]", "minus dense", "converged"], rows)

    ef_d = {f: diff(g, dense) for f, g in with_ef.items()}
    no_d = {f: diff(dense, g) for f, g in without.items()}
    verdict = V.error_feedback_keeps_accuracy(ef_d, no_d, margin)
    params = dense.runs[0].summary["params"]
    pushed = {f: g.mean("bytes_pushed") / dense.mean("bytes_pushed") for f, g in with_ef.items()}
    headline = ("at equal samples, accuracy minus dense: with error feedback "
                + ", ".join(f"{f} {d.fmt(signed=True)}" for f, d in ef_d.items()) + "; without "
                + ", ".join(f"{f} {diff(g, dense).fmt(signed=True)}" for f, g in without.items())
                + " (dense " + acc_ci(dense).fmt() + "); pushed bytes "
                + ", ".join(f"{f} {r:.3f}x" for f, r in pushed.items())
                + f" of dense (measured), for a residual of {4 * params / 1024:.0f} KiB per worker")
    figs = [Figure(f1, ctx.caption("Test accuracy against training samples, each run at its tuned rate.")),
            Figure(f2, "Final test accuracy against the bytes each run's workers pushed in all (log scale; measured, "
                       "summary.json); band: 95% t interval over seeds. With and without error feedback a "
                       "fraction pushes the same bytes.")]
    key = {"ef_minus_dense": {f: d.estimate for f, d in ef_d.items()},
           "no_feedback_minus_dense": {f: -d.estimate for f, d in no_d.items()},
           "bytes_vs_dense": pushed,
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
             f"residual of one fp32 per parameter ({4 * params:,} bytes here). Pulls stay dense: the parameters are "
             "not sparse, so the bytes a worker receives do not change. What is measured is whether accuracy at equal "
             "samples survives sending only the largest entries, with the rest carried over (error feedback: Stich "
             "et al. 2018; Lin et al. 2018) or dropped; each run at its own rate tuned on the validation split. Error "
             "feedback delays the small coordinates instead of dropping them, so a sparse run that has not converged "
             "(the table's last column) may still be closing its gap: the claim is judged at equal samples, not at "
             "the plateau. Momentum is the server's, applied to the sum of the sparse gradients; Deep Gradient "
             "Compression's momentum correction and sparsity warm-up are not done here.")
    return verdict, headline, body, figs, key


def _by_fraction(groups: list[Group], fraction: str) -> Group:
    return next(g for g in groups if _fraction(g) == fraction)


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
