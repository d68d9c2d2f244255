"""The symmetric three-way rule: one part of a claim, judged from its interval and a margin fixed
before the runs.

Contract (issue 57):
- `effect(ci, margin)`, the claim "the effect exceeds the margin": confirmed when the whole interval
  lies beyond the margin (lo > margin), refuted when the whole interval lies short of it (hi <
  margin), inconclusive otherwise. The estimate decides nothing on its own: the two outcomes are
  mirror images, so neither is easier to reach than the other.
- `no_worse(ci, margin)`, the claim "the change costs less than the margin" (ci = new - old): a
  one-sided equivalence (non-inferiority) test with its bound -margin stated: confirmed when the
  whole interval lies above -margin, refuted when it lies wholly below, inconclusive across it.
- No interval, and no verdict, from fewer than `MIN_SEEDS` (2) seeds, nor from an interval whose
  ends are not finite: such a part is inconclusive ("no interval"), whatever its estimate.
- `halves_judged(first, second)`: split halves are judged only where each half has at least
  `HALF_SEEDS` (4) seeds; fewer give intervals too wide (t(0.975, 2) = 4.3) to read as a check.
- `resolvable(margin, floor)`: the measured noise floor is checked against a margin, never
  substituted for it; a margin below the floor is below what the setup can resolve.
- `bound_text(test, margin, null)`: how the report states the bound a part is held against.

Pure: no I/O, no numpy; the outcomes are the strings psgd/lab/verdicts.py names.
"""

from __future__ import annotations

import math

CONFIRMED, REFUTED, INCONCLUSIVE = "confirmed", "refuted", "inconclusive"
MIN_SEEDS = 2     # the fewest seeds behind an interval (and so behind a verdict)
HALF_SEEDS = 4    # the fewest seeds in each half for split halves to be judged
TESTS = ("effect", "no_worse")


def has_interval(ci) -> bool:
    """Whether `ci` (a stats.Interval) is an interval at all: at least MIN_SEEDS seeds and finite ends."""
    return ci.n >= MIN_SEEDS and all(math.isfinite(v) for v in (ci.lo, ci.hi))


def effect(ci, margin: float) -> str:
    """The claim "the effect exceeds `margin`": the whole interval beyond it, or wholly short of it."""
    if not has_interval(ci):
        return INCONCLUSIVE
    if ci.lo > margin:
        return CONFIRMED
    if ci.hi < margin:
        return REFUTED
    return INCONCLUSIVE


def no_worse(ci, margin: float) -> str:
    """The claim "new - old stays above -`margin`" (non-inferiority, bound -margin)."""
    if not has_interval(ci):
        return INCONCLUSIVE
    if ci.lo > -margin:
        return CONFIRMED
    if ci.hi < -margin:
        return REFUTED
    return INCONCLUSIVE


def judge(ci, margin: float, test: str) -> str:
    """`effect` or `no_worse` by name (a part's `test`)."""
    if test not in TESTS:
        raise ValueError(f"a part's test is one of {', '.join(TESTS)}, got {test!r}")
    return effect(ci, margin) if test == "effect" else no_worse(ci, margin)


def decision_point(test: str, margin: float, null: float = 0.0) -> float:
    """The value an inconclusive part's interval straddles, on the part's own scale: null + margin
    for an effect (both outcomes are decided there), null - margin for "no worse"."""
    return null + margin if test == "effect" else null - margin


def halves_judged(first: int, second: int) -> bool:
    """Split halves are judged only where each half has at least HALF_SEEDS seeds."""
    return min(first, second) >= HALF_SEEDS


def resolvable(margin: float, floor: float) -> bool:
    """Whether a margin is at or above the measured noise floor (a floor of 0: none measured)."""
    return not floor > margin


def bound_text(test: str, margin: float, null: float = 0.0) -> str:
    """"above 0.01" / "above -0.01 (non-inferiority)" / "above 1.1": the bound a part is held to."""
    if test == "effect":
        return f"whole interval above {null + margin:g}"
    return f"whole interval above {null - margin:g} (one-sided equivalence, bound {null - margin:g})"
