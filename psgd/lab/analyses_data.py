"""Analyses of the claims about batches, data and bytes: large batches (E6), non-IID shards (E7),
half precision on the wire (E8) and gradient accumulation (E9). Same contract as psgd/lab/analyses.py,
whose `analyse` dispatches here. The runs to compare are named by label in each experiment's
[params], so the analysis never guesses a run's role from its settings.
"""

from __future__ import annotations

import math

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, Needs, acc_ci, diff, series_of, variant_series
from psgd.lab.results import Figure, table


# -- E6 ------------------------------------------------------------------------------------------
def batch(ctx: Context):
    p = ctx.params
    small, fixed, tuned = ctx.group(p["small"]), ctx.group(p["fixed"]), ctx.group(p["tuned"])
    scaled = ctx.group(p["scaled"]) if p.get("scaled") else None
    order = [g for g in (small, fixed, scaled, tuned) if g is not None]
    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series(order), "samples", "test_accuracy", f1, f"{ctx.exp.id}: accuracy at equal samples")
    f2 = ctx.out / "final_accuracy.png"
    cis = [acc_ci(g) for g in order]
    plots.dots([g.label for g in order], {"final test accuracy": ("variant:0", [c.estimate for c in cis],
                                                                  [(c.lo, c.hi) for c in cis])},
               "final test accuracy", f2, f"{ctx.exp.id}: large batches")
    rows = [[g.label, g.runs[0].summary["global_batch"], f"{g.lr:g}", g.cfg["optim"]["warmup"],
             int(g.mean("global_updates")), c.fmt(), g.converged()] for g, c in zip(order, cis, strict=True)]
    body = table(["run", "global batch", "lr", "warmup updates", "updates", "test accuracy [95% CI]", "converged"],
                 rows)
    d = diff(tuned, fixed)
    verdict = V.retuning_pays(d, lr_changed=tuned.lr != fixed.lr)
    big = tuned.runs[0].summary["global_batch"]
    headline = (f"at global batch {big} and equal epochs, its own tuned rate ({tuned.lr:g}) gives "
                f"{acc_ci(tuned).fmt()} vs {acc_ci(fixed).fmt()} at the batch-{small.runs[0].summary['global_batch']} "
                f"rate ({fixed.lr:g}): {d.fmt(signed=True)}")
    if scaled is not None:
        headline += f"; the linear scaling rule + warmup (lr {scaled.lr:g}) gives {acc_ci(scaled).fmt()}"
    body += ("\n\nEqual epochs: every run sees the same samples, so the larger batch makes proportionally fewer "
             "updates. The linear scaling rule (Goyal et al. 2017) multiplies the small batch's tuned rate by the "
             "batch ratio and warms up linearly.")
    figs = [Figure(f1, ctx.caption("Test accuracy against samples.")),
            Figure(f2, "Final test accuracy with 95% t intervals over seeds (paired by seed).")]
    return verdict, headline, body, figs, {"tuned_minus_fixed": d.estimate, "ci": [d.lo, d.hi]}


# -- E7 ------------------------------------------------------------------------------------------
def _skew(cfg: dict) -> str:
    d = cfg["data"]
    if d["shard_data"] == "iid":
        return "IID"
    if d["shard_data"] == "noniid":
        return "label-sorted"
    return f"Dir({d['dirichlet_alpha']:g})" + (", equal" if d["shard_data"] == "dirichlet-equal" else "")


def noniid(ctx: Context):
    p = ctx.params
    every = [ctx.group(x) for x in p["every_step"]]
    local = [ctx.group(x) for x in p["local"]]
    skews = [_skew(g.cfg) for g in every]
    names = {"every": p.get("every_step_name", "averaging every step"), "local": p.get("local_name", "local SGD")}
    ys = {}
    for key, gs, mode in (("every", every, "sync"), ("local", local, "local")):
        cis = [acc_ci(g) for g in gs]
        ys[names[key]] = (mode, [c.estimate for c in cis], [(c.lo, c.hi) for c in cis])
    f1 = ctx.out / "accuracy_vs_skew.png"
    plots.lines(list(range(len(skews))), ys, "label skew across workers", "final test accuracy", f1,
                f"{ctx.exp.id}: label skew", xticklabels=skews)
    f2 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(series_of(every + local), "samples", "test_accuracy", f2, f"{ctx.exp.id}: accuracy at equal samples")
    rows = []
    for key, gs in (("every", every), ("local", local)):
        for g in gs:
            rows.append([names[key], _skew(g.cfg), f"{g.lr:g}", acc_ci(g).fmt(),
                         diff(gs[0], g).fmt(signed=True) if g is not gs[0] else "", g.converged()])
    body = table(["averaging", "shards", "lr", "test accuracy [95% CI]", "drop from IID", "converged"], rows)
    f3 = ctx.out / "labels_per_worker.png"
    counts = _class_counts(local[-1].runs[0].cfg)
    plots.grid_map([f"worker {r}" for r in range(len(counts))], [str(c) for c in range(len(counts[0]))],
                   [[n / max(1, sum(row)) for n in row] for row in counts], [[str(n) for n in row] for row in counts],
                   f3, f"{ctx.exp.id}: labels per worker, {skews[-1]} (seed {local[-1].runs[0].cfg['seed']})",
                   xlabel="class", cbar="share of the worker's samples")
    local_drop, every_drop = diff(local[0], local[-1]), diff(every[0], every[-1])
    verdict = V.skew_hurts(local_drop, every_drop)
    headline = (f"with {skews[-1]} shards, {names['local']} loses {local_drop.fmt(signed=True)} accuracy and "
                f"{names['every']} {every_drop.fmt(signed=True)}")
    sizes = [sum(row) for row in counts]
    equal = len(set(sizes)) == 1
    how = ("every worker holds as many samples, its class mix drawn from Dirichlet(alpha) proportions" if equal
           else "each class is split among the workers in Dirichlet(alpha) shares")
    weights = (": with shards of one size every class weighs as in the data, so the update is an IID one of a "
               "differently composed batch" if equal else
               ": but with shards of unequal size each worker's samples weigh 1/N of a step whatever their number, "
               "so the classes are weighted unlike the data")
    body += (f"\n\nDir(alpha): {how} (Hsu et al. 2019); small alpha gives each worker few classes. The workers' "
             f"shards here hold {'/'.join(map(str, sizes))} samples. Averaging every step (sync) applies the mean of "
             f"all workers' gradients, one batch each, which together still cover every class{weights}. "
             f"{names['local']} lets each replica drift toward its own classes between averagings "
             f"(Stich 2019; Lin et al. 2020). Each averaging scheme runs at its rate tuned on IID shards.")
    figs = [Figure(f3, f"Training samples of each class on each worker with {skews[-1]} shards (cell: count; shade: "
                       "share of that worker's samples)."),
            Figure(f1, "Final test accuracy per label skew (x: " + ", ".join(f"{i} = {s}" for i, s in enumerate(skews))
                   + f"); error bars: 95% t interval over seeds ({ctx.seeds_note()})."),
            Figure(f2, ctx.caption("Test accuracy against samples for every skew."))]
    return verdict, headline, body, figs, {"local_drop": local_drop.estimate, "every_step_drop": every_drop.estimate}


def _class_counts(cfg_dict: dict) -> list[list[int]]:
    """Per-worker class counts of a run's training shards, rebuilt from its config."""
    from psgd.core import config as C  # noqa: PLC0415
    from psgd.train import data  # noqa: PLC0415

    cfg = C.from_dict(cfg_dict)
    ds = data.load(cfg.data)
    return data.class_histogram(data.plan_for(cfg, ds.y_train), ds.y_train, ds.num_classes)


# -- E8 ------------------------------------------------------------------------------------------
def wire(ctx: Context):
    order = [g for d in ("fp32", "fp16", "bf16") for g in ctx.groups.values() if g.cfg["wire_dtype"] == d]
    base = order[0]
    per_step = [g.mean("bytes_pushed") / max(1.0, g.mean("worker_steps")) / 2**20 for g in order]
    f1 = ctx.out / "bytes_per_step.png"
    theory = base.runs[0].summary["params"] * 4 / 2**20
    plots.bars([g.cfg["wire_dtype"] for g in order], {"pushed per worker step": ("variant:0", per_step, None)},
               "MiB pushed per worker step", f1, f"{ctx.exp.id}: bytes on the wire", xlabel="wire dtype",
               refs=[(theory, "fp32 parameters x 4 B"), (theory / 2, "x 2 B")])
    cis = [acc_ci(g) for g in order]
    f2 = ctx.out / "accuracy.png"
    plots.dots([g.cfg["wire_dtype"] for g in order], {"final test accuracy": ("variant:0", [c.estimate for c in cis],
                                                                              [(c.lo, c.hi) for c in cis])},
               "final test accuracy", f2, f"{ctx.exp.id}: accuracy", xlabel="wire dtype")
    diffs = {g.cfg["wire_dtype"]: diff(g, base) for g in order[1:]}
    rows = [[g.cfg["wire_dtype"], f"{b:.4f}", f"{b / per_step[0]:.2f}x", c.fmt(),
             diffs[g.cfg["wire_dtype"]].fmt(signed=True) if g is not base else "", f"{g.mean('samples_per_s'):.0f}"]
            for g, b, c in zip(order, per_step, cis, strict=True)]
    body = table(["wire dtype", "MiB pushed / step", "bytes vs fp32", "test accuracy [95% CI]", "minus fp32",
                  "samples/s"], rows)
    verdict = V.keeps_accuracy(diffs)
    headline = "accuracy minus fp32: " + ", ".join(f"{k} {v.fmt(signed=True)}" for k, v in diffs.items()) + \
        " (bytes: " + ", ".join(f"{g.cfg['wire_dtype']} {per_step[i] / per_step[0]:.2f}x" for i, g in
                                 enumerate(order) if i) + ", accounting)"
    body += ("\n\nAccounting, not a finding: a 2-byte type moves half the bytes of a 4-byte one; "
             "tests/test_accounting.py checks that the code does exactly that. What is measured is whether accuracy "
             "survives the rounding. Servers keep and update fp32 parameters.")
    figs = [Figure(f1, "Bytes each worker pushes per step; dotted: the model's size at 4 and 2 bytes per parameter."),
            Figure(f2, "Final test accuracy with 95% t intervals over seeds (paired by seed).")]
    return verdict, headline, body, figs, {k: v.estimate for k, v in diffs.items()}


# -- E9 ------------------------------------------------------------------------------------------
def accumulate(ctx: Context):
    gs = sorted(ctx.groups.values(), key=lambda g: g.cfg["accumulate"])
    ks = [g.cfg["accumulate"] for g in gs]
    pushes = [1000 * g.mean("worker_steps") / (g.mean("samples_per_s") * g.mean("wall_time_s")) for g in gs]
    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series(gs), "samples", "test_accuracy", f1, f"{ctx.exp.id}: accuracy at equal samples")
    speed = [stats.ratio_ci(g.values("samples_per_s"), gs[0].values("samples_per_s")) for g in gs]
    f2 = ctx.out / "samples_per_s.png"
    plots.lines(ks, {"samples/s vs k=1": ("variant:0", [s.estimate for s in speed], [(s.lo, s.hi) for s in speed])},
                "micro-batches accumulated per push (k)", "samples/s relative to k=1", f2,
                f"{ctx.exp.id}: throughput", logx=True, points=True)
    diffs = {f"k={g.cfg['accumulate']}": diff(g, gs[0]) for g in gs[1:]}
    rows = [[k, f"{g.lr:g}", f"{p:.1f}", int(g.mean("global_updates")), acc_ci(g).fmt(),
             diffs[f"k={k}"].fmt(signed=True) if i else "", s.fmt(2), g.converged()]
            for i, (k, g, p, s) in enumerate(zip(ks, gs, pushes, speed, strict=True))]
    body = table(["k", "lr (tuned)", "pushes / 1000 samples", "updates", "test accuracy [95% CI]", "minus k=1",
                  "samples/s vs k=1", "converged"], rows)
    verdict = V.keeps_accuracy(diffs)
    headline = ("at equal samples and each k's tuned rate, accuracy minus k=1: "
                + ", ".join(f"{k} {v.fmt(signed=True)}" for k, v in diffs.items())
                + f"; k={ks[-1]} runs {speed[-1].fmt(2)}x the samples/s")
    body += (f"\n\nAccounting, not a finding: k micro-batches per push send k times fewer pushes per sample "
             f"(measured here: {pushes[0] / pushes[-1]:.2f}x fewer at k={ks[-1]}; tests/test_accounting.py checks it). "
             "What is measured is whether the k-fold fewer, k-fold larger updates cost accuracy at equal samples once "
             "each k has its own rate, and what the saved round trips buy in samples/s.")
    if any(not math.isfinite(p) for p in pushes):
        body += " Some runs reported no throughput."
    figs = [Figure(f1, ctx.caption("Test accuracy against samples, each k at its tuned rate.")),
            Figure(f2, "Samples/s relative to k=1; error bars: 95% t interval over seeds.")]
    return verdict, headline, body, figs, {k: v.estimate for k, v in diffs.items()}


# -- E14 -----------------------------------------------------------------------------------------
DILOCO_MARGIN = 0.05  # nats per character: a loss gap smaller than this is "as well" here


def diloco(ctx: Context):
    gs = sorted(ctx.groups.values(), key=lambda g: g.cfg.get("local_steps", 1))
    base = gs[0]
    f1 = ctx.out / "loss_vs_samples.png"
    plots.curves(variant_series(gs), "samples", "test_loss", f1, f"{ctx.exp.id}: test loss at equal samples")
    # base minus DiLoCo in test loss: negative when DiLoCo's loss is higher (worse).
    gaps = {f"H={g.cfg['local_steps']}": diff(base, g, "test_loss") for g in gs[1:]}
    per_step = [g.mean("bytes_per_step") for g in gs]
    rows = [[g.label, f"{g.lr:g}", int(g.mean("global_updates")), g.ci("test_loss").fmt(),
             gaps[f"H={g.cfg['local_steps']}"].fmt(signed=True) if i else "", f"{per_step[i] / 1024:.1f}",
             f"{per_step[0] / per_step[i]:.1f}x" if i else "", g.converged()]
            for i, g in enumerate(gs)]
    body = table(["arm", "inner lr (tuned)", "updates", "test loss [95% CI]", "sync minus arm", "KiB / worker step",
                  "less traffic", "converged"], rows)
    outer = min(int(g.mean("global_updates")) for g in gs[1:])  # a DiLoCo run's updates are its outer steps
    verdict = V.diloco_at_scale(int(base.cfg["workers"]), outer, False, V.keeps_loss(gaps, DILOCO_MARGIN))
    headline = ("at equal samples, test loss (nats per character) minus sync data parallel's "
                f"{base.ci('test_loss').fmt()}: " + ", ".join(f"{k} {-v.estimate:+.3f} [{-v.hi:+.3f}, {-v.lo:+.3f}]"
                                                            for k, v in gaps.items())
                + f" (margin {DILOCO_MARGIN}); traffic per worker step "
                + ", ".join(f"{k} {per_step[0] / per_step[i + 1]:.1f}x less" for i, k in enumerate(gaps)))
    body += (f"\n\nIntervals: paired by seed (the same initialisation and batches in every arm of a seed), Student t "
             f"over {len(base.runs)} seeds. The unigram baseline (every character at its training frequency) is "
             "3.24 nats per character on this text; the traffic column is measured (bytes pushed and pulled per "
             "local step), and H-fold less is its accounting.")
    figs = [Figure(f1, ctx.caption("Test loss against training samples, each arm at its tuned inner rate."))]
    return verdict, headline, body, figs, {k: -v.estimate for k, v in gaps.items()}


ANALYSES = {"batch": batch, "noniid": noniid, "wire": wire, "accumulate": accumulate, "diloco": diloco}
NEEDS = {"batch": Needs(params=("small", "fixed", "tuned"), optional=("scaled",)),
         "noniid": Needs(params=("every_step", "local"))}
