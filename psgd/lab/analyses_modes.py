"""E0-E3: the baseline, and the three modes (sync, async, SSP) against each other, a straggler and staleness.

Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here (through this module's
ANALYSES, found by name like every analyses_*.py module's): each function takes the experiment's
Context and returns a Finding whose verdict is a rule of psgd/lab/verdicts.py on the measured
numbers. E0 (`baseline`): the models against each other; E1 (`modes`): sync, async, SSP and
all-reduce on one task (and the noise floor: two identical algorithms); E2 (`stragglers`): a slow
worker under each mode; E3 (`staleness`): accuracy as workers and the rate grow.
"""

from __future__ import annotations

import math

import numpy as np

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, Needs, acc_ci, diff, series_of, variant_series
from psgd.lab.results import Figure, Group, diverged, roughness, table, time_to, up_to

CHANCE_LOSS = math.log(10)  # cross-entropy of a uniform guess over 10 classes


# -- E0 ------------------------------------------------------------------------------------------
def baseline(ctx: Context):
    paper = {k: float(v) for k, v in ctx.params.get("paper", {}).items()}
    order = [g for m in ("logreg", "mlp", "cnn") for g in ctx.groups.values() if g.cfg["model"]["model"] == m]
    out = ctx.out
    f1 = out / "accuracy_vs_samples.png"
    refs = [(v, f"paper: {k} {v:.0%}") for k, v in paper.items()]
    plots.curves(variant_series(order), "samples", "test_accuracy", f1, f"{ctx.exp.id}: test accuracy", refs=refs)
    cis = {g.cfg["model"]["model"]: acc_ci(g) for g in order}
    f2 = out / "final_accuracy.png"
    plots.dots([g.label for g in order], {"this run (sync PS)": ("variant:0", [c.estimate for c in cis.values()],
                                                                 [(c.lo, c.hi) for c in cis.values()]),
                                          "paper (Greydanus 2020)": ("variant:3", [paper.get(m, float("nan"))
                                                                                   for m in cis], None)},
               "final test accuracy", f2, f"{ctx.exp.id}: MNIST-1D baselines", xlabel="model")
    rows = [[g.label, f"{g.lr:g}", acc_ci(g).fmt(), f"{paper.get(m, float('nan')):.2f}",
             f"{acc_ci(g).estimate - paper.get(m, float('nan')):+.3f}", g.converged()]
            for g, m in zip(order, cis, strict=True)]
    body = table(["model", "lr", "test accuracy [95% CI]", "paper", "gap to paper", "converged"], rows)
    by = {g.cfg["model"]["model"]: g for g in order}
    verdict = V.baseline(diff(by["mlp"], by["logreg"]), diff(by["cnn"], by["mlp"]))
    headline = ", ".join(f"{g.label} {cis[m].fmt()}" for g, m in zip(order, cis, strict=True)) + \
        " test accuracy (paper: " + " / ".join(f"{paper[m]:.2f}" for m in cis if m in paper) + ")"
    body += ("\n\nThe paper's numbers (Greydanus 2020, MNIST-1D, Table 1) are single figures from its own training "
             "recipe (Adam, 6,000 steps); ours train through the sync parameter server with SGD + momentum at the rate "
             "tuned on our validation split, with 20% of the paper's training set held out for it.")
    figs = [Figure(f1, ctx.caption("Test accuracy against training samples, grey lines the paper's figures.")),
            Figure(f2, "Final test accuracy (mean of the last evaluations) with its 95% t interval, beside "
                       "the paper's.")]
    return verdict, headline, body, figs, {m: cis[m].estimate for m in cis}


# -- E1 ------------------------------------------------------------------------------------------
def modes(ctx: Context):
    gs = list(ctx.groups.values())
    out, exp = ctx.out, ctx.exp
    series = series_of(gs)
    f1, f2, f3 = out / "accuracy_vs_samples.png", out / "accuracy_vs_elapsed_s.png", out / "loss_vs_samples.png"
    plots.curves(series, "samples", "test_accuracy", f1, f"{exp.id}: test accuracy at equal samples")
    plots.curves(series, "elapsed_s", "test_accuracy", f2, f"{exp.id}: test accuracy at equal wall time")
    plots.curves(series, "samples", "test_loss", f3, f"{exp.id}: test loss", refs=[(CHANCE_LOSS, "chance (ln 10)")])
    sync, asyn = ctx.group("sync"), ctx.group("async")
    target = float(ctx.params.get("target_accuracy", 0.5))
    extra = _modes_extra_figures(ctx, gs, series, target)
    body = _modes_table(gs, target)
    # The claim is about staleness: judged against the stale-free arms at async's batch per update
    # when they ran (E1's controls), else against sync at its own batch.
    control = ctx.groups.get("sync, 4 x 8") or sync
    d = diff(control, asyn)
    verdict = V.sync_beats_async(d, label=f"{control.label} - async")
    # The budget is a factor of this claim (E3, at 10 epochs, reads the other way): the same runs are
    # also scored on their evaluations up to a shorter budget, and the verdict combines both.
    short = int(ctx.params.get("short_budget_samples", 0))
    d_short = None
    if short:
        d_short = diff(up_to(control, short), up_to(asyn, short))
        at_short = V.sync_beats_async(d_short, label=f"{control.label} - async, first {short:,} samples")
        verdict = V.Verdict(V.combine([verdict.outcome, at_short.outcome]),
                            f"{verdict.reason}; {at_short.reason}" + ("; the budget decides" if
                                                                       verdict.outcome != at_short.outcome else ""),
                            verdict.effects + at_short.effects)
    one = ctx.groups.get("one worker")
    d_one = diff(one, asyn) if one is not None else None
    d_batch = diff(sync, asyn)
    rough = np.mean([roughness(r) for r in asyn.runs]) / max(1e-12, np.mean([roughness(r) for r in sync.runs]))
    speed = stats.ratio_ci(asyn.values("samples_per_s"), sync.values("samples_per_s"))
    headline = (f"at each arm's tuned rate and equal samples, {control.label} {acc_ci(control).fmt()} vs async "
                f"{acc_ci(asyn).fmt()} test accuracy at the same batch per update (difference {d.fmt(signed=True)})"
                + (f"; over the first {short:,} samples {d_short.fmt(signed=True)}" if d_short is not None else "")
                + (f"; one worker minus async {d_one.fmt(signed=True)}" if d_one is not None else "")
                + (f"; sync at 4 x 32 minus async {d_batch.fmt(signed=True)}" if control is not sync else "")
                + f"; async runs {speed.fmt(2)}x sync's samples/s")
    body += ("\n\nLoss roughness: mean |change of test loss| between consecutive evaluations after the first third, "
             "on the same sample grid for every mode. Wall time is steady state: every worker starts on a barrier "
             "after a warm-up step. Sync and all-reduce compute the same updates by design, up to the order in "
             "which floating-point gradients are summed (the PS sums in worker order, the all-reduce in its own), "
             "so their curves coincide "
             "within the seed spread; all-reduce is drawn dashed.")
    figs = [Figure(f1, ctx.caption("Test accuracy against training samples, each mode at its own tuned rate.")),
            *extra[:1],
            Figure(f2, ctx.caption("The same runs against steady-state wall time.")),
            *extra[1:],
            Figure(f3, ctx.caption("Test loss (linear axis); dotted: chance level ln 10. Test loss rising while "
                                   "accuracy holds is overfitting, not divergence."))]
    body += (f"\n\nThe verdict compares async with {control.label}: both average 32 samples per update at equal "
             "samples, so what differs is staleness alone (differences paired by seed, Student t). Sync at 4 x 32 "
             "differs from async in batch size too; its difference is shown, not judged. Loss roughness is "
             f"{rough:.2f}x sync's for async (test loss; on a model that overfits it also measures drift).")
    return verdict, headline, body, figs, {"control_minus_async": d.estimate, "ci": [d.lo, d.hi],
                                           "control": control.label,
                                           "sync_batch128_minus_async": d_batch.estimate}


def _modes_table(gs: list[Group], target: float) -> str:
    """E1's table: per mode its rate, accuracy, loss, throughput, staleness, roughness and time to target."""
    rows = []
    for g in gs:
        tt = [time_to(r, target) for r in g.runs]
        finite = [t for t in tt if math.isfinite(t)]
        rows.append([g.label, f"{g.lr:g}", acc_ci(g).fmt(), f"{np.mean(g.finals('test_loss')):.3f}",
                     f"{g.mean('samples_per_s'):.0f}", f"{g.mean('staleness.mean'):.2f}",
                     f"{np.mean([roughness(r) for r in g.runs]):.4f}",
                     f"{np.mean(finite):.1f}" + (f" ({len(finite)}/{len(tt)})" if len(finite) < len(tt) else "")
                     if finite else "not reached", g.converged()])
    return table(["run", "lr (tuned)", "test accuracy [95% CI]", "test loss", "samples/s", "mean staleness",
                  "loss roughness", f"s to {target:.0%}", "converged"], rows)


def _modes_extra_figures(ctx: Context, gs: list[Group], series: list, target: float) -> list[Figure]:
    """E1's figures beside the curves: training loss per update (the seed's "roller coaster" is a
    training loss), seconds to the target accuracy per mode, and the staleness of async vs SSP."""
    out, exp = ctx.out, ctx.exp
    figs = []
    if all(r.evals and r.evals[0].get("train_loss") is not None for g in gs for r in g.runs):
        f = out / "train_loss_vs_updates.png"
        plots.curves(series, "version", "train_loss", f, f"{exp.id}: training loss per update")
        figs.append(Figure(f, ctx.caption("Training loss (on the training split, at each evaluation) against "
                                          "global updates: sync makes one update per 4 x 32 samples, async one per "
                                          "32, so at equal samples async has made 4x the updates.")))
    times = {g.label: [time_to(r, target) for r in g.runs] for g in gs}
    reached = {k: stats.mean_ci([t for t in v if math.isfinite(t)]) for k, v in times.items()
               if any(math.isfinite(t) for t in v)}
    if reached:
        f = out / "time_to_accuracy.png"
        plots.dots(list(reached), {f"s to {target:.0%}": ("variant:0", [c.estimate for c in reached.values()],
                                                          [(c.lo, c.hi) for c in reached.values()])},
                   f"steady-state seconds to {target:.0%} test accuracy", f,
                   f"{exp.id}: time to {target:.0%} test accuracy", xlabel="run")
        missed = [f"{k} ({sum(not math.isfinite(t) for t in v)}/{len(v)} seeds)" for k, v in times.items()
                  if not all(math.isfinite(t) for t in v)]
        figs.append(Figure(f, f"Seconds of steady-state training until test accuracy first reached {target:.0%}, "
                              "per run at its tuned rate; error bars: 95% t interval over the seeds that reached it"
                           + (f"; not reached by {', '.join(missed)}" if missed else "") + "."))
    stale = [g for g in gs if g.mode in ("async", "ssp") and g.cfg["workers"] > 1]
    if stale:
        f = out / "staleness_hist.png"
        plots.histograms({f"{g.label} ({len(g.runs)} seeds)": (g.mode, plots.pooled(
            [r.summary["staleness"]["hist"] for r in g.runs])) for g in stale}, f,
            f"{exp.id}: staleness of applied gradients, async vs SSP", logy=True)
        figs.append(Figure(f, "Staleness (updates between a gradient's pull and its apply) of every applied "
                              "gradient, all seeds pooled, async beside SSP (which bounds how far a worker may run "
                              "ahead); log scale, so the tail shows."))
    return figs


# -- E2 ------------------------------------------------------------------------------------------
def _condition(cfg: dict) -> str:
    if cfg.get("straggler"):
        return "persistent straggler"
    if cfg.get("jitter"):
        return "random jitter"
    return "no straggler"


def stragglers(ctx: Context):
    exp, out = ctx.exp, ctx.out
    by: dict[str, dict[str, Group]] = {}
    for g in ctx.groups.values():
        by.setdefault(g.mode, {})[_condition(g.cfg)] = g
    conditions = [c for c in ("no straggler", "persistent straggler", "random jitter")
                  if any(c in d for d in by.values())]
    target = float(ctx.params.get("target_accuracy", 0.5))
    slow, transient, rows = {}, {}, []
    for mode, conds in by.items():
        if "no straggler" in conds and "persistent straggler" in conds:
            slow[mode] = stats.ratio_ci(conds["no straggler"].values("samples_per_s"),
                                        conds["persistent straggler"].values("samples_per_s"))
        if "no straggler" in conds and "random jitter" in conds:
            transient[mode] = stats.ratio_ci(conds["no straggler"].values("samples_per_s"),
                                             conds["random jitter"].values("samples_per_s"))
        for c in conditions:
            if c in conds:
                g = conds[c]
                tt = [time_to(r, target) for r in g.runs]
                rows.append([mode, c, f"{g.lr:g}", g.summary_ci("samples_per_s").fmt(0),
                             f"{np.mean(tt):.1f}" if all(map(math.isfinite, tt)) else "not reached by all",
                             acc_ci(g).fmt()])
    f1 = out / "throughput.png"
    nan = float("nan")   # a condition a mode was not run in: no bar
    plots.bars(conditions, {m: (m, [by[m][c].mean("samples_per_s") if c in by[m] else nan for c in conditions],
                                [(by[m][c].summary_ci("samples_per_s").lo, by[m][c].summary_ci("samples_per_s").hi)
                                 if c in by[m] else (nan, nan) for c in conditions]) for m in by},
               "samples/s (steady state)", f1, f"{exp.id}: throughput")
    series = series_of([g for d in by.values() for g in d.values()],
                       [f"{g.mode}, {_condition(g.cfg)}" for d in by.values() for g in d.values()])
    f2 = out / "accuracy_vs_elapsed_s.png"
    plots.curves(series, "elapsed_s", "test_accuracy", f2, f"{exp.id}: accuracy at equal wall time",
                 refs=[(target, f"target {target:.0%}")])
    body = table(["mode", "condition", "lr", "samples/s [95% CI]", f"s to {target:.0%} test acc", "test accuracy"],
                 rows)
    s, a = slow["sync"], slow["async"]
    # Conservative interval of the difference: the ends of the two intervals combined.
    d = stats.Interval(s.estimate - a.estimate, s.lo - a.hi, s.hi - a.lo, min(s.n, a.n))
    verdict = V.straggler_hurts_sync_more(d)
    delay = max((ms for g in ctx.groups.values() for _, ms in g.cfg.get("straggler", [])), default=0)
    headline = (f"one worker {delay} ms slower per step cuts sync's throughput {s.fmt(2)}x but async's only "
                f"{a.fmt(2)}x" + "".join(f", {m} {v.fmt(2)}x" for m, v in slow.items() if m not in ("sync", "async")))
    body += ("\n\nSlowdown = samples/s without the straggler / with it (t interval over seeds); the interval of the "
             "difference joins the ends of the two intervals (conservative). Each mode runs at its own tuned rate.")
    if transient:
        body += _jitter_text(ctx, slow, transient)
    figs = [Figure(f1, "Steady-state samples/s per mode and condition; error bars: 95% t interval over seeds."),
            Figure(f2, ctx.caption("Test accuracy against steady-state wall time; dotted: the target."))]
    return verdict, headline, body, figs, {f"slowdown_{m}": v.estimate for m, v in slow.items()}


def _jitter_text(ctx: Context, slow: dict[str, stats.Interval], transient: dict[str, stats.Interval]) -> str:
    """E2's paragraph on transient (jitter) against persistent stragglers, each mode's slowdown over async's."""
    jitter = max((g.cfg.get("jitter", 0.0) for g in ctx.groups.values()), default=0.0)
    per = "; ".join(f"{m}: {transient[m].fmt(2)}x with jitter, {slow[m].fmt(2)}x with the persistent straggler"
                    if m in slow else f"{m}: {transient[m].fmt(2)}x with jitter" for m in transient)
    text = (f"\n\n**Transient vs persistent stragglers** (Ho et al. 2013, SSP). With jitter every worker "
            f"sleeps an exponential delay of mean {jitter:g} ms per step, so the slow worker changes from step to "
            f"step; the persistent straggler is always worker 0. Slowdowns: {per}. Jitter costs every mode its "
            "own sleep (async included: each of its steps is longer), so what a mode's consistency costs is its "
            "slowdown over async's. ")
    if "async" in transient:
        rel = "; ".join(
            f"{m} {transient[m].estimate / transient['async'].estimate:.2f}x with jitter"
            + (f", {slow[m].estimate / slow['async'].estimate:.2f}x with the persistent straggler"
               if m in slow and "async" in slow else "")
            for m in transient if m != "async")
        text += (f"Over async's: {rel} (ratios of the point estimates). A bounded clock lead lets the others run "
                 "ahead of a worker slow for a step or two, which catches up later: SSP's teaching point is that "
                 "it should cost little over async under jitter but, once a persistent straggler has used up "
                 "the bound, run at the straggler's pace like sync.")
    return text


# -- E3 ------------------------------------------------------------------------------------------
def staleness(ctx: Context):
    exp, out = ctx.exp, ctx.out
    gs = list(ctx.groups.values())
    lrs = sorted({g.lr for g in gs})

    def row_name(g: Group) -> str:
        n = g.cfg["workers"]
        return "N=1 (no staleness)" if n == 1 else f"{g.mode} N={n}"

    names = sorted({row_name(g) for g in gs}, key=lambda r: (not r.startswith("N=1"), r.split()[0] != "sync",
                                                             int(r.split("N=")[1].split()[0])))
    cell: dict[tuple[str, float], Group] = {(row_name(g), g.lr): g for g in gs}
    acc = [[acc_ci(cell[(n, lr)]).estimate if (n, lr) in cell else float("nan") for lr in lrs] for n in names]
    failed = [[sum(diverged(r) for r in cell[(n, lr)].runs) if (n, lr) in cell else 0 for lr in lrs] for n in names]
    texts = [[(f"{acc[i][j]:.2f}" + (f"\ndiverged {failed[i][j]}/{len(cell[(n, lr)].runs)}" if failed[i][j] else ""))
              if (n, lr) in cell else "" for j, lr in enumerate(lrs)] for i, n in enumerate(names)]
    f1 = out / "stability_map.png"
    plots.grid_map(names, [f"{lr:g}" for lr in lrs], acc, texts, f1,
                   f"{exp.id}: accuracy and divergence per rate", xlabel="learning rate",
                   cbar="mean final test accuracy", cmap="cividis", vmin=0.0, vmax=max(
                       [1.0 / 10] + [a for row in acc for a in row if math.isfinite(a)]),
                   hatched=[[k > 0 for k in row] for row in failed])
    asyn = sorted([g for g in gs if g.mode == "async" and g.cfg["workers"] > 1], key=lambda g: (g.cfg["workers"], g.lr))
    hists = {f"async N={g.cfg['workers']} ({len(g.runs)} seeds)": ("async", plots.pooled(
        [r.summary["staleness"]["hist"] for r in g.runs])) for g in asyn if g.lr == lrs[0]}
    f2 = out / "staleness_hist.png"
    plots.histograms(hists, f2, f"{exp.id}: staleness of applied gradients (lr {lrs[0]:g}, all seeds)", logy=True)
    control = {g.lr: g for g in gs if g.cfg["workers"] == 1}
    cells = []
    for g in asyn:
        if g.lr in control:
            cells.append(V.StabilityCell(g.lr, float(np.mean([diverged(r) for r in control[g.lr].runs])),
                                         float(np.mean([diverged(r) for r in g.runs])), diff(control[g.lr], g)))
    verdict = V.staleness_destabilises(cells)
    rows = [[row_name(g), f"{g.lr:g}", f"{g.mean('staleness.mean'):.2f}", acc_ci(g).fmt(),
             diff(control[g.lr], g).fmt(signed=True) if g.lr in control and g.cfg["workers"] > 1 else "",
             f"{np.mean(g.finals('test_loss')):.3f}", f"{sum(diverged(r) for r in g.runs)}/{len(g.runs)}"]
            for g in sorted(gs, key=lambda g: (names.index(row_name(g)), g.lr))]
    body = table(["run", "lr", "mean staleness", "test accuracy [95% CI]", "control minus this", "test loss",
                  "diverged"], rows)
    stale = {g.cfg["workers"]: g.mean("staleness.mean") for g in asyn if g.lr == lrs[0]}
    headline = (f"mean staleness {', '.join(f'{v:.1f} at N={n}' for n, v in sorted(stale.items()))}; "
                + verdict.reason)
    body += ("\n\nDiverged (failed to train): final training loss not finite or above 0.95x the initial training loss "
             "(never the test loss: a run that overfits has not diverged). "
             "The control is one worker with the same batch per update and the same samples: async with N workers "
             "differs from it only in staleness (about N-1 updates). Sync with N workers averages N batches per "
             "update (a larger batch) and is shown for reference. The rule counts both halves of the claim: "
             "non-convergence (async diverges where the control does not) and degradation (where both converge, "
             "async ends below the control by more than the margin).")
    figs = [Figure(f1, f"Mean final test accuracy per row and learning rate (shade and text; {ctx.seeds_note()}); "
                       "hatched, with the count: seeds that diverged (training loss no better than at the start). "
                       "The gap between a row and the N=1 control at the same rate is what staleness costs."),
            Figure(f2, "Distribution of staleness (updates between a gradient's pull and its apply), every applied "
                       "gradient of every seed pooled, the whole range; log scale, so the tail shows. SSP beside "
                       "async: E1.")]
    key = {"cells": [dict(lr=c.lr, control_diverged=c.control_diverged, async_diverged=c.async_diverged,
                          control_minus_async=c.gap.estimate if c.gap else None) for c in cells]}
    return verdict, headline, body, figs, key


ANALYSES = {"baseline": baseline, "modes": modes, "stragglers": stragglers, "staleness": staleness}
NEEDS = {"modes": Needs(labels=("sync", "async"))}
