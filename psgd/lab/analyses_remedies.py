"""Analyses of the remedies: what the field does about each problem the suite shows, measured
beside that problem on the same model, data and seeds (backup workers against stragglers,
staleness-aware rates and DC-ASGD against stale gradients, sparsified pushes against the
central server's link). Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here.

E12 (`staleness_remedies`, remedies for stale gradients) is analysed in
psgd/lab/analyses_staleness_remedies.py; it is registered here, in this module's ANALYSES (the
remedies' table), and its names are re-exported from here.

E13 (`topk`): sparsified pushes per arm (label) against dense at equal samples: with error feedback
(plain, or with Deep Gradient Compression's momentum correction and warm-up) within the margin of
dense, without it below; which arms were still rising at the end.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np

from psgd.lab import plots, stats
from psgd.lab import verdicts_remedies as VR
from psgd.lab.analyses_staleness_remedies import (  # noqa: F401  (re-exported: E12's names, read from here)
    CONTROL,
    LEVEL,
    MOMENTUM0,
    PLAIN,
    SA,
    SYNC,
    Cell,
    _bytes,
    _cells,
    _is_dc,
    _map_text,
    _notes,
    _num,
    _primary,
    _remedy,
    _verdict,
    arm,
    staleness_remedies,
)
from psgd.lab.analysis_kit import Context, acc_ci, diff, series_of, variant_series
from psgd.lab.results import LAST_K, PLATEAU, Figure, Group, table, time_to

CONDITIONS = ("no straggler", "persistent straggler", "random jitter")
MIB = 2**20


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
    by: dict[tuple[str, str], Group] = {(_arm(g.cfg), _condition(g.cfg)): g for g in ctx.groups.values()}
    arms = sorted({a for a, _ in by}, key=lambda a: (a.split()[0] != "sync", a))
    conditions = [c for c in CONDITIONS if any(c == k for _, k in by)]
    target = float(ctx.params.get("target_accuracy", 0.5))
    tput = {k: applied_samples_per_s(g) for k, g in by.items()}
    body = _backup_table(by, arms, conditions, tput, target)
    figs = _backup_figures(ctx, by, arms, conditions, tput, target)

    hurt = by[("sync", "persistent straggler")]
    backups = sorted(a for a in arms if a.startswith("sync b=") and (a, "persistent straggler") in by)
    base_t, hurt_t = tput[("sync", "no straggler")], tput[("sync", "persistent straggler")]
    loss = stats.Interval(*(1.0 - x for x in _ratio(hurt_t, base_t)), n=min(len(base_t), len(hurt_t)))
    b1 = backups[0]
    cost = diff(by[(b1, "persistent straggler")], hurt)
    key, lines, counted, avoided = {}, [], [], {}
    for b in backups:
        line, per_update_share = _backup_reading(b, by, tput, avoided, key)
        lines.append(line)
        counted.append(per_update_share)
    # The verdict's share: the avoided one where b=1 ran without the straggler too (its fair
    # baseline), else the recovered one.
    verdict = (VR.backup_recovers(loss, avoided[b1], cost, measure="avoided") if b1 in avoided else
               VR.backup_recovers(loss, stats.recovered_ci(base_t, hurt_t, tput[(b1, "persistent straggler")]), cost))
    per_update = float(np.mean([x.summary["bytes_pushed"] / x.summary["global_updates"] for x in hurt.runs]))
    headline = (f"one worker {_delay(ctx)} ms slower per step costs sync {100 * loss.estimate:.0f}% of its throughput; "
                + "; ".join(lines) + f"; sync pushes {per_update / 1e3:.0f} kB per update; no memory beyond sync's own")
    body += ("\n\nApplied samples/s: training samples per second that went into updates (a dropped gradient's "
             "samples do not count). Recovered share = (backup's - sync's with the straggler) / (sync's without - "
             "with), t interval over seeds; avoided share = 1 - (backup's without - with the straggler) / "
             "(sync's without - with), paired by seed: the part of sync's loss the backup arm does not suffer, "
             "measured from its own footing (it is faster than sync without a straggler too, so the recovered "
             "share can pass 100%); counted in updates/s instead, whatever their size, the "
             f"share recovered is {', '.join(counted)}. Accuracy points: backup minus sync, both with the straggler. "
             "Memory: a shard holds a step's first N-b gradients until it sums them in worker order, as sync does, "
             "and N integers of bookkeeping; bytes: every dropped gradient was pushed in full. "
             "Rates: the tuning table above; a straggler or jitter run takes the rate of its arm without one (as in "
             "E2), and the runs without a straggler are E2's (in the same CPU quota).")
    key["straggler_loss"] = loss.estimate
    return verdict, headline, body, figs, key


def _backup_table(by: dict[tuple[str, str], Group], arms: list[str], conditions: list[str],
                  tput: dict[tuple[str, str], list[float]], target: float) -> str:
    """E11's table: per condition and arm, applied throughput, updates/s, drops, time to target, accuracy."""
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
    return table(["run", "condition", "lr", "applied samples/s [95% CI]", "updates/s", "gradients dropped",
                  f"s to {target:.0%} test acc", "test accuracy [95% CI]"], rows)


def _backup_figures(ctx: Context, by: dict[tuple[str, str], Group], arms: list[str], conditions: list[str],
                    tput: dict[tuple[str, str], list[float]], target: float) -> list[Figure]:
    """E11's figures: applied throughput per arm and condition, and accuracy at equal wall time."""
    exp, out = ctx.exp, ctx.out
    f1 = out / "throughput.png"
    cis = {k: stats.mean_ci(v) for k, v in tput.items()}
    nan = float("nan")  # a condition an arm never ran: no bar (not a bar at zero)
    plots.bars(conditions, {a: (_style(a, arms), [cis[(a, c)].estimate if (a, c) in cis else nan for c in conditions],
                                [(cis[(a, c)].lo, cis[(a, c)].hi) if (a, c) in cis else (nan, nan)
                                 for c in conditions]) for a in arms},
               "applied samples/s (steady state)", f1, f"{exp.id}: throughput with a slow worker")
    shown = [g for c in conditions for a in arms if (a, c) in by and c != "random jitter" for g in [by[(a, c)]]]
    f2 = out / "accuracy_vs_elapsed_s.png"
    plots.curves(series_of(shown, [f"{_arm(g.cfg)}, {_condition(g.cfg)}" for g in shown]), "elapsed_s",
                 "test_accuracy", f2, f"{exp.id}: accuracy at equal wall time", refs=[(target, f"target {target:.0%}")])
    return [Figure(f1, "Steady-state applied samples/s per arm; error bars: 95% t interval over seeds."),
            Figure(f2, ctx.caption("Test accuracy against steady-state wall time; dotted: the target."))]


def _backup_reading(b: str, by: dict[tuple[str, str], Group], tput: dict[tuple[str, str], list[float]],
                    avoided: dict[str, stats.Interval], key: dict) -> tuple[str, str]:
    """One backup arm against sync with the straggler: its headline clause and its share recovered in
    updates/s; fills avoided[b] (where it ran without the straggler too) and key[b]."""
    hurt = by[("sync", "persistent straggler")]
    base_t, hurt_t = tput[("sync", "no straggler")], tput[("sync", "persistent straggler")]
    g = by[(b, "persistent straggler")]
    r = stats.recovered_ci(base_t, hurt_t, tput[(b, "persistent straggler")])
    d = diff(g, hurt)
    share = float(np.mean([_dropped_share(x.summary) for x in g.runs]))
    wasted = float(np.mean([x.summary["bytes_pushed"] * _dropped_share(x.summary) / x.summary["global_updates"]
                            for x in g.runs]))
    own = ""
    if (b, "no straggler") in tput:
        # Against its own run without the straggler: a backup arm is faster than sync even
        # without one (it never waits for the slowest of N), so "recovered" can pass 100%.
        own_t = tput[(b, "no straggler")]
        avoided[b] = stats.avoided_ci(base_t, hurt_t, own_t, tput[(b, "persistent straggler")])
        # Not a loss for certain: the straggler's late pushes are fewer, so a shard that drops
        # them can end up with less work than with four punctual workers.
        own_ratio = _ratio(tput[(b, "persistent straggler")], own_t)[0]
        own = (f" (with the straggler {b} runs at {own_ratio:.2f}x its own throughput without one, so it avoids "
               f"{_scaled(avoided[b]).fmt(0)}% of sync's loss)")
        key.setdefault(b, {})["avoided"] = avoided[b].estimate
    line = (f"{b} recovers {_scaled(r).fmt(0)}% of the straggler's throughput loss{own} at "
            f"{_scaled(d).fmt(1, signed=True)} accuracy points, dropping {100 * share:.0f}% of the gradients "
            f"pushed ({wasted / 1e3:.0f} kB per update pushed for nothing)")
    per_s = stats.recovered_ci(by[("sync", "no straggler")].values("updates_per_s"), hurt.values("updates_per_s"),
                               g.values("updates_per_s"))
    key[b] = {**key.get(b, {}), "recovered": r.estimate, "recovered_ci": [r.lo, r.hi],
              "accuracy_points": 100 * d.estimate,
              "accuracy_points_ci": [100 * d.lo, 100 * d.hi], "dropped_share": share,
              "wasted_bytes_per_update": wasted}
    return line, f"{b}: {_scaled(per_s).fmt(0)}%"


def _style(name: str, arms: list[str]) -> str:
    """A mode's colour for sync, async and SSP; a variant colour for each sync with backup workers."""
    return f"variant:{arms.index(name)}" if " b=" in name else name.split()[0]


def _scaled(ci: stats.Interval, by: float = 100.0) -> stats.Interval:
    """The interval in percent (or points): 0.7 -> 70."""
    return stats.Interval(by * ci.estimate, by * ci.lo, by * ci.hi, ci.n)


def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) / mean(b) as (estimate, hi, lo): flipped so that 1 - x keeps lo below hi."""
    ci = stats.ratio_ci(a, b)
    return ci.estimate, ci.hi, ci.lo


def _delay(ctx: Context) -> int:
    return max((ms for g in ctx.groups.values() for _, ms in g.cfg.get("straggler", [])), default=0)


# -- E13 -----------------------------------------------------------------------------------------
def _fraction(g: Group) -> str:
    return "dense" if g.cfg["topk"] >= 1 else f"top {g.cfg['topk'] * 100:g}%"


def _feedback(g: Group) -> str:
    """What a sparse arm does with what it did not send (and whether it runs DGC's two fixes)."""
    cfg = g.cfg
    if cfg["topk"] >= 1:
        return "-"
    if cfg["no_error_feedback"]:
        return "no"
    fixes = [name for name, on in (("momentum correction", cfg.get("topk_momentum_correction")),
                                   (f"warm-up {cfg.get('topk_warmup_epochs', 0):g} epochs",
                                    cfg.get("topk_warmup_epochs", 0) > 0)) if on]
    return "yes" + (" + " + " + ".join(fixes) if fixes else "")


def _trend(g: Group) -> float:
    """Mean over seeds of the accuracy's change over the last evaluations (the last LAST_K's mean
    minus the LAST_K before: what `converged` compares; validation accuracy where there is one)."""
    out = []
    for r in g.runs:
        key = "val_accuracy" if r.evals and r.evals[-1].get("val_accuracy") is not None else "test_accuracy"
        acc = [e[key] for e in r.evals]
        if len(acc) >= 2 * LAST_K:
            out.append(float(np.mean(acc[-LAST_K:]) - np.mean(acc[-2 * LAST_K:-LAST_K])))
    return float(np.mean(out)) if out else float("nan")


def _step_ms(g: Group) -> list[float]:
    """Milliseconds per worker step of each seed: steady-state wall time / steps per worker."""
    return [1e3 * r.summary["wall_time_s"] * r.summary["workers"] / max(1, r.summary["worker_steps"]) for r in g.runs]


def _rising(g: Group) -> bool:
    """Still rising at the end: on average over seeds, by at least what `converged` calls a plateau."""
    return _trend(g) >= PLATEAU


def topk(ctx: Context):
    margin = float(ctx.params.get("margin", 0.02))
    learning = [g for g in ctx.groups.values() if not g.cfg.get("link")]
    dense = next(g for g in learning if g.cfg["topk"] >= 1)
    sparse = sorted((g for g in learning if g.cfg["topk"] < 1),
                    key=lambda g: (-g.cfg["topk"], g.cfg["no_error_feedback"], g.label))
    with_ef = {g.label: g for g in sparse if not g.cfg["no_error_feedback"]}
    without = {g.label: g for g in sparse if g.cfg["no_error_feedback"]}
    order = [dense, *sparse]
    figs = _topk_figures(ctx, dense, sparse, order, margin)
    body = _topk_table(order, dense)

    ef_d = {f: diff(g, dense) for f, g in with_ef.items()}
    no_d = {f: diff(dense, g) for f, g in without.items()}
    verdict = VR.error_feedback_keeps_accuracy(ef_d, no_d, margin)
    params = dense.runs[0].summary["params"]
    pushed = {f: g.mean("bytes_pushed") / dense.mean("bytes_pushed") for f, g in with_ef.items()}
    rising = [g.label for g in order if _rising(g)]
    headline = ("at equal samples, accuracy minus dense: with error feedback "
                + ", ".join(f"{f} {d.fmt(signed=True)}" for f, d in ef_d.items()) + "; without "
                + ", ".join(f"{f} {diff(g, dense).fmt(signed=True)}" for f, g in without.items())
                + " (dense " + acc_ci(dense).fmt() + "); pushed bytes "
                + ", ".join(f"{f} {r:.3f}x" for f, r in pushed.items())
                + f" of dense (measured), for a residual of {4 * params / 1024:.0f} KiB per worker"
                + (f"; still rising at the end: {', '.join(rising)}" if rising else "; every arm at a plateau"))
    key = {"ef_minus_dense": {f: d.estimate for f, d in ef_d.items()},
           "no_feedback_minus_dense": {f: -d.estimate for f, d in no_d.items()},
           "bytes_vs_dense": pushed, "still_rising": rising,
           "residual_bytes_per_worker": 4 * params}

    linked = [g for g in ctx.groups.values() if g.cfg.get("link")]
    if linked:
        text, fig, speedup = _link_timing(ctx, linked)
        body += "\n\n" + text
        figs.append(fig)
        if speedup is not None:
            key["step_speedup_on_link"] = speedup.estimate
            headline += f"; on an EMULATED {linked[0].cfg['link']} link a step takes {speedup.fmt(2)}x less time"
    body += _topk_accounting(params)
    return verdict, headline, body, figs, key


def _topk_figures(ctx: Context, dense: Group, sparse: list[Group], order: list[Group], margin: float) -> list[Figure]:
    """E13's figures: accuracy at equal samples, and each sparse arm minus dense beside the bytes it pushed."""
    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series(order), "samples", "test_accuracy", f1, f"{ctx.exp.id}: accuracy at equal samples")
    # Each sparse arm minus dense, paired (categories: bars, not lines), named with the bytes it pushed.
    cis = [diff(g, dense) for g in sparse]
    f2 = ctx.out / "accuracy_vs_bytes.png"
    plots.bars([f"{textwrap.fill(g.label, 14)}\n{g.mean('bytes_pushed') / dense.mean('bytes_pushed'):.3f}x bytes"
                for g in sparse],
               {"minus dense": ("variant:2", [c.estimate for c in cis], [(c.lo, c.hi) for c in cis])},
               "final test accuracy minus dense's", f2,
               f"{ctx.exp.id}: accuracy and bytes pushed against dense ({acc_ci(dense).fmt()})",
               refs=[(0.0, "dense"), (-margin, f"-margin {margin:g}")])
    return [Figure(f1, ctx.caption("Test accuracy against training samples, each run at its rate (tuning table).")),
            Figure(f2, "Each sparse arm's mean final test accuracy minus dense's, seed by seed; error bars 95% t "
                       "intervals; under each, the bytes its workers pushed in all, as a multiple of dense's "
                       "(measured, summary.json; warm-up sends more in its first epochs). Dotted: 0 and -margin.")]


def _topk_table(order: list[Group], dense: Group) -> str:
    """E13's table: per arm what it sends, its feedback, momentum, bytes, accuracy and last change."""
    rows = []
    for g in order:
        d = diff(g, dense)
        server_mom = 0.0 if g.cfg.get("topk_momentum_correction") else g.cfg["optim"]["momentum"]
        share = g.mean("bytes_pushed") / dense.mean("bytes_pushed")
        rows.append([g.label, _fraction(g), _feedback(g), f"{server_mom:g}", f"{g.lr:g}",
                     f"{g.mean('bytes_pushed') / MIB:.2f}", f"{share:.3f}x",
                     acc_ci(g).fmt(), "" if g is dense else d.fmt(signed=True), g.converged(),
                     _num(_trend(g), 3, signed=True) + (" (rising)" if _rising(g) else "")])
    return table(["run", "sent", "error feedback", "server momentum", "lr", "MiB pushed", "vs dense",
                  "test accuracy [95% CI]", "minus dense (paired)", "converged", "last change"], rows)


def _topk_accounting(params: int) -> str:
    """E13's closing paragraph: the bytes and memory by construction, and what 'last change' means."""
    return ("\n\nAccounting, not a finding: a sparse push of a fraction f of an n-element slice sends round(f n) "
            "entries of an int32 index and a value each, so 8 bytes per entry in fp32 (tests/test_sparsify.py checks "
            "the bytes and that fraction 1 equals dense pushes bit for bit); with error feedback each worker keeps a "
            f"residual of one fp32 per parameter ({4 * params:,} bytes here), and with momentum correction a "
            "velocity of the same size. Pulls stay dense: the parameters are not sparse, so the bytes a worker "
            "receives do not change. What is measured is whether accuracy at equal samples survives sending only "
            "the largest entries, with the rest carried over (error feedback: Stich et al. 2018; Lin et al. 2018) or "
            "dropped. Momentum: without momentum correction it is the server's, applied to the sum of the sparse "
            "gradients; with it (Deep Gradient Compression) each worker's velocity is what is accumulated and "
            "sent, and the server steps without momentum (the 'server momentum' column). Warm-up: in epoch e of "
            "its first E the fraction sent is max(f, 0.25^(e+1)), so its bytes include those epochs. DGC's local "
            "gradient clipping is not done (nothing clips here). 'last change': the mean accuracy of the last "
            f"{LAST_K} evaluations minus the {LAST_K} before (validation accuracy where there is one), averaged over "
            f"seeds; 'rising' where it is at least {PLATEAU} (what 'converged' calls a plateau). A run still rising "
            "at the end may still close its gap: the claim is judged at equal samples.")


def _link_timing(ctx: Context, linked: list[Group]) -> tuple[str, Figure, stats.Interval | None]:
    """Time per step of the link runs: the table, the stacked figure, and dense / sparse step time."""
    linked = sorted(linked, key=lambda g: -g.cfg["topk"])
    parts = {k: [] for k in ("compute", "push", "pull", "wait")}
    rows, marks = [], []
    dense = next((g for g in linked if g.cfg["topk"] >= 1), None)
    for g in linked:
        steps = g.mean("worker_steps") / g.cfg["workers"]
        for k in parts:
            parts[k].append(1e3 * g.mean(f"time_breakdown_s.{k}") / max(1.0, steps))
        ms = stats.mean_ci(_step_ms(g))
        marks.append(ms.estimate)
        vs = "" if dense is None or g is dense else stats.ratio_ci(_step_ms(dense), _step_ms(g)).fmt(2) + "x"
        rows.append([g.label, g.cfg["link"], f"{g.mean('bytes_pushed') / g.mean('worker_steps') / 1024:.1f}",
                     f"{g.mean('bytes_pulled') / g.mean('worker_steps') / 1024:.1f}", ms.fmt(1),
                     *(f"{parts[k][-1]:.1f}" for k in parts), vs])
    f = ctx.out / "step_time_on_link.png"
    plots.stacked([g.label for g in linked], parts, "ms per worker step", f,
                  f"{ctx.exp.id}: a step on an EMULATED {linked[0].cfg['link']} link", marks=("time per step", marks))
    text = table(["run", "link (EMULATED)", "KiB pushed / step", "KiB pulled / step", "ms per step [95% CI]",
                  "compute ms", "push ms", "pull ms", "wait ms", "dense / this"], rows)
    text += ("\n\nThe link is EMULATED: psgd/core/link.py paces every worker's and the shard's sends and receives on "
             "loopback; the shard's one NIC carries all workers' pushes in and pulls out. Time per step = steady-state "
             "wall time / steps per worker; 'dense / this' is how many times faster a step is (t interval over seeds).")
    speedup = None
    sparse = [g for g in linked if g.cfg["topk"] < 1]
    if dense is not None and sparse:
        speedup = stats.ratio_ci(_step_ms(dense), _step_ms(sparse[-1]))
    fig = Figure(f, "Milliseconds per worker step on the emulated link, split into compute, push, pull and wait "
                    "(means over seeds); dashed: the whole step.")
    return text, fig, speedup




ANALYSES: dict = {"backup_workers": backup_workers, "staleness_remedies": staleness_remedies, "topk": topk}
