"""The analysis of staleness and the optimizer (E16): is the accuracy that staleness costs larger
with AdamW than with SGD (Dai et al. 2018)? Same contract as psgd/lab/analyses.py, whose `analyse`
dispatches here; [params] names the arms: `sgd` and `adamw`, each [control, stale arm, ...] (async,
and SSP where it ran), the same stale arms in the same order for both; `plain` the same for SGD
without momentum, where it ran (issue 57: Dai et al.'s baseline).

Damage = control minus a stale arm (final test accuracy, paired by seed: the same initialisation and data
order in both); the verdict weighs AdamW's damage minus SGD's, per seed, with a t interval, against
the margin, for each stale arm: confirmed when AdamW loses clearly more, refuted when its loss is
clearly not larger by the margin, else inconclusive; and AdamW's own damage must exceed zero (a
part of its own), so that SGD gaining from staleness cannot confirm it. The verdict combines them.
With a `plain` arm the damages are weighed against plain SGD's, as Dai et al. did, and momentum
SGD's damage minus plain SGD's is reported beside them (key `<arm>_momentum_minus_plain`).
Where [params] states `targets` and `slowdown_margin`, Dai et al.'s other measure joins the budget's:
AdamW's slowdown in updates to each target (a stale arm's over its control's) over the base SGD's,
per stale arm over the range (psgd/lab/updates_to_target.py); the verdict combines the two measures,
so where they disagree it depends on the measure.
"""

from __future__ import annotations

from psgd.lab import plots, stats
from psgd.lab import targets as T
from psgd.lab import updates_to_target as U
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, Needs, acc_ci, variant_series
from psgd.lab.results import Figure, table


def adam_staleness(ctx: Context):
    p = ctx.params
    (sgd_c, *sgd_stale), (adam_c, *adam_stale) = ([ctx.group(x) for x in p[k]] for k in ("sgd", "adamw"))
    plain_c, *plain_stale = [ctx.group(x) for x in p.get("plain", [])] or [None]
    if len(sgd_stale) != len(adam_stale) or not sgd_stale or (plain_c and len(plain_stale) != len(sgd_stale)):
        raise ValueError(f"{ctx.exp.id}: [params] sgd and adamw must each name the control and the same stale "
                         f"arms (async, ssp), got {p['sgd']} and {p['adamw']}"
                         + (f" and plain {p['plain']}" if plain_c else ""))
    margin = float(p.get("margin", 0.02))
    # The figure of merit: test accuracy (damage = control - stale), or for a language model the test
    # loss in nats per token (damage = stale - control): either way a positive damage is a cost.
    loss = p.get("metric", "test_accuracy") == "test_loss"
    key_name, sign = ("test_loss", -1.0) if loss else ("test_accuracy", 1.0)
    order = [sgd_c, *sgd_stale, adam_c, *adam_stale, *([plain_c, *plain_stale] if plain_c else [])]
    # A difference of two damages is taken seed by seed, so every arm must have run the same seeds.
    if not all(g.seeds == sgd_c.seeds for g in order):
        raise ValueError(f"{ctx.exp.id}: every arm must run the same seeds (the damages are paired by seed)")
    def cost(control, stale) -> list[float]:
        return [sign * (c - a) for c, a in zip(control.finals(key_name), stale.finals(key_name), strict=True)]

    damage, dd, plain, momentum = {}, {}, {}, {}
    for i, (s_arm, a_arm) in enumerate(zip(sgd_stale, adam_stale, strict=True)):
        arm = _stale_name(s_arm)
        per_sgd, per_adam = cost(sgd_c, s_arm), cost(adam_c, a_arm)
        damage[arm] = (stats.mean_ci(per_sgd), stats.mean_ci(per_adam))
        if plain_c:  # Dai et al.'s baseline: both damages against plain SGD's
            per_plain = cost(plain_c, plain_stale[i])
            plain[arm], momentum[arm] = stats.mean_ci(per_plain), stats.diff_ci(per_sgd, per_plain)
        dd[arm] = stats.diff_ci(per_adam, per_plain if plain_c else per_sgd)
    verdict = V.staleness_hurts_adam_more(dd, margin, V.NATS if loss else V.ACCURACY,
                                          adam_damage={arm: a for arm, (_, a) in damage.items()},
                                          sgd="plain SGD" if plain_c else "SGD")
    base_c, base_stale = (plain_c, plain_stale) if plain_c else (sgd_c, sgd_stale)
    verdict, to_target = _with_updates_to_target(verdict, p, order, key_name, (adam_c, adam_stale),
                                                 (base_c, base_stale), "plain SGD" if plain_c else "SGD")
    f1, f2 = _draw(ctx, order, key_name, {arm: [*([plain[arm]] if plain_c else []), s, a]
                                           for arm, (s, a) in damage.items()}, bool(plain_c))
    body = _table(order, key_name)
    headline = (("test loss (nats) added by staleness (the stale arm minus the one-worker control"
                 if loss else "accuracy lost to staleness (one-worker control minus the stale arm")
                + f" at N={sgd_stale[0].cfg['workers']}, paired by seed): " + "; ".join(
                    (f"{arm}: plain SGD {plain[arm].fmt(signed=True)}, " if plain_c else f"{arm}: ")
                    + f"SGD {s.fmt(signed=True)}, AdamW {a.fmt(signed=True)}, AdamW's minus "
                    f"{'plain ' if plain_c else ''}SGD's {dd[arm].fmt(signed=True)}"
                    + (f", momentum SGD's minus plain SGD's {momentum[arm].fmt(signed=True)}" if plain_c else "")
                    for arm, (s, a) in damage.items()) + f" (margin {margin})")
    body += (f"\n\nBoth optimizers at their own tuned rates, every control at the stale arms' batch per update and "
             f"equal samples; intervals: Student t over {len(sgd_c.runs)} seeds, paired by seed.") + to_target
    what = "Test loss (nats per token)" if loss else "Test accuracy"
    figs = [Figure(f1, ctx.caption(f"{what} against samples, each arm at its tuned rate.")),
            Figure(f2, ("Test loss each stale arm adds over the control" if loss else
                        "Accuracy the control keeps over each stale arm") +
                   ", per optimizer; error bars: 95% t interval over seeds.")]
    key = {f"{arm}_{k}": v for arm in damage for k, v in
           (("sgd_damage", damage[arm][0].estimate), ("adamw_damage", damage[arm][1].estimate),
            ("adamw_minus_sgd", dd[arm].estimate))}
    key.update({f"{arm}_{k}": v for arm in plain for k, v in
                (("plain_damage", plain[arm].estimate), ("momentum_minus_plain", momentum[arm].estimate))})
    return verdict, headline, body, figs, key


def _with_updates_to_target(budget: V.Verdict, p: dict, order: list, key_name: str, adam: tuple, base: tuple,
                            base_name: str) -> tuple[V.Verdict, str]:
    """The fixed budget's verdict joined with Dai et al.'s other measure, updates to a target
    (psgd/lab/updates_to_target.py), where [params] states `targets` and `slowdown_margin`; and the
    report's paragraph on it. Both measures must agree for the claim to be decided."""
    if "targets" not in p:
        return budget, ""
    lower = key_name == "test_loss"
    if "slowdown_margin" not in p:
        raise ValueError("[params] targets needs slowdown_margin too: the smallest ratio of slowdowns of interest, "
                         "fixed in the file (E16: 0.2)")
    margin = float(p["slowdown_margin"])
    plateaus = {g.label: stats.mean_ci(g.finals(key_name)).estimate for g in order}
    kept, dropped = U.kept_targets(T.targets_of(p), plateaus, lower)
    text = "\n\n**Updates to a target** (Dai et al.'s other measure): " + T.range_text(kept, dropped, plateaus, lower)
    if not kept:
        return budget, text + "; none is left, so the claim is read at the fixed budget alone."
    (adam_c, adam_stale), (base_c, base_stale) = adam, base
    parts = {(_stale_name(a), t): U.ratio_of_slowdowns(U.slowdowns(adam_c, a, t, key_name, lower),
                                                       U.slowdowns(base_c, b, t, key_name, lower))
             for a, b in zip(adam_stale, base_stale, strict=True) for t in kept}
    ut = U.judge(parts, margin, base_name)
    outcome = V.combine([budget.outcome, ut.outcome])
    text += f": {ut.outcome} ({ut.reason}); samples to a target interpolated between evaluations, paired by seed."
    return V.Verdict(outcome, f"at the fixed budget: {budget.reason}; in updates to the target: {ut.reason}",
                     budget.effects + ut.effects), text


def _table(order: list, key_name: str) -> str:
    loss = key_name == "test_loss"
    rows = [[g.label, g.cfg["optim"]["optimizer"], f"{g.cfg['optim'].get('momentum', 0):g}", g.mode, g.cfg["workers"],
             f"{g.lr:g}", stats.mean_ci(g.finals(key_name)).fmt() if loss else acc_ci(g).fmt(),
             f"{g.mean('staleness.mean'):.2f}", g.converged()] for g in order]
    return table(["run", "optimizer", "momentum", "mode", "workers", "lr (tuned)",
                  "test loss, nats [95% CI]" if loss else "test accuracy [95% CI]", "mean staleness", "converged"],
                 rows)


def _draw(ctx: Context, order: list, key_name: str, cis: dict, plain: bool) -> tuple:
    """The curves of every arm, and each optimizer's staleness cost per stale arm (`cis`: arm -> [plain
    SGD's if it ran, momentum SGD's, AdamW's])."""
    loss = key_name == "test_loss"
    f1 = ctx.out / ("loss_vs_samples.png" if loss else "accuracy_vs_samples.png")
    plots.curves(variant_series(order), "samples", key_name, f1, f"{ctx.exp.id}: SGD and AdamW, with and "
                 "without staleness")
    f2 = ctx.out / "staleness_cost.png"
    plots.dots([*(["plain SGD"] if plain else []), "SGD (momentum 0.9)", "AdamW"],
               {f"control minus {arm}": (f"variant:{i}", [c.estimate for c in ci], [(c.lo, c.hi) for c in ci])
                for i, (arm, ci) in enumerate(cis.items())},
               "test loss added by staleness (nats)" if loss else "accuracy lost to staleness", f2,
               f"{ctx.exp.id}: what staleness costs each optimizer",
               refs=[(0.0, "no cost")])
    return f1, f2


def _stale_name(g) -> str:
    """async, or ssp s=S: the stale arm as the verdict names it."""
    return f"ssp s={g.cfg['staleness']}" if g.mode == "ssp" else g.mode


ANALYSES = {"adam_staleness": adam_staleness}
NEEDS = {"adam_staleness": Needs(params=("sgd", "adamw"))}
