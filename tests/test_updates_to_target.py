"""Updates to a target (psgd/lab/updates_to_target.py): crossings interpolated between evaluations,
slowdowns paired by seed, and a rule that can come out either way."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from psgd.lab import updates_to_target as U
from psgd.lab import verdicts as V


def curve(*points, key="test_accuracy"):
    return [{"samples": s, key: v} for s, v in points]


def test_a_crossing_is_interpolated_between_the_evaluations_around_it():
    evals = curve((0, 0.1), (100, 0.3), (200, 0.5), (300, 0.45))
    assert U.samples_to(evals, 0.4, "test_accuracy") == pytest.approx(150.0)
    assert U.samples_to(evals, 0.3, "test_accuracy") == 100.0        # reached exactly at an evaluation
    assert U.samples_to(evals, 0.6, "test_accuracy") == math.inf      # never
    loss = curve((0, 4.0), (100, 3.0), (200, 2.0), key="test_loss")
    assert U.samples_to(loss, 2.5, "test_loss", lower=True) == pytest.approx(150.0)
    assert U.samples_to(loss, 2.5, "test_loss") == 0.0                # read the wrong way, 4.0 >= 2.5 at once
    # A non-finite evaluation (a diverged point) is no end of a straight line.
    assert U.samples_to(curve((0, 0.1), (100, math.nan), (200, 0.5)), 0.4, "test_accuracy") == 200.0


def group(*curves):
    return SimpleNamespace(runs=[SimpleNamespace(evals=c) for c in curves])


def test_slowdowns_pair_by_seed_and_a_seed_that_never_reaches_is_no_pair():
    control = group(curve((0, 0.0), (100, 0.5)), curve((0, 0.0), (100, 0.5)))
    stale = group(curve((0, 0.0), (300, 0.5)), curve((0, 0.0), (300, 0.4)))
    assert U.slowdowns(control, stale, 0.5, "test_accuracy")[0] == pytest.approx(3.0)
    assert math.isnan(U.slowdowns(control, stale, 0.5, "test_accuracy")[1])
    # Fewer than two seeds reached it in both: no interval, and so no verdict.
    ci = U.ratio_of_slowdowns([3.0, math.nan], [1.5, 1.5])
    assert ci.n == 0
    assert U.judge({("async", 0.5): ci}, 0.2, "plain SGD").outcome == V.INCONCLUSIVE


@pytest.mark.parametrize("adam, outcome", [([3.0, 3.3, 3.1], V.CONFIRMED), ([1.5, 1.6, 1.55], V.REFUTED),
                                           ([1.0, 3.0, 2.0], V.INCONCLUSIVE)])
def test_the_rule_holds_adams_slowdown_against_the_bases_at_one_plus_the_margin(adam, outcome):
    ci = U.ratio_of_slowdowns(adam, [1.5, 1.55, 1.5])
    v = U.judge({("async", 0.5): ci, ("async", 0.55): ci}, 0.2, "plain SGD")
    assert v.outcome == outcome, v.reason
    assert all(e.unit == V.RATIO and e.null == 1.0 and e.margin == 0.2 for e in v.effects)
    assert "(margin 1.2x)" in v.reason


def test_a_loss_keeps_the_targets_every_arm_gets_below():
    assert U.kept_targets([3.4, 3.2, 3.0], {"a": 2.2, "b": 3.1}, lower=True) == ((3.2, 3.4), (3.0,))
    assert U.kept_targets([0.45, 0.5, 0.6], {"a": 0.62, "b": 0.58}, lower=False) == ((0.45, 0.5), (0.6,))
