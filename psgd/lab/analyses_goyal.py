"""E23: the linear scaling rule with warmup on its own terms (Goyal et al. 2017, "Accurate, large
minibatch SGD"): a large batch at k times the small batch's rate, warmed up, ends no worse than
the small batch, and no worse than the large batch's own tuned rate.

Contract: `linear_scaling(ctx)` returns a `Finding` for an experiment whose runs are sync at a small
batch (its tuned rate), at a batch k times larger with k times that rate and a warmup, and at the
large batch with its own tuned rate. Arms are found by their configs (batch size, warmup). The
parts, each judged by `verdicts.part` on test accuracy paired by seed, "no_worse" within the margin:
the scaled arm minus the small batch (the paper's claim), and the scaled arm minus the large batch's
own tuned rate (the rule saves the sweep).
"""

from __future__ import annotations

from psgd.lab import plots
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, diff, variant_series
from psgd.lab.results import Figure, Finding, Group, table

MARGIN = 0.01  # one accuracy point (the TOML says why)


def arms_of(ctx: Context) -> tuple[Group, Group, Group]:
    """(small batch, large batch scaled + warmup, large batch tuned), by config."""
    sizes = sorted({g.cfg["batch_size"] for g in ctx.groups.values()})
    small = [g for g in ctx.groups.values() if g.cfg["batch_size"] == sizes[0]]
    large = [g for g in ctx.groups.values() if g.cfg["batch_size"] == sizes[-1] and len(sizes) > 1]
    scaled = [g for g in large if g.cfg["optim"].get("warmup", 0) > 0]
    tuned = [g for g in large if not g.cfg["optim"].get("warmup", 0)]
    if len(small) != 1 or len(scaled) != 1 or len(tuned) != 1:
        raise ValueError(f"{ctx.exp.path}: needs one small-batch run, one large-batch run with --warmup and one "
                         f"without; has {', '.join(ctx.groups) or 'none'}")
    return small[0], scaled[0], tuned[0]


def linear_scaling(ctx: Context) -> Finding:
    small, scaled, tuned = arms_of(ctx)
    k = scaled.cfg["batch_size"] // small.cfg["batch_size"]
    global_batch = scaled.cfg["batch_size"] * scaled.cfg["workers"]
    vs_small, vs_tuned = diff(scaled, small), diff(scaled, tuned)
    parts = (V.part(f"scaled x{k} + warmup - batch {small.cfg['batch_size'] * small.cfg['workers']}", vs_small,
                    MARGIN, "no_worse"),
             V.part(f"scaled x{k} + warmup - batch {global_batch} tuned", vs_tuned, MARGIN, "no_worse"))
    verdict = V.Verdict(V.combine([p.outcome for p in parts]),
                        f"at batch {global_batch}, the linearly scaled rate with warmup minus the small batch and "
                        f"minus its own tuned rate, paired by seed, each above -{MARGIN:g}", parts)
    rows = [[g.label, str(g.cfg["batch_size"] * g.cfg["workers"]), f"{g.lr:g}", str(g.cfg["optim"].get("warmup", 0)),
             str(g.runs[0].summary.get("global_updates", "")), g.ci().fmt()] for g in (small, scaled, tuned)]
    text = table(["run", "global batch", "lr", "warmup updates", "updates", "test accuracy [95% CI]"], rows)
    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series([small, scaled, tuned]), "samples", "test_accuracy", f1,
                 f"{ctx.exp.id}: the linear scaling rule at batch {global_batch}")
    headline = "; ".join(f"{p.label} {p.ci.fmt(3, signed=True)} ({p.outcome})" for p in parts)
    key = {"vs_small": vs_small.estimate, "vs_small_ci": [vs_small.lo, vs_small.hi], "vs_tuned": vs_tuned.estimate,
           "vs_tuned_ci": [vs_tuned.lo, vs_tuned.hi], "batch": global_batch, "k": k}
    return Finding(verdict, headline, text, [Figure(f1, ctx.caption("Test accuracy against training samples."))], key)


ANALYSES = {"linear_scaling": linear_scaling}
