"""Per-claim analyses: the figures, the numbers and the verdict of each experiment.

Contract: `analyse(exp, summaries, out)` dispatches on `exp.analysis` to one function here (the
learning claims, E1-E3 and E6-E9) or in psgd/analyses_systems.py (the systems claims: E4, E5, E10);
it draws the figures into `out` (PNG + CSV each, psgd/plots.py), and returns a `Section` with a
verdict — confirmed, refuted or depends — computed from the measured numbers by a rule stated
in the section text, never written by hand. Runs of the same label (several seeds) are averaged;
their spread (max - min) is the noise floor a difference must clear.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from psgd import analyses_systems, plots
from psgd.results import Group, Section, diverged, groups_of, roughness, table, time_to


def analyse(exp, summaries: list, out: Path) -> Section:
    fn = ANALYSES.get(exp.analysis)
    if fn is None:
        raise ValueError(f"{exp.path}: unknown analysis {exp.analysis!r}; known: {', '.join(sorted(ANALYSES))}")
    verdict, headline, body, figures = fn(exp, summaries, out)
    return Section(exp.id, exp.title, exp.claim, exp.quote, verdict, headline, body, figures)


# -- E1 ------------------------------------------------------------------------------------------
def modes(exp, summaries, out):
    gs = groups_of(summaries)
    series = [plots.Series(g.label, g.mode, g.runs) for g in gs.values()]
    figs = []
    for x in ("elapsed_s", "version", "samples"):
        path = out / f"accuracy_vs_{x}.png"
        plots.curves(series, x, "test_accuracy", path, f"{exp.id}: test accuracy")
        figs.append(path)
    path = out / "loss_vs_samples.png"
    plots.curves(series, "samples", "test_loss", path, f"{exp.id}: test loss", logy=True)
    figs.append(path)
    rows = [[g.label, g.fmt("final_test_accuracy"), g.fmt("final_test_loss"), f"{g.mean('samples_per_s'):.0f}",
             f"{g.mean('updates_per_s'):.1f}", f"{g.mean('staleness.mean'):.2f}",
             f"{np.mean([roughness(r) for r in g.runs]):.4f}"] for g in gs.values()]
    body = table(["run", "final test acc", "final test loss", "samples/s", "updates/s", "mean staleness",
                  "loss roughness"], rows)
    sync, asyn = gs.get("sync"), gs.get("async")
    if not sync or not asyn:
        return "depends", "needs runs labelled sync and async", body, figs
    gap = sync.mean("final_test_accuracy") - asyn.mean("final_test_accuracy")
    noise = max(sync.spread("final_test_accuracy"), asyn.spread("final_test_accuracy"), 0.01)
    rough_s = np.mean([roughness(r) for r in sync.runs])
    rough_a = np.mean([roughness(r) for r in asyn.runs])
    if gap > noise and rough_a > rough_s:
        verdict = "confirmed"
    elif gap < -noise and rough_a <= rough_s:
        verdict = "refuted"
    else:
        verdict = "depends"
    headline = (f"at equal samples sync reaches {sync.mean('final_test_accuracy'):.3f} test accuracy vs async "
                f"{asyn.mean('final_test_accuracy'):.3f} (mean staleness {asyn.mean('staleness.mean'):.1f}); "
                f"async's loss curve is {rough_a / rough_s:.2f}x as rough; async processes "
                f"{asyn.mean('samples_per_s') / sync.mean('samples_per_s'):.2f}x the samples/s")
    body += (f"\n\nRule: confirmed when sync's final accuracy beats async's by more than the seed spread "
             f"(here {noise:.3f}) and async's loss curve is rougher; refuted when async is better by that much and "
             f"no rougher; depends otherwise. Loss roughness = mean |change of test loss| between evaluations after "
             f"the first third. At one learning rate async applies N updates where sync applies one mean update, "
             f"so async can be ahead at equal samples and still be the less stable one (see E3 for higher rates).")
    return verdict, headline, body, figs


# -- E2 ------------------------------------------------------------------------------------------
def _condition(cfg: dict) -> str:
    if cfg.get("straggler"):
        return "persistent straggler"
    if cfg.get("jitter"):
        return "random jitter"
    return "no straggler"


def stragglers(exp, summaries, out):
    gs = groups_of(summaries)
    target = float(exp.params.get("target_accuracy", 0.5))
    conditions = sorted({_condition(g.cfg) for g in gs.values()}, key=["no straggler", "persistent straggler",
                                                                       "random jitter"].index)
    by_mode: dict[str, dict[str, Group]] = defaultdict(dict)
    for g in gs.values():
        by_mode[g.mode][_condition(g.cfg)] = g
    bars_tp, bars_tt, rows = {}, {}, []
    for mode, conds in by_mode.items():
        tp = [conds[c].mean("samples_per_s") if c in conds else 0.0 for c in conditions]
        tt = [float(np.mean([time_to(r, target) for r in conds[c].runs])) if c in conds else float("nan")
              for c in conditions]
        bars_tp[mode] = (mode, tp, None)
        bars_tt[mode] = (mode, [t if math.isfinite(t) else 0.0 for t in tt], None)
        for c, a, b in zip(conditions, tp, tt, strict=True):
            if c in conds:
                rows.append([mode, c, f"{a:.0f}", f"{b:.1f}" if math.isfinite(b) else "not reached",
                             conds[c].fmt("final_test_accuracy")])
    f1, f2 = out / "throughput.png", out / "time_to_target.png"
    plots.bars(conditions, bars_tp, "samples/s", f1, f"{exp.id}: throughput")
    plots.bars(conditions, bars_tt, f"seconds to {target:.0%} test accuracy", f2,
               f"{exp.id}: time to target (0 = not reached)")
    body = table(["mode", "condition", "samples/s", f"s to {target:.0%} acc", "final test acc"], rows)

    def slowdown(mode: str) -> float:
        c = by_mode.get(mode, {})
        if "no straggler" not in c or "persistent straggler" not in c:
            return float("nan")
        return c["no straggler"].mean("samples_per_s") / c["persistent straggler"].mean("samples_per_s")

    s_sync, s_async = slowdown("sync"), slowdown("async")
    verdict = "confirmed" if s_sync > 1.5 * s_async else "refuted" if s_sync <= s_async else "depends"
    headline = (f"one slow worker cuts sync throughput {s_sync:.2f}x but async only {s_async:.2f}x"
                + (f", SSP {slowdown('ssp'):.2f}x" if "ssp" in by_mode else ""))
    body += ("\n\nRule: confirmed when the persistent straggler slows sync by more than 1.5x what it does to async "
             "(sync must wait for the slowest worker every step; async does not).")
    return verdict, headline, body, [f1, f2]


# -- E3 ------------------------------------------------------------------------------------------
def staleness(exp, summaries, out):
    gs = groups_of(summaries)
    asyn = [g for g in gs.values() if g.mode == "async"]
    base_lr = min(g.cfg["optim"]["lr"] for g in asyn)
    hists = {f"async N={g.cfg['workers']}": ("async", g.runs[0].summary["staleness"]["hist"])
             for g in sorted(asyn, key=lambda g: g.cfg["workers"]) if g.cfg["optim"]["lr"] == base_lr}
    f1 = out / "staleness_hist.png"
    plots.histograms(hists, f1, f"{exp.id}: staleness of applied gradients (lr {base_lr})")
    lrs = sorted({g.cfg["optim"]["lr"] for g in gs.values()})
    ys, rows = {}, []
    for g in sorted(gs.values(), key=lambda g: (g.mode, g.cfg["workers"], g.cfg["optim"]["lr"])):
        name = f"{g.mode} N={g.cfg['workers']}"
        loss = g.mean("final_test_loss")
        ys.setdefault(name, (g.mode, [float("nan")] * len(lrs)))[1][lrs.index(g.cfg["optim"]["lr"])] = \
            loss if math.isfinite(loss) else float("nan")
        rows.append([g.mode, g.cfg["workers"], g.cfg["optim"]["lr"], f"{g.mean('staleness.mean'):.2f}",
                     g.fmt("final_test_accuracy"), f"{loss:.3f}", "yes" if any(diverged(r) for r in g.runs) else "no",
                     f"{np.mean([roughness(r) for r in g.runs]):.4f}"])
    f2 = out / "final_loss_vs_lr.png"
    plots.lines(lrs, ys, "learning rate", "final test loss (start: ln 10 = 2.30)", f2, f"{exp.id}: loss vs LR",
                logx=True, logy=True)
    body = table(["mode", "N", "lr", "mean staleness", "final test acc", "final test loss", "diverged",
                  "loss roughness"], rows)
    unstable_async = [(g.cfg["workers"], g.cfg["optim"]["lr"]) for g in asyn if any(diverged(r) for r in g.runs)]
    sync_ok_lrs = {g.cfg["optim"]["lr"] for g in gs.values()
                   if g.mode == "sync" and not any(diverged(r) for r in g.runs)}
    shown = [(n, lr) for n, lr in unstable_async if lr in sync_ok_lrs]
    stale = {g.cfg["workers"]: g.mean("staleness.mean") for g in asyn if g.cfg["optim"]["lr"] == base_lr}
    verdict = "confirmed" if shown else "depends"
    headline = (f"mean staleness {', '.join(f'{v:.1f} at N={n}' for n, v in sorted(stale.items()))}; "
                + (f"async diverges at (N, lr) = {', '.join(map(str, sorted(shown)))} where sync converges"
                   if shown else "no async run diverged where sync converged at these learning rates"))
    body += ("\n\nRule: confirmed when some async run diverges (final test loss above the initial one, or not finite) "
             "at a learning rate where the sync control converges. Staleness grows with N: about N-1 updates. "
             "Note that at one lr async takes N steps of that size where sync takes one step with the mean.")
    return verdict, headline, body, [f1, f2]


# -- E6 ------------------------------------------------------------------------------------------
def batch(exp, summaries, out):
    gs = groups_of(summaries)
    base_lr = float(exp.params.get("base_lr", min(g.cfg["optim"]["lr"] for g in gs.values())))
    curves_: dict[str, dict[int, Group]] = defaultdict(dict)
    for g in gs.values():
        scaled = g.cfg["optim"]["lr"] != base_lr or g.cfg["optim"]["warmup"] > 0
        curves_["linear LR scaling + warmup" if scaled else "fixed LR"][g.runs[0].summary["global_batch"]] = g
    batches = sorted({b for c in curves_.values() for b in c})
    for c in curves_.values():  # the smallest batch is the same run with and without the rule
        for b in batches:
            if b not in c and b == batches[0]:
                c[b] = next(cc[b] for cc in curves_.values() if b in cc)
    ys = {name: ("sync", [c[b].mean("final_test_accuracy") if b in c else float("nan") for b in batches])
          for name, c in curves_.items()}
    f1 = out / "accuracy_vs_global_batch.png"
    plots.lines(batches, ys, "global batch (samples)", "final test accuracy (equal epochs)", f1,
                f"{exp.id}: large batches", logx=True)
    rows = [[name, b, c[b].cfg["optim"]["lr"], c[b].cfg["optim"]["warmup"], c[b].mean("global_updates"),
             c[b].fmt("final_test_accuracy")] for name, c in curves_.items() for b in sorted(c)]
    body = table(["schedule", "global batch", "lr", "warmup updates", "updates", "final test acc"], rows)
    fixed, scaled = curves_.get("fixed LR", {}), curves_.get("linear LR scaling + warmup", {})
    small, big = batches[0], batches[-1]
    if small not in fixed or big not in fixed or big not in scaled:
        return "depends", "needs fixed-LR runs at the smallest and largest batch and a scaled run", body, [f1]
    drop = fixed[small].mean("final_test_accuracy") - fixed[big].mean("final_test_accuracy")
    recovered = scaled[big].mean("final_test_accuracy") - fixed[big].mean("final_test_accuracy")
    verdict = "confirmed" if drop > 0.05 and recovered > drop / 2 else "refuted" if drop <= 0.01 else "depends"
    headline = (f"at equal epochs, batch {big} with the batch-{small} LR loses {drop:.3f} accuracy; "
                f"the linear scaling rule + warmup wins back {recovered:.3f}")
    body += ("\n\nRule: confirmed when the largest batch at the small-batch learning rate loses more than 0.05 "
             "accuracy and the linear scaling rule (lr x batch/base batch, with warmup; Goyal et al. 2017) wins back "
             "at least half of it.")
    return verdict, headline, body, [f1]


# -- E7 ------------------------------------------------------------------------------------------
def noniid(exp, summaries, out):
    gs = groups_of(summaries)
    modes_ = sorted({g.mode for g in gs.values()})
    by = {(g.mode, g.cfg["data"]["shard_data"]): g for g in gs.values()}
    bars_ = {sd: ("sync" if sd == "iid" else "async", [by[(m, sd)].mean("final_test_accuracy") if (m, sd) in by
                                                        else 0.0 for m in modes_], None) for sd in ("iid", "noniid")}
    f1 = out / "accuracy_iid_vs_noniid.png"
    plots.bars(modes_, bars_, "final test accuracy", f1, f"{exp.id}: IID vs non-IID shards", xlabel="mode")
    series = [plots.Series(f"{g.mode} {g.cfg['data']['shard_data']}", g.mode, g.runs) for g in gs.values()]
    f2 = out / "accuracy_vs_samples.png"
    plots.curves(series, "samples", "test_accuracy", f2, f"{exp.id}: test accuracy")
    rows, drops = [], {}
    for m in modes_:
        if (m, "iid") in by and (m, "noniid") in by:
            a, b = by[(m, "iid")], by[(m, "noniid")]
            drops[m] = a.mean("final_test_accuracy") - b.mean("final_test_accuracy")
            rows.append([m, a.fmt("final_test_accuracy"), b.fmt("final_test_accuracy"), f"{drops[m]:.3f}",
                         f"{np.mean([roughness(r) for r in b.runs]):.4f}"])
    body = table(["mode", "IID acc", "non-IID acc", "drop", "non-IID loss roughness"], rows)
    hurt = [m for m, d in drops.items() if d > 0.02]
    verdict = "confirmed" if drops and len(hurt) == len(drops) else "refuted" if not hurt else "depends"
    headline = "; ".join(f"{m}: non-IID costs {d:.3f} accuracy" for m, d in drops.items())
    body += ("\n\nRule: confirmed when every mode loses more than 0.02 accuracy with label-sorted shards; "
             "depends when only some do. Sync averages the N gradients of one step, which together still cover "
             "all labels; async applies each worker's one-sided gradient on its own.")
    return verdict, headline, body, [f1, f2]


# -- E8 ------------------------------------------------------------------------------------------
def wire(exp, summaries, out):
    gs = groups_of(summaries)
    order = [g for d in ("fp32", "fp16", "bf16") for g in gs.values() if g.cfg["wire_dtype"] == d]
    labels = [g.cfg["wire_dtype"] for g in order]
    per_step = [g.mean("bytes_pushed") / max(1.0, g.mean("worker_steps")) / 2**20 for g in order]
    f1 = out / "bytes_per_step.png"
    plots.bars(labels, {"pushed per worker step": ("sync", per_step, None)}, "MiB pushed per worker step", f1,
               f"{exp.id}: bytes on the wire", xlabel="wire dtype")
    f2 = out / "accuracy.png"
    plots.bars(labels, {"final test accuracy": ("sync", [g.mean("final_test_accuracy") for g in order],
                                                [g.spread("final_test_accuracy") / 2 for g in order])},
               "final test accuracy", f2, f"{exp.id}: accuracy", xlabel="wire dtype")
    rows = [[g.cfg["wire_dtype"], f"{b:.3f}", g.fmt("final_test_accuracy"), f"{g.mean('samples_per_s'):.0f}"]
            for g, b in zip(order, per_step, strict=True)]
    body = table(["wire dtype", "MiB pushed / step", "final test acc", "samples/s"], rows)
    base = order[0]
    noise = max([g.spread("final_test_accuracy") for g in order] + [0.01])
    halves = [g for g in order[1:] if per_step[order.index(g)] / per_step[0] <= 0.51
              and base.mean("final_test_accuracy") - g.mean("final_test_accuracy") <= noise]
    verdict = "confirmed" if len(halves) == len(order) - 1 and len(order) > 1 else "depends"
    headline = ", ".join(f"{g.cfg['wire_dtype']}: {per_step[i] / per_step[0]:.2f}x bytes, accuracy "
                         f"{g.mean('final_test_accuracy') - base.mean('final_test_accuracy'):+.3f}"
                         for i, g in enumerate(order) if i)
    body += (f"\n\nRule: confirmed when each half type moves at most 0.51x the fp32 bytes and loses no more "
             f"accuracy than the seed spread ({noise:.3f}). Servers keep and update fp32 parameters.")
    return verdict, headline, body, [f1, f2]


# -- E9 ------------------------------------------------------------------------------------------
def accumulate(exp, summaries, out):
    gs = sorted(groups_of(summaries).values(), key=lambda g: g.cfg["accumulate"])
    ks = [g.cfg["accumulate"] for g in gs]
    pushes_per_1k = [1000 * g.mean("worker_steps") / (g.mean("samples_per_s") * g.mean("wall_time_s")) for g in gs]
    f1 = out / "pushes_per_1000_samples.png"
    plots.lines(ks, {"pushes per 1000 samples": ("sync", pushes_per_1k)}, "micro-batches accumulated per push (k)",
                "pushes per 1000 samples", f1, f"{exp.id}: communication frequency", logx=True)
    series = [plots.Series(f"k={g.cfg['accumulate']}", g.mode, g.runs) for g in gs]
    f2 = out / "accuracy_vs_samples.png"
    plots.curves(series, "samples", "test_accuracy", f2, f"{exp.id}: accuracy at equal samples")
    rows = [[k, f"{p:.1f}", g.mean("global_updates"), g.fmt("final_test_accuracy"), f"{g.mean('samples_per_s'):.0f}"]
            for k, p, g in zip(ks, pushes_per_1k, gs, strict=True)]
    body = table(["k", "pushes / 1000 samples", "updates", "final test acc", "samples/s"], rows)
    cut = pushes_per_1k[0] / pushes_per_1k[-1]
    cost = gs[0].mean("final_test_accuracy") - gs[-1].mean("final_test_accuracy")
    verdict = "confirmed" if cut >= 0.9 * ks[-1] / ks[0] else "refuted"
    speed = gs[-1].mean("samples_per_s") / gs[0].mean("samples_per_s")
    headline = (f"k={ks[-1]} sends {cut:.1f}x fewer pushes per sample than k={ks[0]} and runs {speed:.2f}x the "
                f"samples/s, but ends {cost:.3f} {'lower' if cost >= 0 else 'higher'} in accuracy at equal samples")
    body += ("\n\nRule: confirmed when pushes per sample fall by the accumulation factor (within 10%). The accuracy "
             "cost is reported, not judged: k times fewer updates of a k times larger batch.")
    return verdict, headline, body, [f1, f2]


ANALYSES = {"modes": modes, "stragglers": stragglers, "staleness": staleness, "batch": batch, "noniid": noniid,
            "wire": wire, "accumulate": accumulate,
            **analyses_systems.ANALYSES}
