"""Per-claim analyses: the figures, the numbers and the verdict of each experiment.

Contract: `analyse(exp, summaries, out)` dispatches on `exp.analysis` to one function here; it
draws the figures into `out` (PNG + CSV each, psgd/plots.py), and returns a `Section` with a
verdict — confirmed, refuted or depends — computed from the measured numbers by a rule stated
in the section text, never written by hand. Runs of the same label (several seeds) are averaged;
their spread (max - min) is the noise floor a difference must clear.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from psgd import link as link_mod
from psgd import plots


@dataclass
class Section:
    id: str
    title: str
    claim: str
    quote: str
    verdict: str                 # confirmed | refuted | depends
    headline: str                # one line with the key number
    body: str                    # markdown: table and reasoning
    figures: list[Path] = field(default_factory=list)


@dataclass
class Group:
    """All seeds of one labelled run."""
    label: str
    runs: list[plots.RunData]

    @property
    def mode(self) -> str:
        return self.runs[0].mode

    @property
    def cfg(self) -> dict:
        return self.runs[0].summary["config"]

    def values(self, key: str) -> list[float]:
        out = []
        for r in self.runs:
            v = r.summary
            for part in key.split("."):
                v = v[part]
            out.append(float(v) if v is not None else float("nan"))
        return out

    def mean(self, key: str) -> float:
        return float(np.mean(self.values(key)))

    def spread(self, key: str) -> float:
        v = self.values(key)
        return float(max(v) - min(v)) if len(v) > 1 else 0.0

    def fmt(self, key: str, digits: int = 3) -> str:
        m, s = self.mean(key), self.spread(key)
        return f"{m:.{digits}f}" + (f" ± {s / 2:.{digits}f}" if len(self.runs) > 1 else "")


def groups_of(summaries: list) -> dict[str, Group]:
    grouped: dict[str, list] = defaultdict(list)
    for spec, _ in summaries:
        grouped[spec.label].append(plots.load_run(spec.cfg.out))
    return {label: Group(label, runs) for label, runs in grouped.items()}


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def roughness(run: plots.RunData) -> float:
    """Mean absolute change of test loss between consecutive evaluations (oscillation)."""
    losses = [e["test_loss"] for e in run.evals]
    if len(losses) < 3 or not all(math.isfinite(x) for x in losses):
        return float("inf")
    return float(np.mean(np.abs(np.diff(losses[len(losses) // 3:]))))  # after the initial descent


def diverged(run: plots.RunData) -> bool:
    first, last = run.evals[0]["test_loss"], run.summary["final_test_loss"]
    return last is None or not math.isfinite(last) or last > first


def time_to(run: plots.RunData, target: float) -> float:
    for e in run.evals:
        if e["test_accuracy"] >= target:
            return e["elapsed_s"]
    return float("inf")


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
            "wire": wire, "accumulate": accumulate}


# -- E5 ------------------------------------------------------------------------------------------
def allreduce_bench(exp, summaries, out):
    result = json.loads((out / "bench.json").read_text())
    rows = result["rows"]
    keys = sorted({(r["workers"], r["size_mb"]) for r in rows})
    groups = [f"N={n}, {s:g} MiB" for n, s in keys]
    by = {(r["workers"], r["size_mb"], r["impl"]): r for r in rows}
    impls = [i for i in ("library", "ring") if any(r["impl"] == i for r in rows)]
    f1, f2 = out / "time.png", out / "busbw.png"
    plots.bars(groups, {i: (i, [by[(n, s, i)]["time_ms"] for n, s in keys], None) for i in impls}, "ms per all-reduce",
               f1, f"{exp.id}: all-reduce time ({rows[0]['backend']})")
    plots.bars(groups, {i: (i, [by[(n, s, i)]["busbw_GBps"] for n, s in keys], None) for i in impls},
               "bus bandwidth (GB/s)", f2, f"{exp.id}: busbw = algbw x 2(N-1)/N")
    body = table(["impl", "N", "MiB", "ms", "algbw GB/s", "busbw GB/s"],
                 [[r["impl"], r["workers"], f"{r['size_mb']:g}", f"{r['time_ms']:.1f}", f"{r['algbw_GBps']:.3f}",
                   f"{r['busbw_GBps']:.3f}"] for r in rows])
    ratio = [q["ring_over_library"] for q in result["ratios"]]
    if not ratio:
        return "depends", "needs both implementations", body, [f1, f2]
    worst = max(ratio)
    verdict = "confirmed" if worst >= 10 else "refuted" if worst < 1.5 else "depends"
    backend = rows[0]["backend"]
    headline = (f"the hand-written ring takes {min(ratio):.2f}x-{worst:.2f}x the time of {backend}'s all-reduce "
                f"(the seed: more than 10x slower than NCCL)")
    note = (" on CPU processes over loopback, not NCCL on GPUs: both move the same bytes through the same kernel, "
            "so the gap measures per-chunk Python and scheduling overhead, not the link") if backend == "gloo" else ""
    body += (f"\n\nRule: confirmed at 10x or more, refuted below 1.5x, depends in between. The library here is "
             f"{backend}{note}.")
    return verdict, headline, body, [f1, f2]


ANALYSES["allreduce_bench"] = allreduce_bench


# -- E10 -----------------------------------------------------------------------------------------
def link(exp, summaries, out):
    gs = groups_of(summaries)
    by: dict[str, dict[int, Group]] = defaultdict(dict)
    for g in gs.values():
        by[g.cfg.get("link") or "loopback (no pacing)"][g.cfg["workers"]] = g
    ns = sorted({n for d in by.values() for n in d})
    speedup = {name: ("sync", [d[n].mean("samples_per_s") / d[ns[0]].mean("samples_per_s") if n in d and ns[0] in d
                               else float("nan") for n in ns]) for name, d in by.items()}
    f1 = out / "speedup_vs_workers.png"
    plots.lines(ns, {**speedup, "ideal": ("ideal", [n / ns[0] for n in ns])}, "workers N",
                f"speedup over N={ns[0]} (samples/s)", f1, f"{exp.id}: the communication wall (emulated links)")
    rows, share = [], {}
    for name, d in by.items():
        for n in sorted(d):
            tb = d[n].runs[0].summary["time_breakdown_s"]
            comm = tb["push"] + tb["pull"] + tb["wait"]
            share[(name, n)] = comm / max(1e-9, comm + tb["compute"])
            rows.append([name, n, f"{d[n].mean('samples_per_s'):.0f}", f"{speedup[name][1][ns.index(n)]:.2f}",
                         f"{tb['compute'] / max(1, d[n].runs[0].summary['worker_steps'] / n) * 1e3:.0f}",
                         f"{comm / max(1, d[n].runs[0].summary['worker_steps'] / n) * 1e3:.0f}",
                         f"{share[(name, n)]:.0%}"])
    names = list(by)
    f2 = out / "communication_share.png"
    plots.bars([f"N={n}" for n in ns], {name: ("sync", [share.get((name, n), 0.0) * 100 for n in ns], None)
                                        for name in names},
               "% of step time in push + pull + wait", f2, f"{exp.id}: where the step time goes", xlabel="workers")
    body = table(["link", "N", "samples/s", "speedup", "compute ms/step", "communication ms/step",
                  "share in communication"], rows)
    def bandwidth(name: str) -> float:  # the unpaced loopback counts as the fastest link
        return math.inf if name not in {g.cfg.get("link") for g in gs.values()} else \
            link_mod.parse(name).bits_per_s

    slowest, fastest = min(names, key=bandwidth), max(names, key=bandwidth)
    s_slow, s_fast = speedup[slowest][1][-1], speedup[fastest][1][-1]
    comm_slow = share.get((slowest, ns[-1]), 0.0)
    verdict = "confirmed" if s_slow < 0.7 * s_fast and comm_slow > 0.5 else \
        "refuted" if s_slow >= 0.95 * s_fast else "depends"
    compute_ms = exp.params.get("emulated_compute_ms")
    headline = (f"at N={ns[-1]} the speedup is {s_fast:.2f}x on {fastest} but {s_slow:.2f}x on {slowest}, where "
                f"{comm_slow:.0%} of each step is communication")
    body += ("\n\nRule: confirmed when, at the largest N, the slowest link keeps less than 0.7x the speedup of the "
             "fastest and spends more than half of each step communicating. EMULATED: psgd/link.py paces each "
             "worker's sends and receives on loopback (bandwidth and a per-message latency); nothing crossed a real "
             "network, and the server's own link is not paced"
             + (f"; every worker's compute is a fixed {compute_ms} ms per step standing in for an accelerator, "
                "since real compute on two shared CPU cores cannot scale with N" if compute_ms else "") + ".")
    return verdict, headline, body, [f1, f2]


ANALYSES["link"] = link


# -- E4 ------------------------------------------------------------------------------------------
def scaling_bench(exp, summaries, out):
    with open(out / "scaling.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok" and r.get("overlap", "False") in ("False", "0", "")]
    if not rows:
        return "depends", "the scaling benchmark produced no rows", "", []

    def name(r: dict) -> str:
        if r["mode"] in ("ring", "allreduce"):
            return "ring all-reduce"
        return f"PS, {r['shards']} shard{'s' * (r['shards'] != '1')}"

    series: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        series[name(r)][int(r["workers"])] = r
    ns = sorted({int(r["workers"]) for r in rows})

    def col(key: str, scale: float = 1.0) -> dict:
        return {s: ("allreduce" if s.startswith("ring") else "sync",
                    [float(d[n][key]) * scale if n in d else float("nan") for n in ns]) for s, d in series.items()}

    f1, f2 = out / "samples_per_s.png", out / "busiest_bytes.png"
    params = int(rows[0]["params"])
    plots.lines(ns, col("samples_per_s"), "workers N", "samples/s", f1,
                f"{exp.id}: throughput, wide MLP ({params / 1e6:.1f}M parameters)", logx=True)
    plots.lines(ns, col("busiest_bytes", 1 / 2**20), "workers N", "MiB per step through the busiest process", f2,
                f"{exp.id}: the busiest process's traffic", logx=True)
    body = table(["config", "N", "samples/s", "step s", "compute s", "comm s", "wait s", "busiest", "MiB/step"],
                 [[name(r), r["workers"], f"{float(r['samples_per_s']):.0f}", f"{float(r['step_s']):.3f}",
                   f"{float(r['compute_s']):.3f}", f"{float(r['comm_s']):.3f}", f"{float(r['wait_s']):.3f}",
                   r["busiest"], f"{float(r['busiest_bytes']) / 2**20:.1f}"] for r in rows])
    one = series.get("PS, 1 shard", {})
    ring = series.get("ring all-reduce", {})
    lo, hi = ns[0], ns[-1]
    grow_ps = float(one[hi]["busiest_bytes"]) / float(one[lo]["busiest_bytes"]) if lo in one and hi in one else math.nan
    grow_ring = float(ring[hi]["busiest_bytes"]) / float(ring[max(lo, 2)]["busiest_bytes"]) \
        if hi in ring and max(lo, 2) in ring else math.nan
    verdict = "confirmed" if grow_ps >= 0.75 * hi / lo and grow_ring <= 2.0 else "depends"
    best = {s: float(d[hi]["samples_per_s"]) for s, d in series.items() if hi in d}
    headline = (f"from N={lo} to N={hi} the single server's traffic grows {grow_ps:.1f}x, a ring worker's "
                f"{grow_ring:.2f}x; samples/s at N={hi}: " + ", ".join(f"{s} {v:.0f}" for s, v in best.items()))
    body += (f"\n\nRule: confirmed when the one-shard server's bytes per step grow at least 0.75x as fast as N while "
             f"a ring worker's stay within 2x (2(N-1)/N x size tends to 2 x size). The throughput columns say whether "
             f"that traffic is the bottleneck on this machine, where all processes share {os.cpu_count()} cores: "
             f"here CPU time, not the link, is the scarce resource. Made by `psgd bench scaling`; its own three-panel "
             f"figure is `scaling.png` in this folder.")
    return verdict, headline, body, [f1, f2]


ANALYSES["scaling_bench"] = scaling_bench
