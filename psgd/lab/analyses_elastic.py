"""The analysis of elastic membership (E15): a sync job that grows mid-run against jobs of fixed
size at equal samples. Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here; the
runs are named by label in the experiment's [params] (`elastic`, `small`, `large`).

The verdict is the accuracy gap of the elastic arm to the fixed job of its final size (paired by
seed, Student t, a no-worse rule with the suite's accuracy margin). Beside it, not judged: the
samples/s of each segment of the elastic run (summary.json's `membership.segments`, cut at each
change of membership by the step events' times) against the fixed jobs of the same size, and each
joiner's seconds from admission to its first step done.
"""

from __future__ import annotations

import math

import numpy as np

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, Needs, acc_ci, diff, variant_series
from psgd.lab.results import Figure, table


def _segments(g, workers: int) -> list[float]:
    """Per seed, the elastic run's samples/s over its segments with `workers` workers."""
    out = []
    for r in g.runs:
        segs = [s for s in r.summary.get("membership", {}).get("segments", []) if s["workers"] == workers
                and s["samples_per_s"] is not None]
        out.append(float(np.mean([s["samples_per_s"] for s in segs])) if segs else float("nan"))
    return out


def elastic(ctx: Context):
    p = ctx.params
    grown, small, large = ctx.group(p["elastic"]), ctx.group(p["small"]), ctx.group(p["large"])
    n_small, n_large = small.cfg["workers"], large.cfg["workers"]
    order = [small, grown, large]
    f1 = ctx.out / "accuracy_vs_elapsed_s.png"
    plots.curves(variant_series(order), "elapsed_s", "test_accuracy", f1,
                 f"{ctx.exp.id}: accuracy against wall time (equal samples at the end)")
    before = stats.ratio_ci(_segments(grown, n_small), small.values("samples_per_s"))
    after = stats.ratio_ci(_segments(grown, n_large), large.values("samples_per_s"))
    f2 = ctx.out / "throughput.png"
    seg_small, seg_large = _segments(grown, n_small), _segments(grown, n_large)
    rows_t = [(f"{n_small} workers", small.summary_ci("samples_per_s"), stats.mean_ci(seg_small)),
              (f"{n_large} workers", large.summary_ci("samples_per_s"), stats.mean_ci(seg_large))]
    plots.dots([r[0] for r in rows_t],
               {"fixed size": ("variant:0", [r[1].estimate for r in rows_t], [(r[1].lo, r[1].hi) for r in rows_t]),
                "elastic, that segment": ("variant:1", [r[2].estimate for r in rows_t],
                                          [(r[2].lo, r[2].hi) for r in rows_t])},
               "samples/s", f2, f"{ctx.exp.id}: throughput before and after the change")
    first = [j["first_step_s"] for r in grown.runs for j in r.summary.get("membership", {}).get("joiners", [])
             if j.get("first_step_s") is not None]
    gap = diff(grown, large)
    rows = [[g.label, g.cfg.get("elastic") or f"{g.cfg['workers']} fixed", f"{g.lr:g}", int(g.mean("global_updates")),
             int(g.mean("worker_steps")) * g.cfg["batch_size"], acc_ci(g).fmt(), g.summary_ci("samples_per_s").fmt(0),
             g.converged()] for g in order]
    body = table(["run", "workers", "lr (tuned)", "updates", "samples", "test accuracy [95% CI]", "samples/s",
                  "converged"], rows)
    verdict = V.keeps_accuracy({grown.label: gap})
    headline = (f"growing {n_small} -> {n_large} workers mid-run, at equal samples: accuracy minus fixed "
                f"{n_large} {gap.fmt(signed=True)}; samples/s before the change {before.fmt(2)}x fixed {n_small}'s, "
                f"after it {after.fmt(2)}x fixed {n_large}'s")
    if not any(r.summary.get("membership", {}).get("segments") for r in grown.runs):
        # A budget that ends before the schedule's change (--quick's): the elastic arm never grew.
        why = (f"the elastic run never changed its membership (--elastic {grown.cfg.get('elastic')}; it ended "
               f"after {int(grown.mean('global_updates'))} updates, before the change)")
        verdict, headline = V.Verdict(V.INCONCLUSIVE, why), f"not judged: {why}"
    body += (f"\n\nThroughput per segment is measured from the step events' times between changes of membership "
             f"(summary.json `membership.segments`), beside the fixed jobs' steady-state samples/s: ratios "
             f"{before.fmt(2)}x ({n_small} workers) and {after.fmt(2)}x ({n_large} workers), t intervals of the log "
             "ratio, paired by seed. On 2 shared cores 4 workers need not be faster than 2 (the table's "
             "samples/s): the ratios say whether the job runs, before and after the change, as a fixed job of that "
             "size does, not whether growing made it faster. ")
    if first:
        body += (f"A joining worker's first step was done {1000 * float(np.median(first)):.0f} ms after its "
                 f"admission (median of {len(first)}; max {1000 * max(first):.0f} ms): a scheduled joiner starts with "
                 "the run and waits at its first pull, so this is the step itself, not its start-up (a "
                 "`psgd worker --join` started by hand adds its process start, about 3.5 s here). ")
    if any(math.isnan(x) for x in seg_small + seg_large):
        body += "Some elastic runs reported no segment of that size. "
    body += ("The curves are against wall time: an elastic run's samples per update change at the change, so its "
             "evaluations are not on the fixed runs' sample grid; the finals are at equal samples.")
    figs = [Figure(f1, ctx.caption("Test accuracy against steady-state wall time, each arm at its tuned rate.")),
            Figure(f2, "Samples/s of the fixed jobs and of the elastic run's segments of the same size; "
                       "error bars: 95% t interval over seeds.")]
    return verdict, headline, body, figs, {"elastic_minus_large": gap.estimate, "after_vs_large": after.estimate}


ANALYSES = {"elastic": elastic}
NEEDS = {"elastic": Needs(params=("elastic", "small", "large"))}
