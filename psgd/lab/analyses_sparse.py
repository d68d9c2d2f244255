"""E24-E26, the sparse suite (experiments/sparse.toml): where parameter servers still win.

The first seed article says async SGD "多见于推荐系统等稀疏场景" (is seen mostly in recommender
systems and other sparse settings). These analyses measure that on `--model dlrm` over `--dataset
clicks` with the tables served by row (`--embeddings rows`, psgd/train/rowexchange.py) beside the
MNIST-1D MLP of the default suite.

- `sparse_staleness` (E24): async's cost (the one-worker control's test accuracy minus async's, at
  the same N, samples and batch per update, each at its own tuned rate) on the dense MLP minus on
  the sparse DLRM, paired by seed: claimed above the margin (staleness costs the sparse model
  less). Beside it, the mechanism: the DLRM run's per-row staleness (updates a row took between
  pull and push, summary.json `rows.staleness`) against the global staleness both runs share.
- `hot_keys` (E25): the busiest shard's share of the row load (rows pulled and pushed through it,
  summary.json `rows.load`), range partitioning minus hash, paired by seed: claimed above the
  margin; samples/s of both beside it.
- `sparse_crossover` (E26): bytes per worker step and samples/s of the parameter server and of
  all-reduce on the MLP and on the DLRM (all-reduce moves the whole table gradient, what DDP does
  for nn.Embedding without sparse collectives). The bytes are accounting (a line, not a claim);
  the crossover in samples/s is a claim about links, judged only where the workers and shards sat
  on separate hosts (`hosts` > 1): on one host they share its cores and loopback, and the verdict
  is "not testable here" with that reason.
"""

from __future__ import annotations

import numpy as np

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, series_of
from psgd.lab.results import Figure, Finding, Group, table


def _one(ctx: Context, **want) -> Group:
    found = [g for g in ctx.groups.values()
             if all((g.cfg.get(k) if k != "model" else g.cfg["model"]["model"]) == v for k, v in want.items())]
    if len(found) != 1:
        raise ValueError(f"{ctx.exp.path}: needs one run with {want}; has {', '.join(ctx.groups) or 'none'}")
    return found[0]


def _margin(ctx: Context, unit: str, default: float) -> float:
    return float(ctx.exp.margins.get(unit, default))


def sparse_staleness(ctx: Context) -> Finding:
    arms = {(m, w): _one(ctx, model=m, workers=w) for m in ("mlp", "dlrm") for w in (1, ctx.exp.params["workers"])}
    n = ctx.exp.params["workers"]
    cost = {m: [c - a for c, a in zip(arms[m, 1].finals(), arms[m, n].finals(), strict=True)] for m in ("mlp", "dlrm")}
    if arms["mlp", 1].seeds != arms["dlrm", n].seeds:
        raise ValueError(f"{ctx.exp.id}: every arm must run the same seeds (the costs are paired by seed)")
    dd = stats.mean_ci([d - s for d, s in zip(cost["mlp"], cost["dlrm"], strict=True)])
    margin = _margin(ctx, "accuracy", 0.01)
    part = V.part("async's cost on the MLP - on the DLRM", dd, margin, "effect")
    verdict = V.Verdict(part.outcome, f"async's cost (control - async, at N={n}) on the dense MLP minus on the sparse "
                                      f"DLRM {dd.fmt(signed=True)}, paired by seed (margin {margin:g})", (part,))
    sparse = arms["dlrm", n]
    per_row = sparse.mean("rows.staleness.mean")
    rows = [[g.label, g.cfg["model"]["model"], str(g.cfg["workers"]), f"{g.lr:g}", f"{g.mean('staleness.mean'):.2f}",
             f"{g.mean('rows.staleness.mean'):.2f}" if "rows" in g.runs[0].summary else "-", g.ci().fmt()]
            for g in arms.values()]
    text = table(["run", "model", "workers", "lr (own)", "global staleness", "per-row staleness",
                  "test accuracy [95% CI]"], rows)
    text += (f"\n\nCost of async (control minus async, per seed): MLP {stats.mean_ci(cost['mlp']).fmt(signed=True)}, "
             f"DLRM {stats.mean_ci(cost['dlrm']).fmt(signed=True)}. The mechanism: a DLRM row gradient was computed "
             f"on a row that took {per_row:.2f} updates on average between its pull and its push, while the shard "
             f"took {sparse.mean('staleness.mean'):.2f} (the global staleness, about N-1 for both models): "
             "a row changes only when a push names it.")
    f1 = ctx.out / "accuracy_vs_samples.png"
    plots.curves(series_of(list(arms.values())), "samples", "test_accuracy", f1,
                 f"{ctx.exp.id}: test accuracy, each at its own rate")
    headline = (f"at N={n}, async costs the MLP {stats.mean_ci(cost['mlp']).estimate:+.3f} and the DLRM "
                f"{stats.mean_ci(cost['dlrm']).estimate:+.3f}: difference {dd.fmt(3, signed=True)} ({part.outcome}); "
                f"per-row staleness {per_row:.2f} against global {sparse.mean('staleness.mean'):.2f}")
    key = {"difference": dd.estimate, "difference_ci": [dd.lo, dd.hi], "workers": n, "per_row_staleness": per_row,
           "global_staleness": sparse.mean("staleness.mean"), "seeds": sparse.seeds}
    return Finding(verdict, headline, text, [Figure(f1, ctx.caption("Test accuracy against training samples."))], key)


def _busiest(g: Group) -> list[float]:
    return [max(r.summary["rows"]["load"]) / max(1, sum(r.summary["rows"]["load"])) for r in g.runs]


def hot_keys(ctx: Context) -> Finding:
    by_range, by_hash = _one(ctx, row_partition="range"), _one(ctx, row_partition="hash")
    gap = stats.diff_ci(_busiest(by_range), _busiest(by_hash), paired=by_range.seeds == by_hash.seeds)
    margin = _margin(ctx, "share", 0.1)
    part = V.part("busiest shard's share, range - hash", gap, margin, "effect", V.SHARE)
    verdict = V.Verdict(part.outcome, f"the busiest shard's share of the row load, range minus hash, "
                                      f"{gap.fmt(signed=True)} (margin {margin:g})", (part,))
    shards = by_range.cfg["servers"]
    rows = [[g.label, f"{np.mean(_busiest(g)):.3f}", f"{1 / shards:.3f}",
             " / ".join(f"{v:,.0f}" for v in np.mean([r.summary["rows"]["load"] for r in g.runs], axis=0)),
             f"{g.mean('samples_per_s'):,.0f}"] for g in (by_range, by_hash)]
    text = table(["partition", "busiest shard's share", "even share", "rows through each shard (mean)",
                  "samples/s"], rows)
    text += ("\n\nclicks numbers each field's ids by frequency (id 0 the hottest, a Zipf law of exponent 1.1), so a "
             "range partition gives the first shard every field's hot ids; Knuth's multiplicative hash scatters them. "
             "The load is counted by the shards (distinct rows per request, pulled and pushed).")
    headline = (f"with {shards} shards the busiest carries {np.mean(_busiest(by_range)):.0%} of the row load under "
                f"range and {np.mean(_busiest(by_hash)):.0%} under hash: {gap.fmt(3, signed=True)} ({part.outcome})")
    key = {"range_busiest": float(np.mean(_busiest(by_range))), "hash_busiest": float(np.mean(_busiest(by_hash))),
           "gap_ci": [gap.lo, gap.hi], "samples_per_s_range": by_range.mean("samples_per_s"),
           "samples_per_s_hash": by_hash.mean("samples_per_s")}
    return Finding(verdict, headline, text, [], key)


def sparse_crossover(ctx: Context) -> Finding:
    arms = {(m, mode): _one(ctx, model=m, mode=mode) for m in ("mlp", "dlrm") for mode in ("sync", "allreduce")}
    rows = [[g.label, m, "PS" if mode == "sync" else "all-reduce", f"{g.mean('bytes_per_step'):,.0f}",
             f"{g.mean('samples_per_s'):,.0f}"] for (m, mode), g in arms.items()]
    text = table(["run", "model", "exchange", "bytes per worker step", "samples/s"], rows)
    ratio = {m: stats.ratio_ci(arms[m, "sync"].values("samples_per_s"), arms[m, "allreduce"].values("samples_per_s"))
             for m in ("mlp", "dlrm")}
    text += ("\n\nPS over all-reduce in samples/s: " + "; ".join(f"{m} {ratio[m].fmt(2)}x" for m in ratio)
             + ". Bytes per step are accounting (what each exchange moves by construction), not a claim.")
    hosts = int(arms["mlp", "sync"].cfg.get("hosts", 0))
    if hosts <= 1:
        why = ("every process shares one host's 2 cores and loopback: a step of either model costs Python and "
               "round trips, not link time, so which exchange moves fewer bytes does not decide samples/s; needs "
               "the netns cluster's shaped links (--hosts) and a table larger than these 1.2k rows")
        verdict = V.Verdict(V.NOT_TESTABLE, why)
    else:
        parts = (V.part("MLP: all-reduce / PS samples/s - 1", _inverse(ratio["mlp"]), 0.2, "effect", V.RATIO, 1.0),
                 V.part("DLRM: PS / all-reduce samples/s - 1", ratio["dlrm"], 0.2, "effect", V.RATIO, 1.0))
        verdict = V.Verdict(V.combine([p.outcome for p in parts]), "the ring wins on the MLP, the PS on the DLRM",
                            parts)
    b = {k: arms[k].mean("bytes_per_step") for k in arms}
    headline = (f"bytes per step PS / all-reduce: MLP {b['mlp', 'sync'] / b['mlp', 'allreduce']:.2f}x, DLRM "
                f"{b['dlrm', 'sync'] / b['dlrm', 'allreduce']:.2f}x; samples/s PS / all-reduce: MLP "
                f"{ratio['mlp'].estimate:.2f}x, DLRM {ratio['dlrm'].estimate:.2f}x ({verdict.outcome})")
    key = {f"{m}_{mode}_{k}": arms[m, mode].mean(k) for (m, mode) in arms for k in ("bytes_per_step", "samples_per_s")}
    return Finding(verdict, headline, text, [], key)


def _inverse(ci: stats.Interval) -> stats.Interval:
    """1 / a positive ratio's interval (its ends swap)."""
    return stats.Interval(1 / ci.estimate, 1 / ci.hi, 1 / ci.lo, ci.n)


ANALYSES = {"sparse_staleness": sparse_staleness, "hot_keys": hot_keys, "sparse_crossover": sparse_crossover}
