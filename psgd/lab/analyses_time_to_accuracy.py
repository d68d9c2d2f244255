"""E20: the speed claims in their own metric, wall-clock time to a target accuracy (DAWNBench's).

Dean et al. 2012 (Downpour SGD) and Ho et al. 2013 (SSP) claim faster convergence in time, not
more updates per second. Contract: `time_to_accuracy(ctx)` returns a `Finding` for an experiment
whose runs are sync, async and SSP with no straggler, under random jitter on every worker, and under
one persistent straggler, each process in its own CPU quota. Arms are found by their configs (mode,
--jitter, --straggler). The parts, each judged by `verdicts.part` on the ratio of seconds to the
target, paired by seed over the seeds where both arms reached it:

- Dean 2012: async reaches the target sooner than sync (sync's seconds over async's above 1 + margin);
- Ho 2013, transient stragglers: SSP sooner than BSP under jitter (same test);
- Ho 2013, where it cannot help: under a persistent straggler SSP is no more than the margin faster
  than BSP, since the straggler fills the staleness bound and sets the pace ("no_worse" of
  BSP's seconds over SSP's against 1 + margin, read the other way: ssp / sync above 1 - margin).
"""

from __future__ import annotations

import math

from psgd.lab import plots, stats
from psgd.lab import targets as T
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, seconds_to, series_of, speedup_to
from psgd.lab.results import Figure, Finding, Group, table

MARGIN = 0.1   # 10% less wall-clock time to the target (the TOML says why)
CONDITIONS = ("no straggler", "random jitter", "persistent straggler")


def condition(g: Group) -> str:
    if g.cfg.get("straggler"):
        return "persistent straggler"
    return "random jitter" if g.cfg.get("jitter", 0) > 0 else "no straggler"


def arms_of(ctx: Context) -> dict[tuple[str, str], Group]:
    """(mode, condition) -> its arm; where two arms share both (the tuning's and the timed one, on a
    denser grid of evaluations), the one evaluated most often."""
    arms: dict[tuple[str, str], Group] = {}
    for g in ctx.groups.values():
        k = (g.mode, condition(g))
        if k not in arms or len(g.runs[0].evals) > len(arms[k].runs[0].evals):
            arms[k] = g
    needed = [("sync", "no straggler"), ("async", "no straggler"), ("sync", "random jitter"),
              ("ssp", "random jitter"), ("sync", "persistent straggler"), ("ssp", "persistent straggler")]
    missing = [f"{m} ({c})" for m, c in needed if (m, c) not in arms]
    if missing:
        raise ValueError(f"{ctx.exp.path}: needs runs for {', '.join(missing)}")
    return arms


PAPERS = ("Dean 2012: sync / async", "Ho 2013, jitter: sync / ssp")   # the papers' claims; the rest: the lab's


def measure(arms: dict, target: float | tuple[float, ...]) -> tuple[V.Verdict, dict]:
    """Every check at every target of the range (issue 57: psgd/lab/targets.py); the papers' claims
    decide the verdict, the lab's corollary (SSP under a persistent straggler) is a verdict of its own."""
    wanted = (target,) if isinstance(target, float) else tuple(target)
    plateaus = {f"{m} ({c})": g.ci().estimate for (m, c), g in arms.items()}
    targets, dropped = T.split_by_plateau(wanted, plateaus)
    parts, key = [], {"target_accuracy": wanted[-1], "targets": list(targets), "targets_dropped": list(dropped)}
    per_check: dict[str, list[str]] = {}
    checks = [("Dean 2012: sync / async", ("sync", "no straggler"), ("async", "no straggler"), "effect"),
              ("Ho 2013, jitter: sync / ssp", ("sync", "random jitter"), ("ssp", "random jitter"), "effect"),
              ("Ho 2013, persistent straggler: ssp / sync", ("ssp", "persistent straggler"),
               ("sync", "persistent straggler"), "no_worse")]
    for label, slow, fast, test in checks:
        for target in targets:
            ratio, missed = speedup_to(arms[slow], arms[fast], target)
            # "no_worse" here: SSP's seconds over sync's stay above 1 - margin (SSP is not much faster).
            parts.append(V.part(f"{label} time to {target:.0%}", ratio, MARGIN, test, V.RATIO, null=1.0))
            per_check.setdefault(label, []).append(parts[-1].outcome)
            key[f"{label} at {target:.0%}"] = {"ratio": ratio.estimate, "ci": [ratio.lo, ratio.hi],
                                               "seeds_not_reaching": missed}
    outcome = {label: T.over_range(o) for label, o in per_check.items()}
    corollary = checks[-1][0]  # not judged (absent from `outcome`) when every target was dropped
    key["papers"], key["corollary"] = {k: outcome[k] for k in PAPERS if k in outcome}, outcome.get(corollary)
    papers = V.combine([outcome[k] for k in PAPERS if k in outcome]) if targets else V.INCONCLUSIVE
    reason = (f"seconds to each target, paired by seed over the seeds where both arms reached it, over "
              f"{T.range_text(targets, dropped, plateaus)}: the papers' claims, sync's over async's (Dean 2012) "
              f"and sync's over SSP's under jitter (Ho 2013), above 1 + {MARGIN:g} at every target "
              f"({'; '.join(f'{k}: {outcome[k]}' for k in PAPERS if k in outcome)}). The lab's corollary, a verdict "
              f"of its own not merged into the papers': under a persistent straggler SSP's over sync's above "
              f"1 - {MARGIN:g} (no real gain): {outcome.get(corollary, 'not judged')}")
    return V.Verdict(papers, reason, tuple(parts)), key


def draw(ctx: Context, arms: dict, target: float) -> list[Figure]:
    modes = [m for m in ("sync", "async", "ssp") if any(k[0] == m for k in arms)]
    conditions = [c for c in CONDITIONS if any(k[1] == c for k in arms)]
    nan = (float("nan"), (float("nan"), float("nan")))
    bars = {}
    for m in modes:
        cells = []
        for c in conditions:
            reached = [t for t in seconds_to(arms[(m, c)], target) if math.isfinite(t)] if (m, c) in arms else []
            ci = stats.mean_ci(reached) if reached else None
            cells.append((ci.estimate, (ci.lo, ci.hi)) if ci else nan)
        bars[m] = (m, [v for v, _ in cells], [e for _, e in cells])
    f1 = ctx.out / "time_to_target.png"
    plots.bars(conditions, bars, f"seconds to {target:.0%} test accuracy", f1,
               f"{ctx.exp.id}: time to {target:.0%} test accuracy, each process in its own CPU quota")
    shown = [arms[k] for k in sorted(arms, key=lambda k: (CONDITIONS.index(k[1]), k[0]))]
    f2 = ctx.out / "accuracy_vs_elapsed_s.png"
    plots.curves(series_of(shown, [f"{g.mode}, {condition(g)}" for g in shown]), "elapsed_s", "test_accuracy", f2,
                 f"{ctx.exp.id}: accuracy against wall time", refs=[(target, f"target {target:.0%}")])
    return [Figure(f1, "Seconds of steady-state training to the target, mean over the seeds that reached it; error "
                       "bars: 95% t interval."),
            Figure(f2, ctx.caption("Test accuracy against steady-state wall time; dotted: the target."))]


def write(arms: dict, target: float, verdict: V.Verdict) -> tuple[str, str]:
    rows = []
    for (mode, cond), g in sorted(arms.items(), key=lambda kv: (CONDITIONS.index(kv[0][1]), kv[0][0])):
        t = seconds_to(g, target)
        reached = [x for x in t if math.isfinite(x)]
        rows.append([mode, cond, f"{g.lr:g}", stats.mean_ci(reached).fmt(1) if len(reached) >= 2 else "-",
                     f"{len(t) - len(reached)} of {len(t)}", f"{g.mean('samples_per_s'):.0f}", g.ci().fmt()])
    text = table(["mode", "condition", "lr", f"s to {target:.0%} [95% CI]", "never reached", "samples/s",
                  "test accuracy [95% CI]"], rows)
    said = "; ".join(f"{e.label}: " + (e.ci.fmt(2) + "x" if e.ci.n >= 2 else "fewer than 2 seeds reached it in both")
                     + f" ({e.outcome})" for e in verdict.effects)
    text += ("\n\nTime to target: seconds of steady-state training until the test accuracy first reached it, on "
             "this experiment's dense grid of evaluations. Samples/s alone (E2) says how fast updates are made; "
             "this says how soon they add up to a model, which is what Dean et al. and Ho et al. claim.")
    return said, text


def time_to_accuracy(ctx: Context) -> Finding:
    target = float(ctx.params.get("target_accuracy", 0.6))   # the figures' and the table's target
    arms = arms_of(ctx)
    verdict, key = measure(arms, T.targets_of(ctx.params))
    figures = draw(ctx, arms, target)
    headline, text = write(arms, target, verdict)
    return Finding(verdict, headline, text, figures, key)


ANALYSES = {"time_to_accuracy": time_to_accuracy}
