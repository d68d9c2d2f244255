"""A claim's verdict as the report states it: its rule's verdict, checked (verdict_checks), and read
again at its other scoring.

Contract (issue 57):
- `checked(verdict, exp)`: the rule's verdict with its margins checked against the experiment
  file's `[margin]` (a mismatch is a ValueError naming the file) and its accuracy margins against
  the noise floor in force (verdicts.noise_floor; verdict_checks.resolve).
- `at_other_scoring(fn, exp, summaries, chosen, scores)`: the same analysis `fn` on the same runs,
  scored the other way (best validation point <-> end of the budget), its figures drawn in a
  temporary folder and dropped: (its checked verdict or None, that scoring, why it is None).
- `judged(fn, exp, summaries, chosen, scores, verdict)`: the verdict the report states, both
  scorings combined (verdict_checks.both_scorings: "depends on scoring" where they differ); a
  benchmark, or a claim without runs, has one reading and is only checked.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from types import SimpleNamespace

from psgd.lab import figure_kit
from psgd.lab import verdict_checks as checks
from psgd.lab import verdicts as V
from psgd.lab.analysis_kit import Context

# What an analysis raises when its runs cannot be read at a scoring (no validation split, too few
# seeds for one of its figures): the reading is reported as not read, with the message.
UNREADABLE = (ValueError, KeyError, IndexError, ZeroDivisionError, FloatingPointError)


def checked(verdict: V.Verdict, exp) -> V.Verdict:
    checks.check_margins(verdict, getattr(exp, "margins", {}) or {}, str(getattr(exp, "path", exp.id)))
    return checks.resolve(verdict, V.current_floor())


def _with_scoring(exp, scoring: str):
    if dataclasses.is_dataclass(exp):
        return dataclasses.replace(exp, scoring=scoring)
    return SimpleNamespace(**{**vars(exp), "scoring": scoring})   # a test's stand-in


def _has_val_split(item) -> bool:
    """Whether one of an analysis's (spec, summary) pairs was made with a validation split; a stand-in
    without the field (a test's) is taken to have one."""
    summary = item[1] if isinstance(item, tuple) and len(item) == 2 else item
    data = (summary.get("config", {}) if isinstance(summary, dict) else {}).get("data", {})
    return bool(data.get("val_fraction", 1.0))


def at_other_scoring(fn, exp, summaries: list, chosen: dict, scores: dict) -> tuple[V.Verdict | None, str, str]:
    other = checks.other_scoring(getattr(exp, "scoring", "end"))
    if other == "best_val" and not any(_has_val_split(s) for s in summaries):
        # Not an error: a claim scored at the end on runs made without a validation split (E3's
        # map, say) has nothing to read at a best validation point.
        return None, other, "its runs have no validation split (val_fraction 0)"
    with tempfile.TemporaryDirectory() as tmp, figure_kit.numbers_only():  # its figures are thrown away
        try:
            verdict = fn(Context(_with_scoring(exp, other), summaries, Path(tmp), chosen, scores))[0]
        except UNREADABLE as e:
            return None, other, f"{type(e).__name__}: {e}"
    return checked(verdict, exp), other, ""


def judged(fn, exp, summaries: list, chosen: dict, scores: dict, verdict: V.Verdict) -> V.Verdict:
    main = checked(verdict, exp)
    if getattr(exp, "bench", "") or not summaries or main.outcome == V.NOT_TESTABLE:
        return main
    other, scoring, missing = at_other_scoring(fn, exp, summaries, chosen, scores)
    return checks.both_scorings(main, other, getattr(exp, "scoring", "end"), scoring, missing)
