"""E22: DiLoCo on its own terms (Douillard et al. 2023): 4 workers, 50 outer steps, the outer
learning rate chosen on the validation split over a grid.

Contract: `diloco_outer(ctx)` returns a `Finding` for an experiment whose runs are sync data
parallel (local_steps 1) and DiLoCo (local_steps H > 1, an outer optimizer) at several outer rates,
all on the same seeds. Arms are found by their configs (local_steps, outer_lr). The outer rate is
the one of lowest mean final validation loss (never the test set); the part, judged by
`verdicts.part`: sync's test loss minus DiLoCo's at that rate, paired by seed, above -margin
("no_worse": DiLoCo loses at most the margin). A rate at the grid's edge is said so in the headline.
"""

from __future__ import annotations

import numpy as np

from psgd.lab import plots
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, diff, series_of
from psgd.lab.results import Figure, Finding, Group, table

MARGIN = 0.05  # nats per character of test loss (the TOML says why)


def arms_of(ctx: Context) -> tuple[Group, dict[float, Group]]:
    sync = [g for g in ctx.groups.values() if g.cfg.get("local_steps", 1) == 1]
    diloco = {g.cfg["optim"]["outer_lr"]: g for g in ctx.groups.values() if g.cfg.get("local_steps", 1) > 1}
    if len(sync) != 1 or not diloco:
        raise ValueError(f"{ctx.exp.path}: needs one sync run and DiLoCo runs (--local-steps H > 1); has "
                         f"{', '.join(ctx.groups) or 'none'}")
    return sync[0], dict(sorted(diloco.items()))


def diloco_outer(ctx: Context) -> Finding:
    sync, diloco = arms_of(ctx)
    val = {lr: float(np.mean(g.finals("val_loss"))) for lr, g in diloco.items()}
    best = min(val, key=lambda lr: (val[lr], lr))
    chosen = diloco[best]
    edge = len(val) > 1 and best in (min(val), max(val))
    gap = diff(sync, chosen, "test_loss")     # sync's loss minus DiLoCo's: negative when DiLoCo is worse
    part = V.part(f"sync - DiLoCo H={chosen.cfg['local_steps']} test loss", gap, MARGIN, "no_worse", V.NATS)
    h = chosen.cfg["local_steps"]
    outer_steps = chosen.runs[0].summary.get("global_updates", 0)
    verdict = V.diloco_at_scale(chosen.cfg["workers"], outer_steps, False, V.Verdict(
        part.outcome, f"at the outer rate of lowest validation loss, sync's test loss minus DiLoCo's, paired by seed, "
                      f"above -{MARGIN:g} nats", (part,)))
    rows = [[g.label, f"{g.cfg['optim']['outer_lr']:g}" if g is not sync else "-", f"{g.lr:g}",
             f"{np.mean(g.finals('val_loss')):.3f}", g.ci("test_loss").fmt(3)] for g in [sync, *diloco.values()]]
    text = table(["run", "outer lr", "inner lr", "validation loss", "test loss [95% CI]"], rows)
    text += (f"\n\nDiLoCo's outer rate is chosen on the validation loss: {best:g}"
             + (" (at the grid's edge: its best may lie beyond)." if edge else ", inside its grid.")
             + f" Each DiLoCo run makes {outer_steps} outer steps of H = {h} inner AdamW steps on "
             f"{chosen.cfg['workers']} workers and communicates {h} times less than sync.")
    f1 = ctx.out / "loss_vs_samples.png"
    plots.curves(series_of([sync, chosen], [sync.label, chosen.label]), "samples", "test_loss", f1,
                 f"{ctx.exp.id}: test loss, DiLoCo at its chosen outer rate")
    headline = (f"{chosen.cfg['workers']} workers, {outer_steps} outer steps of H={h}, outer lr {best:g} chosen on "
                f"validation{' (grid edge)' if edge else ''}: sync minus DiLoCo test loss "
                f"{gap.fmt(3, signed=True)} nats ({part.outcome} in early training; the claim: {verdict.outcome})")
    key = {"gap": gap.estimate, "gap_ci": [gap.lo, gap.hi], "outer_lr": best, "edge": edge, "outer_steps": outer_steps,
           "H": h, "workers": chosen.cfg["workers"]}
    return Finding(verdict, headline, text, [Figure(f1, ctx.caption("Test loss against training samples."))], key)


ANALYSES = {"diloco_outer": diloco_outer}
