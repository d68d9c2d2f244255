"""The scale suite's bottleneck claim (experiments/scale.toml): a central server at tens to hundreds of
workers, SIMULATED (psgd/sim/), beside the alpha-beta cost model's prediction.

Contract: `sim_bottleneck(ctx)` returns a `Finding` for an experiment whose runs are sync PS runs
made with `simulate = true`, a grid of worker counts N and shard counts K on one stated network (the
runs' --link and time model). Arms are found by their configs (workers, servers). Every number is
the simulation's (SIMULATED, its time model stated in the headline); the cost model's prediction
(psgd/core/costmodel.py `step_time`, sync, one process per host, alpha = the time model's message
cost) stands beside it, with their relative difference, and is not part of the verdict. The parts,
each judged by `verdicts.part` on a ratio of samples/s paired by seed:

- the one-shard server stops scaling: at the largest N, twice the throughput at N/2 over the
  throughput at N is above 1 + margin (doubling the workers gains less than the margin's share of
  the ideal doubling);
- shards relieve it: at the largest N, the most shards' throughput over one shard's is above 1 + margin.

`sim_time_to_accuracy(ctx)`: Dean 2012 and Ho 2013 at tens of workers, SIMULATED: E20's arms, rule
and table (psgd/lab/analyses_time_to_accuracy.py `arms_of`, `measure`, `write`) on simulated runs,
with figures of their own that say SIMULATED: seconds to the target, accuracy against virtual
time, and each check's ratio as a curve over the targets (the target's choice shown, not hidden).

`sim_backup_tail(ctx)`: Chen et al. 2016 at tens of workers, SIMULATED: E19's arms, rule, table and
figures (psgd/lab/analyses_backup_tail.py), the figures and prose saying SIMULATED and the time model.
`sim_staleness_aware(ctx)`: Zhang et al. 2016 at their scale, SIMULATED: E21's (analyses_staleness_aware.py).
"""

from __future__ import annotations

import math

from psgd.core import costmodel
from psgd.lab import analyses_backup_tail as bt
from psgd.lab import analyses_staleness_aware as sa
from psgd.lab import analyses_time_to_accuracy as tta
from psgd.lab import plots, stats
from psgd.lab import targets as T
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, seconds_to, series_of
from psgd.lab.results import Figure, Finding, Group, table

MARGIN = 0.2  # a 0.2x difference in scaling (the TOML says why)


def grid_of(ctx: Context) -> dict[tuple[int, int], Group]:
    """(shards K, workers N) -> its arm; ValueError unless every arm is a simulated sync PS run and the
    grid has two worker counts or more at one shard and one or more other shard counts."""
    grid: dict[tuple[int, int], Group] = {}
    for g in ctx.groups.values():
        if g.mode != "sync" or not all(r.summary.get("simulated") for r in g.runs):
            raise ValueError(f"{ctx.exp.path}: {g.label!r} is not a simulated sync run (simulate = true, mode = sync)")
        grid[(int(g.cfg["servers"]), int(g.cfg["workers"]))] = g
    ks, ns = sorted({k for k, _ in grid}), sorted({n for _, n in grid})
    if 1 not in ks or len(ks) < 2 or len([n for n in ns if (1, n) in grid]) < 2:
        raise ValueError(f"{ctx.exp.path}: needs one shard and more shards at two or more worker counts; has "
                         f"{', '.join(ctx.groups) or 'none'}")
    return grid


def predicted(g: Group) -> float:
    """The cost model's samples/s for this arm's config and time model (sync, one process per host)."""
    s = g.runs[0].summary
    tm = s["time_model"]
    link = tm.get("link") or {}
    bits = link.get("bits_per_s") or math.inf
    machine = costmodel.Machine(latency_s=link.get("latency_s", 0.0), alpha_s=tm.get("message_s", 0.0),
                                beta_s_per_byte=0.0 if math.isinf(bits) else 8.0 / bits,
                                apply_s_per_byte=tm["apply_s_per_byte"], cores=0)
    params = tm["peak_bytes_in_flight"] // max(1, tm["peak_vectors_in_flight"]) // 4
    batch = int(g.cfg["batch_size"]) * int(g.cfg.get("accumulate", 1))
    work = costmodel.Workload(params=params, wire_bytes=4, batch=batch,
                              compute_s_fixed=tm["compute_s_per_step"], compute_s_per_sample=0.0,
                              jitter_s=tm.get("jitter_s", 0.0))
    return costmodel.step_time("sync", int(g.cfg["workers"]), int(g.cfg["servers"]), machine, work).samples_per_s


def sim_bottleneck(ctx: Context) -> Finding:
    grid = grid_of(ctx)
    ks = sorted({k for k, _ in grid})
    one = sorted(n for k, n in grid if k == 1)
    top, half = one[-1], one[-2]
    most = max(k for k in ks if (k, top) in grid)
    rate = {key: g.values("samples_per_s") for key, g in grid.items()}
    stall = stats.ratio_ci([2 * x for x in rate[(1, half)]], rate[(1, top)])
    relief = stats.ratio_ci(rate[(most, top)], rate[(1, top)])
    parts = (V.part(f"K=1: 2 x samples/s at N={half} over N={top}", stall, MARGIN, "effect", V.RATIO, null=1.0),
             V.part(f"N={top}: K={most} over K=1 samples/s", relief, MARGIN, "effect", V.RATIO, null=1.0))
    verdict = V.Verdict(V.combine([p.outcome for p in parts]),
                        f"SIMULATED: at N={top}, doubling the workers of one shard gains less than 1/(1+{MARGIN:g}) "
                        f"of the ideal, and {most} shards carry more than 1+{MARGIN:g} times one shard's samples/s, "
                        "paired by seed", parts)
    rows, ys = [], {}
    for k in ks:
        ns = sorted(n for kk, n in grid if kk == k)
        sims = [stats.mean_ci(rate[(k, n)]) for n in ns]
        model = [predicted(grid[(k, n)]) for n in ns]
        ys[f"K={k} SIMULATED"] = (f"variant:{ks.index(k)}", [c.estimate for c in sims], [(c.lo, c.hi) for c in sims])
        ys[f"K={k} cost model"] = ("ideal", model)
        rows += [[str(k), str(n), c.fmt(0), f"{m:,.0f}", f"{c.estimate / m - 1:+.1%}"]
                 for n, c, m in zip(ns, sims, model, strict=True)]
    said = grid[(1, top)].runs[0].summary["time_model"]["said"]
    text = (f"Every figure here is {said}.\n\n" +
            table(["K", "N", "SIMULATED samples/s [95% CI]", "cost model samples/s", "sim / model - 1"], rows))
    f1 = ctx.out / "throughput_vs_workers.png"
    plots.lines(sorted({n for _, n in grid}), ys, "workers N", "samples/s (SIMULATED)", f1,
                f"{ctx.exp.id} SIMULATED: sync PS throughput against N", logx=True, ymin0=True) \
        if all(len(v[1]) == len({n for _, n in grid}) for v in ys.values()) else None
    headline = f"{said}: " + "; ".join(f"{p.label} {p.ci.fmt(2)}x ({p.outcome})" for p in parts)
    key = {"stall": stall.estimate, "stall_ci": [stall.lo, stall.hi], "relief": relief.estimate,
           "relief_ci": [relief.lo, relief.hi], "largest_n": top, "shards": ks, "simulated": True, "time_model": said}
    figures = [Figure(f1, ctx.caption("SIMULATED samples/s against workers, each shard count beside the cost "
                                      "model's prediction (dotted)."))] if f1.exists() else []
    return Finding(verdict, headline, text, figures, key)


def said_of(groups) -> str:
    """The time model's one line (SIMULATED ...) of the arms, or each distinct one; ValueError for a real run."""
    lines = []
    for g in groups:
        for r in g.runs:
            if not r.summary.get("simulated"):
                raise ValueError(f"{g.label!r} is not a simulated run (simulate = true)")
            lines.append(r.summary["time_model"]["said"])
    return "; ".join(dict.fromkeys(lines))


def sim_time_to_accuracy(ctx: Context) -> Finding:
    target = float(ctx.params.get("target_accuracy", 0.6))
    arms = tta.arms_of(ctx)
    said = said_of(arms.values())
    targets = T.targets_of(ctx.params)
    plateaus = {f"{m} ({c})": g.ci().estimate for (m, c), g in arms.items()}
    if not T.split_by_plateau(targets, plateaus)[0]:  # every target at or above some arm's plateau: no speed to read
        lowest = min(plateaus, key=plateaus.get)
        reason = (f"SIMULATED: every target ({', '.join(f'{t:.0%}' for t in targets)}) is at or above the plateau of "
                  f"{lowest} ({plateaus[lowest]:.3f}): time to it would measure the plateau, not the speed")
        return Finding(V.Verdict(V.INCONCLUSIVE, reason), f"{said}: {reason}", f"Every time here is {said}.\n\n"
                       f"{reason}.", _tta_figures(ctx, arms, target, {}, targets, "N=" + str(arms_n(arms))),
                       {"simulated": True, "time_model": said, "targets_dropped": list(targets)})
    verdict, key = tta.measure(arms, targets)
    headline, text = tta.write(arms, target, verdict)
    figures = _tta_figures(ctx, arms, target, key, targets, f"N={arms_n(arms)}")
    key.update(simulated=True, time_model=said)
    return Finding(verdict, f"{said}: {headline}", f"Every time here is {said}.\n\n{text}", figures, key)


def sim_backup_tail(ctx: Context) -> Finding:
    """Chen et al. 2016 at tens of workers, SIMULATED: E19's arms, rule and table on simulated runs."""
    target = float(ctx.params.get("target_accuracy", 0.58))
    arms = bt.arms_of(ctx)
    said = said_of([arms.sync, *arms.backups.values(), arms.asynchronous])
    verdict, key = bt.measure(arms, target)
    headline, text = bt.write(arms, target, verdict, cores=f"Every time here is {said}: the extra workers are "
                              "virtual machines of their own, each step's delay drawn from the configured law.")
    figures = bt.draw(ctx, arms, target, f"SIMULATED (N={arms.n})")
    key.update(simulated=True, time_model=said)
    return Finding(verdict, f"{said}: {headline}", text, figures, key)


def sim_staleness_aware(ctx: Context) -> Finding:
    """Zhang et al. 2016 at their scale, SIMULATED: E21's arms and rule on simulated runs."""
    return sa.staleness_aware(ctx, said_of(ctx.groups.values()))


def arms_n(arms: dict) -> str:
    return "/".join(map(str, sorted({int(g.cfg["workers"]) for g in arms.values()})))


def _tta_figures(ctx: Context, arms: dict, target: float, key: dict, targets, workers: str) -> list[Figure]:
    checks = [label for label in dict.fromkeys(k.rsplit(" at ", 1)[0] for k in key if " at " in k)]
    xs = sorted({float(t) for t in (targets if isinstance(targets, (list, tuple)) else [targets])})
    ys = {}
    for i, label in enumerate(checks):
        got = [key.get(f"{label} at {t:.0%}") for t in xs]
        ys[label] = (f"variant:{i}", [g["ratio"] if g else float("nan") for g in got],
                     [tuple(g["ci"]) if g else (float("nan"), float("nan")) for g in got])
    ys["no difference"] = ("ideal", [1.0] * len(xs))
    f1 = ctx.out / "ratio_vs_target.png"
    plots.lines(xs, ys, "target test accuracy", "seconds to target, ratio", f1,
                f"{ctx.exp.id} SIMULATED ({workers}): each check's time ratio over the targets")
    shown = [arms[k] for k in sorted(arms, key=lambda k: (tta.CONDITIONS.index(k[1]), k[0]))]
    f2 = ctx.out / "accuracy_vs_elapsed_s.png"
    plots.curves(series_of(shown, [f"{g.mode}, {tta.condition(g)}" for g in shown]), "elapsed_s", "test_accuracy", f2,
                 f"{ctx.exp.id} SIMULATED ({workers}): accuracy against virtual time",
                 refs=[(target, f"target {target:.0%}")])
    reached = {f"{m}, {c}": [t for t in seconds_to(g, target) if math.isfinite(t)] for (m, c), g in arms.items()}
    rows = [[name, stats.mean_ci(v).fmt(3) if len(v) >= 2 else "-", str(len(v))] for name, v in reached.items()]
    (ctx.out / "seconds_to_target.md").write_text(table(["arm", f"SIMULATED s to {target:.0%}", "seeds reached"],
                                                        rows) + "\n")
    return [Figure(f1, "SIMULATED: each check's ratio of seconds to the target (slower arm over faster), paired by "
                       "seed, at every target of the range; dotted: no difference. Error bars: 95% t interval."),
            Figure(f2, ctx.caption("SIMULATED: test accuracy against virtual time; dotted: the target."))]


ANALYSES = {"sim_bottleneck": sim_bottleneck, "sim_time_to_accuracy": sim_time_to_accuracy,
            "sim_backup_tail": sim_backup_tail, "sim_staleness_aware": sim_staleness_aware}
