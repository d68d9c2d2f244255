"""Analyses of the remedies: what the field does about each problem the suite shows, measured
beside that problem on the same model, data and seeds (backup workers against stragglers,
staleness-aware rates and DC-ASGD against stale gradients, sparsified pushes against the
central server's link). Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here.
"""

from __future__ import annotations

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, acc_ci, diff, variant_series
from psgd.lab.results import Figure, Group, table

MIB = 2**20


# -- E13 -----------------------------------------------------------------------------------------
def _fraction(g: Group) -> str:
    return "dense" if g.cfg["topk"] >= 1 else f"top {g.cfg['topk'] * 100:g}%"


def _step_ms(g: Group) -> list[float]:
    """Milliseconds per worker step of each seed: steady-state wall time / steps per worker."""
    return [1e3 * r.summary["wall_time_s"] * r.summary["workers"] / max(1, r.summary["worker_steps"]) for r in g.runs]


def topk(ctx: Context):
    margin = float(ctx.params.get("margin", 0.02))
    learning = [g for g in ctx.groups.values() if not g.cfg.get("link")]
    dense = next(g for g in learning if g.cfg["topk"] >= 1)
    sparse = sorted((g for g in learning if g.cfg["topk"] < 1),
                    key=lambda g: (-g.cfg["topk"], g.cfg["no_error_feedback"]))
    with_ef = {_fraction(g): g for g in sparse if not g.cfg["no_error_feedback"]}
    without = {_fraction(g): g for g in sparse if g.cfg["no_error_feedback"]}
    order = [dense, *sparse]

    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(variant_series(order), "samples", "test_accuracy", f1, f"{ctx.exp.id}: accuracy at equal samples")
    # Accuracy against the bytes each run pushed (measured): one point per fraction, both arms at
    # the same bytes (feedback changes what is sent, not how much), dense shared by both lines.
    fractions = sorted({_fraction(g): g.cfg["topk"] for g in sparse}.items(), key=lambda kv: kv[1])
    names = [f for f, _ in fractions] + ["dense"]
    xs = [_by_fraction(sparse, f).mean("bytes_pushed") / MIB for f, _ in fractions] + [dense.mean("bytes_pushed") / MIB]

    def arm(groups: dict[str, Group]) -> tuple[list[float], list[tuple[float, float]]]:
        cis = [acc_ci(groups[f]) if f in groups else stats.Interval(float("nan"), float("nan"), float("nan"))
               for f, _ in fractions] + [acc_ci(dense)]
        return [c.estimate for c in cis], [(c.lo, c.hi) for c in cis]
    f2 = ctx.out / "accuracy_vs_bytes.png"
    plots.lines(xs, {"with error feedback": ("variant:0", *arm(with_ef)), "without": ("variant:1", *arm(without))},
                "MiB pushed per run (all workers, measured)", "final test accuracy", f2,
                f"{ctx.exp.id}: bytes on the wire vs accuracy", logx=True,
                xticklabels=[f"{f}\n{x:.2f} MiB" for f, x in zip(names, xs, strict=True)])

    rows = []
    for g in order:
        d = diff(g, dense)
        rows.append([g.label, _fraction(g), "-" if g is dense else ("no" if g.cfg["no_error_feedback"] else "yes"),
                     f"{g.lr:g}", f"{g.mean('bytes_pushed') / MIB:.2f}",
                     f"{g.mean('bytes_pushed') / dense.mean('bytes_pushed'):.3f}x",
                     f"{g.mean('bytes_pulled') / MIB:.1f}", acc_ci(g).fmt(), "" if g is dense else d.fmt(signed=True),
                     g.converged()])
    body = table(["run", "sent", "error feedback", "lr (tuned)", "MiB pushed", "vs dense", "MiB pulled",
                  "test accuracy [95% CI]", "minus dense", "converged"], rows)

    ef_d = {f: diff(g, dense) for f, g in with_ef.items()}
    no_d = {f: diff(dense, g) for f, g in without.items()}
    verdict = V.error_feedback_keeps_accuracy(ef_d, no_d, margin)
    params = dense.runs[0].summary["params"]
    pushed = {f: g.mean("bytes_pushed") / dense.mean("bytes_pushed") for f, g in with_ef.items()}
    headline = ("at equal samples, accuracy minus dense: with error feedback "
                + ", ".join(f"{f} {d.fmt(signed=True)}" for f, d in ef_d.items()) + "; without "
                + ", ".join(f"{f} {diff(g, dense).fmt(signed=True)}" for f, g in without.items())
                + " (dense " + acc_ci(dense).fmt() + "); pushed bytes "
                + ", ".join(f"{f} {r:.3f}x" for f, r in pushed.items())
                + f" of dense (measured), for a residual of {4 * params / 1024:.0f} KiB per worker")
    figs = [Figure(f1, ctx.caption("Test accuracy against training samples, each run at its tuned rate.")),
            Figure(f2, "Final test accuracy against the bytes each run's workers pushed in all (log scale; measured, "
                       "summary.json); band: 95% bootstrap interval over seeds. With and without error feedback a "
                       "fraction pushes the same bytes.")]
    key = {"ef_minus_dense": {f: d.estimate for f, d in ef_d.items()},
           "no_feedback_minus_dense": {f: -d.estimate for f, d in no_d.items()},
           "bytes_vs_dense": pushed,
           "residual_bytes_per_worker": 4 * params}

    linked = [g for g in ctx.groups.values() if g.cfg.get("link")]
    if linked:
        text, fig, speedup = _link_timing(ctx, linked)
        body += "\n\n" + text
        figs.append(fig)
        if speedup is not None:
            key["step_speedup_on_link"] = speedup.estimate
            headline += f"; on an EMULATED {linked[0].cfg['link']} link a step takes {speedup.fmt(2)}x less time"
    body += ("\n\nAccounting, not a finding: a sparse push of a fraction f of an n-element slice sends round(f n) "
             "entries of an int32 index and a value each, so 8 bytes per entry in fp32 (tests/test_sparsify.py checks "
             "the bytes and that fraction 1 equals dense pushes bit for bit); with error feedback each worker keeps a "
             f"residual of one fp32 per parameter ({4 * params:,} bytes here). Pulls stay dense: the parameters are "
             "not sparse, so the bytes a worker receives do not change. What is measured is whether accuracy at equal "
             "samples survives sending only the largest entries, with the rest carried over (error feedback: Stich "
             "et al. 2018; Lin et al. 2018) or dropped; each run at its own rate tuned on the validation split. Error "
             "feedback delays the small coordinates instead of dropping them, so a sparse run that has not converged "
             "(the table's last column) may still be closing its gap: the claim is judged at equal samples, not at "
             "the plateau. Momentum is the server's, applied to the sum of the sparse gradients; Deep Gradient "
             "Compression's momentum correction and sparsity warm-up are not done here.")
    return verdict, headline, body, figs, key


def _by_fraction(groups: list[Group], fraction: str) -> Group:
    return next(g for g in groups if _fraction(g) == fraction)


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
             "wall time / steps per worker; 'dense / this' is how many times faster a step is (bootstrap over seeds).")
    speedup = None
    sparse = [g for g in linked if g.cfg["topk"] < 1]
    if dense is not None and sparse:
        speedup = stats.ratio_ci(_step_ms(dense), _step_ms(sparse[-1]))
    fig = Figure(f, "Milliseconds per worker step on the emulated link, split into compute, push, pull and wait "
                    "(means over seeds); dashed: the whole step.")
    return text, fig, speedup


ANALYSES = {"topk": topk}
