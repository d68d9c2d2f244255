"""E19: backup workers on their own terms (Chen et al. 2016, "Revisiting distributed synchronous SGD").

Contract: `backup_tail(ctx)` returns a `Finding` for an experiment whose runs are sync with N
workers, sync with N + b workers of which each update takes the first N gradients (b = 1, 2), and
async with N workers, all under the same heavy-tailed random delay on every worker (`--jitter-tail
pareto`) and a kernel CPU quota per process. Arms are found by their configs (mode, backup
workers), not by their labels. The claim's parts, each judged by `verdicts.part`:

- per b: sync N+b reaches the target test accuracy sooner in wall-clock time than sync N
  (DAWNBench's metric): the ratio of seconds to target, sync N over sync N+b, paired by seed, above
  1 + the margin;
- per b: sync N+b ends no worse than async N (at each run's best validation point), within the
  accuracy margin.

A seed whose run never reaches the target has no time: the part is judged on the seeds where both
arms reached it, and the report says how many did not. Statistics first (`measure`), then the
figures (`draw`), then the prose (`write`), kept apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, diff, seconds_to, series_of, speedup_to
from psgd.lab.results import Figure, Finding, Group, table

SPEEDUP_MARGIN = 0.1      # 10% less time to target: the least worth one more machine per N (the TOML says why)
ACCURACY_MARGIN = 0.01    # one accuracy point, as E1


@dataclass(frozen=True)
class Arms:
    """The experiment's arms by role: sync with N workers, sync N+b by b, async with N."""
    sync: Group
    backups: dict[int, Group]
    asynchronous: Group
    n: int


def arms_of(ctx: Context) -> Arms:
    """The arms under the random delay, found by config; a missing role is a one-line error."""
    delayed = [g for g in ctx.groups.values() if g.cfg.get("jitter", 0) > 0]
    sync = [g for g in delayed if g.mode == "sync" and not g.cfg.get("backup_workers", 0)]
    backups = {g.cfg["backup_workers"]: g for g in delayed if g.mode == "sync" and g.cfg.get("backup_workers", 0)}
    asynchronous = [g for g in delayed if g.mode == "async"]
    if len(sync) != 1 or len(asynchronous) != 1 or not backups:
        raise ValueError(f"{ctx.exp.path}: needs one sync, one async and sync N+b runs under --jitter; has "
                         f"{', '.join(g.label for g in delayed) or 'none'}")
    n = sync[0].cfg["workers"]
    for b, g in backups.items():
        if g.cfg["workers"] != n + b:
            raise ValueError(f"{ctx.exp.path}: {g.label} has {g.cfg['workers']} workers; N + b is {n + b}")
    return Arms(sync[0], dict(sorted(backups.items())), asynchronous[0], n)


def measure(arms: Arms, target: float) -> tuple[V.Verdict, dict]:
    """The parts and the key numbers: no figures, no prose."""
    parts, key = [], {"target_accuracy": target, "n": arms.n}
    for b, g in arms.backups.items():
        ratio, missed = speedup_to(arms.sync, g, target)
        parts.append(V.part(f"b={b}: sync N / sync N+{b} time to {target:.0%}", ratio, SPEEDUP_MARGIN, "effect",
                            V.RATIO, null=1.0))
        acc = diff(g, arms.asynchronous)
        parts.append(V.part(f"b={b}: sync N+{b} - async accuracy", acc, ACCURACY_MARGIN, "no_worse"))
        key[f"b{b}"] = {"speedup": ratio.estimate, "speedup_ci": [ratio.lo, ratio.hi], "seeds_not_reaching": missed,
                        "minus_async": acc.estimate, "minus_async_ci": [acc.lo, acc.hi]}
    outcome = V.combine([p.outcome for p in parts])
    reason = (f"each b: sync N's seconds to {target:.0%} test accuracy over sync N+b's above 1 + {SPEEDUP_MARGIN:g} "
              f"(paired by seed, seeds where both reached it), and sync N+b's accuracy minus async's above "
              f"-{ACCURACY_MARGIN:g}; all parts must agree")
    return V.Verdict(outcome, reason, tuple(parts)), key


# Where the workers' cores come from, as the report says it: the measured runs' CPU quotas, or
# (psgd/lab/analyses_scale.py `sim_backup_tail`) the simulator's time model.
QUOTAS = ("Every process runs in its own kernel CPU quota, so the extra workers bring their own cores, as extra "
          "machines would.")


def draw(ctx: Context, arms: Arms, target: float, simulated: str = "") -> list[Figure]:
    """The figures; `simulated` ("SIMULATED (N=32)") heads their titles and captions, in virtual seconds."""
    tag, secs = (f" {simulated}", "virtual seconds") if simulated else ("", "seconds")
    groups = [arms.sync, *arms.backups.values(), arms.asynchronous]
    names = [f"sync N={arms.n}", *(f"sync {arms.n}+{b}" for b in arms.backups), f"async N={arms.n}"]
    f1 = ctx.out / "time_to_target.png"
    nan = stats.Interval(float("nan"), float("nan"), float("nan"), 0)  # no seed reached it: no bar
    reached = [[t for t in seconds_to(g, target) if math.isfinite(t)] for g in groups]
    cis = [stats.mean_ci(r) if r else nan for r in reached]
    plots.bars([f"s to {target:.0%}"], {name: (f"variant:{i}", [c.estimate], [(c.lo, c.hi)])
                                       for i, (name, c) in enumerate(zip(names, cis, strict=True))},
               f"{secs} of training", f1,
               f"{ctx.exp.id}{tag}: time to {target:.0%} test accuracy under heavy-tailed delays")
    f2 = ctx.out / "accuracy_vs_elapsed_s.png"
    plots.curves(series_of(groups, names), "elapsed_s", "test_accuracy", f2,
                 f"{ctx.exp.id}{tag}: accuracy against {'virtual' if simulated else 'wall'} time",
                 refs=[(target, f"target {target:.0%}")])
    said = "SIMULATED: " if simulated else ""
    return [Figure(f1, f"{said}{secs.capitalize()} of training to the target, mean over the seeds that reached it; "
                       "error bars: 95% t interval."),
            Figure(f2, ctx.caption(f"{said}Test accuracy against {'virtual' if simulated else 'steady-state wall'} "
                                   "time; dotted: the target."))]


def write(arms: Arms, target: float, verdict: V.Verdict, cores: str = QUOTAS) -> tuple[str, str]:
    """The headline and the text; `cores` says where the workers' cores come from."""
    rows = []
    for g in [arms.sync, *arms.backups.values(), arms.asynchronous]:
        t = seconds_to(g, target)
        reached = [x for x in t if math.isfinite(x)]
        rows.append([g.label, str(g.cfg["workers"]), str(g.cfg.get("backup_workers", 0)), f"{g.lr:g}",
                     stats.mean_ci(reached).fmt(1) if len(reached) >= 2 else "-",
                     f"{len(t) - len(reached)} of {len(t)}", f"{g.mean('updates_per_s'):.0f}", g.ci().fmt()])
    text = table(["run", "workers", "backup", "lr", f"s to {target:.0%} [95% CI]", "never reached",
                  "updates/s", "test accuracy [95% CI]"], rows)
    def number(e: V.Effect) -> str:
        if e.unit != V.RATIO:
            return e.ci.fmt(3, signed=True)
        return e.ci.fmt(2) + "x" if e.ci.n >= 2 else "fewer than 2 seeds reached the target in both arms"

    said = "; ".join(f"{e.label}: {number(e)} ({e.outcome})" for e in verdict.effects)
    headline = f"under a Pareto(1.5) delay on every worker, {said}"
    text += ("\n\nEvery worker sleeps a Pareto-distributed delay each step (shape 1.5: a finite mean, an infinite "
             "variance), so a sync step waits for the largest of N draws, which grows like N^(2/3); with b backups "
             f"each update takes the first N of N + b gradients and drops the rest, as Chen et al. 2016 do. {cores} "
             "Time to target: seconds of steady-state training until the test accuracy first reached it (evaluated "
             "on the experiment's grid of training samples).")
    return headline, text


def backup_tail(ctx: Context) -> Finding:
    target = float(ctx.params.get("target_accuracy", 0.58))
    arms = arms_of(ctx)
    verdict, key = measure(arms, target)
    figures = draw(ctx, arms, target)
    headline, text = write(arms, target, verdict)
    return Finding(verdict, headline, text, figures, key)


ANALYSES = {"backup_tail": backup_tail}
