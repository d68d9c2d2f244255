"""What every claim's analysis shares: its context (runs by label, tuning) and the report's common parts.

Contract: `Context(exp, summaries, out, chosen, scores)` gives an analysis its experiment, its runs
grouped by label (psgd/lab/results.py), its params and the tuning; `body(ctx, text, verdict)` wraps an
analysis's own text with the setup sentence (from the run configs), the tuning table and the
verdict's rule. `diff` / `acc_ci` are the intervals every learning claim uses. The analyses
(psgd/analyses*.py) import this module; it imports none of them.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from psgd.lab import plots, stats
from psgd.lab import verdicts as V
from psgd.lab.results import LAST_K, PLATEAU, Group, at_best_val, converged, final, groups_of, setup, table, time_to


@dataclass(frozen=True)
class Needs:
    """The runs an analysis reads by label, declared beside it (a module's NEEDS, by analysis name) so
    that a suite checks them before it runs anything: `labels` it names itself, `params` the [params]
    keys it requires and `optional` those it reads when present, whose values name runs (a label or
    a list of labels)."""
    labels: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def problem(self, params: dict, have: set[str]) -> str:
        """What is missing (a clause naming the key or the label), or "" when every run it reads is there."""
        for key in self.params:
            if key not in params:
                return f"[params] needs {key!r} (the label of the run it reads)"
        named = [(f"[params] {k} names", v) for k in (*self.params, *self.optional) if k in params
                 for v in ([params[k]] if isinstance(params[k], str) else params[k])]
        for where, label in [("the analysis reads", x) for x in self.labels] + named:
            if label not in have:
                return f"{where} a run labelled {label!r}, which the experiment does not have"
        return ""


def scoring_of(exp) -> tuple[str, str]:
    """(how an experiment scores its runs, the validation metric best_val picks by): experiment.py's
    `scoring` and `[tune] metric`; an object without them (a test's stand-in) scores at the end."""
    return getattr(exp, "scoring", "end"), getattr(exp, "tune_metric", "val_accuracy")


class Context:
    """What every analysis gets: the experiment, its runs by label, and the tuning."""

    def __init__(self, exp, summaries: list, out: Path, chosen: dict, scores: dict) -> None:
        self.exp, self.summaries, self.out, self.chosen, self.scores = exp, summaries, out, chosen, scores
        self.groups: dict[str, Group] = groups_of(summaries, *scoring_of(exp)) if summaries else {}
        self.params = exp.params

    def group(self, label: str) -> Group:
        if label not in self.groups:
            raise ValueError(f"{self.exp.path}: the analysis needs a run labelled {label!r}; the experiment has "
                             f"{', '.join(self.groups) or 'none'}")
        return self.groups[label]

    def seeds_note(self) -> str:
        n = sorted({len(g.runs) for g in self.groups.values()})
        return f"{'/'.join(map(str, n))} seed{'s' * (n != [1])}" if n else ""

    def caption(self, what: str) -> str:
        return f"{what} {plots.BAND.capitalize()} ({self.seeds_note()}); each point the mean over seeds."


def write_finals(ctx: Context) -> Path | None:
    """Every evaluated run's per-seed finals, one row per (run, seed): finals.csv in the experiment's
    folder, the numbers behind its tables and intervals (None when it has no learning runs)."""
    if not ctx.groups:
        return None
    path = ctx.out / "finals.csv"
    keys = ("test_accuracy", "test_loss", "train_loss", "val_accuracy")
    best = ("test_accuracy", "test_loss")   # also at the best validation point, where the runs have one
    val_key = scoring_of(ctx.exp)[1]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "seed", "lr", *(f"final_{k}" for k in keys), *(f"best_val_{k}" for k in best),
                    "samples_per_s", "converged"])
        for g in ctx.groups.values():
            for r in g.runs:
                try:
                    at_best = [f"{at_best_val(r, k, val_key):.6g}" for k in best]
                except ValueError:   # no validation metric per evaluation: no best-validation point
                    at_best = [""] * len(best)
                w.writerow([g.label, r.cfg.get("seed", 0), r.cfg["optim"]["lr"],
                            *(f"{final(r, k):.6g}" for k in keys), *at_best,
                            f"{float(r.summary.get('samples_per_s') or 0.0):.6g}", converged(r)])
    return path


CURVE_KEYS = ("test_accuracy", "test_loss", "val_accuracy", "val_loss", "train_loss")


def write_curves(ctx: Context) -> Path | None:
    """Every evaluation of every run, per seed (curves.csv), and each run's provenance (provenance.csv:
    its folder, code version, when it was made, the CPU kernels): the data behind every curve and
    verdict, small enough to commit (no parameters), so a reader can recompute any figure."""
    if not ctx.groups:
        return None
    with open(ctx.out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "seed", "lr", "version", "samples", "elapsed_s", *CURVE_KEYS])
        for g in ctx.groups.values():
            for r in g.runs:
                for e in r.evals:
                    w.writerow([g.label, r.cfg.get("seed", 0), r.cfg["optim"]["lr"], e["version"], e.get("samples", ""),
                                f"{e.get('elapsed_s', float('nan')):.4f}",
                                *(f"{e[k]:.6g}" if e.get(k) is not None else "" for k in CURVE_KEYS)])
    with open(ctx.out / "provenance.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "seed", "lr", "folder", "code_version", "made_at", "cpu_kernels"])
        for g in ctx.groups.values():
            for r in g.runs:
                folder = Path(r.cfg.get("out", ""))
                made = _provenance(folder)
                w.writerow([g.label, r.cfg.get("seed", 0), r.cfg["optim"]["lr"], folder.name,
                            made.get("code_version", ""), made.get("made_at", ""), made.get("cpu_kernels", "")])
    return ctx.out / "curves.csv"


def _provenance(folder: Path) -> dict:
    path = folder / "provenance.json"   # written by the suite beside each run it made
    return json.loads(path.read_text()) if path.exists() else {}


def body(ctx: Context, text: str, verdict: V.Verdict) -> str:
    parts = []
    finals = write_finals(ctx)
    curves = write_curves(ctx)
    if ctx.groups:
        first = next(iter(ctx.groups.values()))
        scoring, val_key = scoring_of(ctx.exp)
        finals_are = (f"mean of the last {LAST_K} evaluations per seed (scored at the end of the budget)"
                      if scoring == "end" else
                      f"per seed, the test figure at the evaluation of best {val_key.replace('_', ' ')} (scored at "
                      "the best validation point, as early stopping reads a run)")
        parts.append(f"**Setup** (from the run configs): {setup(first.cfg, ctx.params.get('vary', ()))}. "
                     f"Final figures: {finals_are}, on one grid of training samples "
                     f"for every run; intervals: Student t 95% over seeds, differences paired by seed. Converged: "
                     f"the last {LAST_K} evaluations "
                     f"moved less than {PLATEAU} from the {LAST_K} before.")
    if ctx.chosen:
        parts.append(tuning_table(ctx))
    parts.append(text)
    if finals is not None:
        parts.append(f"Every run's per-seed finals: [`{ctx.exp.id}/finals.csv`]({ctx.exp.id}/finals.csv)"
                     + (f"; every evaluation of every seed: [`{ctx.exp.id}/curves.csv`]({ctx.exp.id}/curves.csv), and "
                        f"each run's provenance: [`{ctx.exp.id}/provenance.csv`]({ctx.exp.id}/provenance.csv)."
                        if curves is not None else "."))
    parts.append(f"**Verdict rule.** {verdict.reason}.")
    return "\n\n".join(parts)


def tuning_table(ctx: Context) -> str:
    """The validation score of every point of every sweep (accuracy, or loss with [tune] metric =
    "val_loss": the scores hold minus the loss, shown as the loss), and the rate chosen."""
    exp = ctx.exp
    loss = getattr(exp, "tune_metric", "val_accuracy") == "val_loss"
    sign = -1.0 if loss else 1.0
    rows = []
    added = getattr(exp, "tune_added", {}) or {}
    for t in exp.templates:
        if not t.lr_grid:
            continue
        cells = []
        for lr in t.lr_grid:
            v = [x for x in ctx.scores.get((t.label, lr), []) if x == x]
            text = f"{sign * np.mean(v):.3f}" if v else "diverged"
            text += "+" if lr in added.get(t.label, ()) else ""   # a rate the sweep added past the file's grid
            cells.append(f"**{lr:g}: {text}**" if ctx.chosen.get(t.label) == lr else f"{lr:g}: {text}")
        edge = ctx.chosen[t.label] in (min(t.lr_grid), max(t.lr_grid))
        rows.append([t.label, ", ".join(cells), f"{ctx.chosen[t.label]:g}" + (" (edge of the grid)" if edge else "")])
    derived = [f"{t.label} uses {t.lr_from}'s rate" + (f" x {t.lr_factor:g}" if t.lr_factor != 1 else "")
               for t in exp.templates if t.lr_from]
    what = "validation loss" if loss else "validation accuracy"
    text = (f"**Learning rates**, tuned per run on the validation split (mean {what} of the last "
            f"{exp.tune_last_k} evaluations, mean over the tuning seeds{', the lowest wins' if loss else ''}, tuning "
            f"seed{'s' * (len(exp.tune_seeds) > 1)} "
            f"{', '.join(map(str, exp.tune_seeds))}; the test set is not used):\n\n"
            + table(["run", f"lr: {what}", "chosen"], rows))
    if derived:
        text += "\n\n" + "; ".join(derived) + "."
    if added:
        text += ("\n\n+: a rate the sweep added, one step past the end of the file's grid where the pick sat at "
                 "that end (psgd/lab/tuning.py), until the pick was inside.")
    if any("edge of the grid" in r[2] for r in rows):
        text += ("\n\nA rate still at the edge of its grid (after the rates the sweep may add, at most "
                 "3 past an end) may not be the best one: the optimum can lie beyond it.")
    return text


def acc_ci(g: Group) -> stats.Interval:
    return g.ci("test_accuracy")


def diff(a: Group, b: Group, key: str = "test_accuracy") -> stats.Interval:
    """mean(a) - mean(b) of the finals: seed by seed when both arms ran the same seeds (paired:
    the same initialisation and data order in both), else Welch's interval."""
    return stats.diff_ci(a.finals(key), b.finals(key), paired=a.seeds == b.seeds)


@dataclass(frozen=True)
class NoiseFloor:
    """How far two identical algorithms land apart in final test accuracy: `diff`, the paired t
    interval of a - b over seeds, for the labels `pair` of `experiment`. Its `value` is the
    interval's larger end in absolute value: a difference no bigger than it is what identical
    algorithms show, so no accuracy margin is set below it (psgd/lab/verdicts.py noise_floor)."""
    experiment: str
    pair: tuple[str, str]
    diff: stats.Interval

    @property
    def value(self) -> float:
        return max(abs(self.diff.lo), abs(self.diff.hi), abs(self.diff.estimate))


def noise_floor_of(exp, summaries: list) -> NoiseFloor | None:
    """The noise floor an experiment measures, when its [params] name the pair (`noise_floor =
    ["sync", "allreduce"]`) and both ran; else None."""
    pair = exp.params.get("noise_floor")
    if not pair or not summaries:
        return None
    if len(pair) != 2:
        raise ValueError(f"{exp.path}: params.noise_floor names two labels (two identical algorithms), got {pair!r}")
    groups = groups_of(summaries, *scoring_of(exp))
    if not all(label in groups for label in pair):
        return None
    return NoiseFloor(exp.id, (pair[0], pair[1]), diff(groups[pair[0]], groups[pair[1]]))


def series_of(groups: list[Group], names: list[str] | None = None) -> list[plots.Series]:
    """A series per group, coloured by its mode ("local" for local SGD); sync with backup workers
    takes a variant colour (1 + its backup count), so it never hides under plain sync's curve, and so
    does a second arm of a mode already drawn (E1's sync, "sync, 4 x 8" and one worker: three colours)."""
    out, taken, variants = [], set(), 0
    for i, g in enumerate(groups):
        name = names[i] if names else g.label
        backup = g.cfg.get("backup_workers", 0) if g.mode == "sync" else 0
        mode = g.mode if g.cfg.get("local_steps", 1) == 1 else "local"
        if backup:
            out.append(plots.Series(name, "", g.runs, variant=backup))
        elif mode in taken:
            variants += 1
            out.append(plots.Series(name, "", g.runs, variant=3 + variants))  # past the backup arms' 1-2
        else:
            taken.add(mode)
            out.append(plots.Series(name, mode, g.runs))
    return out


def variant_series(groups: list[Group]) -> list[plots.Series]:
    return [plots.Series(g.label, "", g.runs, variant=i) for i, g in enumerate(groups)]




# -- time to a target accuracy (DAWNBench's metric) ------------------------------------------------
def seconds_to(g: Group, target: float, key: str = "test_accuracy") -> list[float]:
    """Per seed, seconds of steady-state training until `key` first reached `target` (inf: never)."""
    return [time_to(r, target, key) for r in g.runs]


def speedup_to(slow: Group, fast: Group, target: float) -> tuple[stats.Interval, int]:
    """(slow's seconds to `target` over fast's, paired by seed over the seeds where both reached
    it; how many seeds did not). Fewer than 2 pairs: an interval that decides nothing (n = 0)."""
    both = [(a, b) for a, b in zip(seconds_to(slow, target), seconds_to(fast, target), strict=True)
            if math.isfinite(a) and math.isfinite(b)]
    missed = len(slow.runs) - len(both)
    if len(both) < 2:
        return stats.Interval(float("nan"), -math.inf, math.inf, 0), missed
    return stats.ratio_ci([a for a, _ in both], [b for _, b in both]), missed
