"""Analyses of the remedies: what the field does about each problem the suite shows, measured
beside that problem on the same model, data and seeds (backup workers against stragglers,
staleness-aware rates and DC-ASGD against stale gradients, sparsified pushes against the
central server's link). Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here.
"""

from __future__ import annotations

import math

import numpy as np

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, acc_ci, diff, series_of
from psgd.lab.results import Figure, Group, table, time_to

CONDITIONS = ("no straggler", "persistent straggler", "random jitter")


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
                + "; ".join(lines) + f"; sync pushes {per_update / 1e3:.0f} kB per update; no extra memory")
    body += ("\n\nApplied samples/s: training samples per second that went into updates (a dropped gradient's "
             "samples do not count). Recovered share = (backup's - sync's with the straggler) / (sync's without - "
             f"with), bootstrap over seeds of each group; counted in updates/s instead, whatever their size, the "
             f"share recovered is {', '.join(counted)}. Accuracy points: backup minus sync, both with the straggler. "
             "Memory: backup workers add no buffer (a shard sums the first N-b gradients into sync's own sum "
             "buffer) and N integers of bookkeeping per shard; bytes: every dropped gradient was pushed in full. "
             "Rates: the tuning table above; a straggler or jitter run takes the rate of its arm without one (as in "
             "E2), and the runs without a straggler are E1's.")
    figs = [Figure(f1, "Steady-state applied samples/s per arm; error bars: 95% bootstrap interval over seeds."),
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


ANALYSES: dict = {"backup_workers": backup_workers}
