"""The analysis of staleness and the optimizer (E16): is the accuracy that staleness costs larger
with AdamW than with SGD (Dai et al. 2018)? Same contract as psgd/lab/analyses.py, whose `analyse`
dispatches here; [params] names the arms: `sgd` and `adamw`, each [control, async].

Damage = control minus async (final test accuracy, paired by seed: the same initialisation and data
order in both); the verdict weighs AdamW's damage minus SGD's, per seed, with a t interval, against
the margin: confirmed when AdamW loses clearly more, refuted when its loss is clearly not larger by
the margin, else inconclusive.
"""

from __future__ import annotations

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, acc_ci, diff, variant_series
from psgd.lab.results import Figure, table


def adam_staleness(ctx: Context):
    p = ctx.params
    (sgd_c, sgd_a), (adam_c, adam_a) = ([ctx.group(x) for x in p[k]] for k in ("sgd", "adamw"))
    margin = float(p.get("margin", 0.02))
    dmg_sgd, dmg_adam = diff(sgd_c, sgd_a), diff(adam_c, adam_a)
    paired = sgd_c.seeds == sgd_a.seeds == adam_c.seeds == adam_a.seeds
    per_sgd = [c - a for c, a in zip(sgd_c.finals(), sgd_a.finals(), strict=True)]
    per_adam = [c - a for c, a in zip(adam_c.finals(), adam_a.finals(), strict=True)]
    dd = stats.diff_ci(per_adam, per_sgd, paired=paired)
    verdict = V.staleness_hurts_adam_more(dd, margin)
    order = [sgd_c, sgd_a, adam_c, adam_a]
    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series(order), "samples", "test_accuracy", f1, f"{ctx.exp.id}: SGD and AdamW, with and "
                 "without staleness")
    f2 = ctx.out / "staleness_cost.png"
    plots.dots(["SGD (momentum 0.9)", "AdamW"],
               {"control minus async": ("variant:0", [dmg_sgd.estimate, dmg_adam.estimate],
                                        [(dmg_sgd.lo, dmg_sgd.hi), (dmg_adam.lo, dmg_adam.hi)])},
               "accuracy lost to staleness", f2, f"{ctx.exp.id}: what staleness costs each optimizer",
               refs=[(0.0, "no cost")])
    rows = [[g.label, g.cfg["optim"]["optimizer"], g.mode, g.cfg["workers"], f"{g.lr:g}", acc_ci(g).fmt(),
             f"{g.mean('staleness.mean'):.2f}", g.converged()] for g in order]
    body = table(["run", "optimizer", "mode", "workers", "lr (tuned)", "test accuracy [95% CI]", "mean staleness",
                  "converged"], rows)
    headline = (f"accuracy lost to staleness (one-worker control minus async N={sgd_a.cfg['workers']}, paired by "
                f"seed): SGD {dmg_sgd.fmt(signed=True)}, AdamW {dmg_adam.fmt(signed=True)}; AdamW's minus SGD's "
                f"{dd.fmt(signed=True)} (margin {margin})")
    body += (f"\n\nBoth optimizers at their own tuned rates, both controls at the async arm's batch per update and "
             f"equal samples; intervals: Student t over {len(sgd_c.runs)} seeds"
             + (", paired by seed." if paired else ", Welch (the arms' seeds differ)."))
    figs = [Figure(f1, ctx.caption("Test accuracy against samples, each arm at its tuned rate.")),
            Figure(f2, "Accuracy the control keeps over async, per optimizer; error bars: 95% t interval over seeds.")]
    return verdict, headline, body, figs, {"sgd_damage": dmg_sgd.estimate, "adamw_damage": dmg_adam.estimate,
                                           "adamw_minus_sgd": dd.estimate}


ANALYSES = {"adam_staleness": adam_staleness}
