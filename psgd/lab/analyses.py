"""Per-claim analyses: the figures, the numbers and the verdict of each experiment.

Contract: `analyse(exp, summaries, out, chosen, scores)` dispatches on `exp.analysis` to one
function of an analyses_*.py module, found by its ANALYSES (`registry`): psgd/lab/analyses_modes.py
(E0-E3), analyses_data.py (E6-E9), analyses_systems.py (E4, E5, E10), and one module per later
claim. Each draws its figures into `out` (PNG + CSV each, psgd/lab/plots.py), and returns a
`Section` whose verdict comes from a rule in psgd/lab/verdicts.py applied to the measured numbers
and their t intervals over seeds, paired by seed (psgd/lab/stats.py) — never written by hand.
Final figures are the mean of the last LAST_K evaluations of each seed (psgd/lab/results.py),
taken on the suite's common grid of training samples; "chosen" holds the learning rates picked on
the validation split.

Split-half stability (`split_half`): every claim with seeds is judged again on each half of them
(the first n // 2 and the last n // 2 in seed order; an odd count leaves the middle seed out of
both), by the same analysis and rule, where each half has at least 4 seeds (rule.HALF_SEEDS); a
claim whose halves come out confirmed and refuted is "unstable", and the report and summary.json
say so with both readings. Every verdict is checked and read at both scorings
(psgd/lab/readings.py). Power (psgd/lab/power.py): the seeds the power rule asks for, from the
parts' margins and the spread measured.
"""

from __future__ import annotations

import importlib
import pkgutil
import tempfile
from pathlib import Path

import psgd.lab
from psgd.lab import power, rule
from psgd.lab import readings as reread
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context, Needs, body
from psgd.lab.results import Finding, Section, load_run


def _seed_of(spec) -> int:
    seed = getattr(spec, "seed", None)
    return int(seed) if seed is not None else int(load_run(spec.cfg.out).cfg.get("seed", 0))


def halves_of(seeds: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(first half, second half, left out) of the seeds in seed order: the first n // 2 and the last
    n // 2, so both halves have as many seeds; with an odd count the middle seed is in neither."""
    seeds = sorted(set(seeds))
    h = len(seeds) // 2
    return seeds[:h], seeds[len(seeds) - h:], seeds[h:len(seeds) - h]


def split_half(fn, exp, summaries: list, chosen: dict, scores: dict) -> dict | None:
    """The claim's verdict on each half of its seeds (halves_of), by the same analysis and rule, with
    the same noise floor (measured on all seeds) and the same tuned rates; "unstable" when one half
    confirms what the other refutes. None for a claim without seeds to split (a benchmark, one seed)
    or whose halves would have fewer than rule.HALF_SEEDS seeds each (not judged).
    A half the analysis cannot read (too few seeds for one of its figures) is reported with its reason."""
    if not summaries:
        return None
    seed_of = [(_seed_of(spec), (spec, summ)) for spec, summ in summaries]
    first, second, left = halves_of([s for s, _ in seed_of])
    if not rule.halves_judged(len(first), len(second)):
        return None
    readings = {}
    for name, half in (("first", first), ("second", second)):
        subset = [pair for s, pair in seed_of if s in half]
        with tempfile.TemporaryDirectory() as tmp:   # a half's figures are drawn and dropped
            try:
                outcome = reread.checked(fn(Context(exp, subset, Path(tmp), chosen, scores))[0], exp).outcome
                reason = ""
            except (ValueError, KeyError, IndexError, ZeroDivisionError, FloatingPointError) as e:
                outcome, reason = "", f"{type(e).__name__}: {e}"
        readings[name] = {"seeds": half, "verdict": outcome, **({"error": reason} if reason else {})}
    pair = {readings["first"]["verdict"], readings["second"]["verdict"]}
    return {**readings, "left_out": left, "unstable": pair == {V.CONFIRMED, V.REFUTED}}


def registry() -> dict:
    """Every analysis by name: each psgd/lab/analyses_*.py module's ANALYSES, found
    by name, so that a new claim is its experiment file and one analysis module, touching no other.
    A name defined twice is an error, not a silent override."""
    table_: dict = {}
    for info in sorted(pkgutil.iter_modules(psgd.lab.__path__), key=lambda m: m.name):
        if not info.name.startswith("analyses_"):
            continue
        module = importlib.import_module(f"psgd.lab.{info.name}")
        for name, fn in getattr(module, "ANALYSES", {}).items():
            if name in table_:
                raise ValueError(f"analysis {name!r} is defined twice (psgd/lab/{info.name}.py and another module)")
            table_[name] = fn
    return table_


def needs() -> dict:
    """The runs each analysis reads by label (its module's NEEDS, analysis_kit.Needs), by name."""
    return {name: n for info in pkgutil.iter_modules(psgd.lab.__path__) if info.name.startswith("analyses_")
            for name, n in getattr(importlib.import_module(f"psgd.lab.{info.name}"), "NEEDS", {}).items()}


def missing_runs(exp) -> str:
    """Why `exp`'s analysis could not read its runs (a line naming the file), or "" when it can: checked
    before a suite runs anything, rather than found once the runs have finished. Any analysis reads
    the noise floor's pair ([params] noise_floor) when it is named."""
    if exp.analysis not in registry():
        return f"{exp.path}: unknown analysis {exp.analysis!r}; known: {', '.join(sorted(registry()))}"
    have = {t.label for t in exp.templates}
    for n in (needs().get(exp.analysis, Needs()), Needs(optional=("noise_floor",))):
        if problem := n.problem(exp.params, have):
            return f"{exp.path}: {problem} (its runs: {', '.join(sorted(have)) or 'none'})"
    return ""


def analyse(exp, summaries: list, out: Path, chosen: dict | None = None, scores: dict | None = None) -> Section:
    table_ = registry()
    fn = table_.get(exp.analysis)
    if fn is None:
        raise ValueError(f"{exp.path}: unknown analysis {exp.analysis!r}; known: {', '.join(sorted(table_))}")
    ctx = Context(exp, summaries, out, chosen or {}, scores or {})
    verdict, headline, text, figures, key = Finding(*fn(ctx))  # a Finding, or an older analysis's 5-tuple
    verdict = reread.judged(fn, exp, summaries, chosen or {}, scores or {}, verdict)   # checked, both scorings
    bench = bool(getattr(exp, "bench", ""))
    halves = split_half(fn, exp, summaries, chosen or {}, scores or {}) if not bench else None
    pw = power.claim_power(verdict.effects, bench, getattr(exp, "margin_why", ""))
    return Section(exp.id, exp.title, exp.claim, exp.quote, verdict.outcome, headline,
                   body(ctx, text, verdict), figures, key, exp.why, quote_en=exp.quote_en,
                   quote_source=exp.quote_source, effects=verdict.effects, halves=halves, power=pw,
                   scoring="" if bench else getattr(exp, "scoring", "end"),
                   by_construction=getattr(exp, "by_construction", ""))
