"""E21: the staleness-aware rate on its own terms (Zhang et al. 2016): large staleness, each arm at
its own rate chosen on the validation split.

Contract: `staleness_aware(ctx)` returns a `Finding` for an experiment whose runs are plain async and
async with `--staleness-lr` (each gradient's step divided by its staleness) at the same N, and
optionally sync at that N, each tuned over its own grid. Arms are found by their configs (mode,
staleness_lr). The claim's part, judged by `verdicts.part`: the staleness-aware arm's test accuracy
minus plain async's, paired by seed, above the margin ("effect"). Beside it, each arm's mean
staleness and whether its rate sits at the edge of its grid (the tuning table says so too).
"""

from __future__ import annotations

from psgd.lab import plots
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, diff, series_of
from psgd.lab.results import Figure, Finding, Group, table

MARGIN = 0.01  # one accuracy point (the TOML says why)


def arms_of(ctx: Context) -> tuple[Group, Group, Group | None]:
    """(plain async, staleness-aware async, sync or None), by config."""
    plain = [g for g in ctx.groups.values() if g.mode == "async" and not g.cfg.get("staleness_lr")]
    aware = [g for g in ctx.groups.values() if g.mode == "async" and g.cfg.get("staleness_lr")]
    sync = [g for g in ctx.groups.values() if g.mode == "sync"]
    if len(plain) != 1 or len(aware) != 1:
        raise ValueError(f"{ctx.exp.path}: needs one plain async and one --staleness-lr async run; has "
                         f"{', '.join(ctx.groups) or 'none'}")
    return plain[0], aware[0], sync[0] if sync else None


def staleness_aware(ctx: Context, simulated: str = "") -> Finding:
    """The finding; `simulated` (the time model's "SIMULATED ..." line) heads its headline and figure."""
    plain, aware, sync = arms_of(ctx)
    gain = diff(aware, plain)
    part = V.part("staleness-aware - plain async", gain, MARGIN, "effect")
    verdict = V.Verdict(part.outcome, f"the staleness-aware arm's test accuracy minus plain async's, each at its own "
                                      f"rate, paired by seed, above {MARGIN:g}", (part,))
    shown = [g for g in (plain, aware, sync) if g is not None]
    rows = [[g.label, str(g.cfg["workers"]), f"{g.lr:g}", f"{g.mean('staleness.mean'):.1f}", g.ci().fmt()]
            for g in shown]
    text = table(["run", "workers", "lr (own, on validation)", "mean staleness", "test accuracy [95% CI]"], rows)
    text += ("\n\nThe staleness-aware rate divides each gradient's step by its staleness, so its tuned rate is "
             "larger than plain async's; plain async's grid reaches below its best rate, so a win is not a "
             "smaller step that plain async was never offered.")
    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(series_of(shown), "samples", "test_accuracy", f1,
                 f"{ctx.exp.id}{' SIMULATED' if simulated else ''}: test accuracy, each at its own rate")
    n = plain.cfg["workers"]
    headline = (f"{simulated + ': ' if simulated else ''}at N={n} (mean staleness {plain.mean('staleness.mean'):.1f}), "
                f"staleness-aware minus plain async {gain.fmt(3, signed=True)} ({part.outcome})")
    key = {"gain": gain.estimate, "gain_ci": [gain.lo, gain.hi], "workers": n,
           "staleness": plain.mean("staleness.mean"), "lr_plain": plain.lr, "lr_aware": aware.lr}
    caption = ("SIMULATED: t" if simulated else "T") + "est accuracy against training samples."
    if simulated:
        text = f"Every run here is {simulated} (the claim is about accuracy: time does not enter it).\n\n{text}"
        key.update(simulated=True, time_model=simulated)
    return Finding(verdict, headline, text, [Figure(f1, ctx.caption(caption))], key)


ANALYSES = {"staleness_aware": staleness_aware}
