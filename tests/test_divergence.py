"""psgd/train/divergence.py: the rising-loss warning judges a curve, not its noise."""

import math
import random

from psgd.train.divergence import MIN_STEPS, rise


def _curve(n, f, noise=0.05, seed=0):
    g = random.Random(seed)
    return [max(0.0, f(i / n) + g.gauss(0, noise)) for i in range(n)]


def test_a_loss_that_falls_then_rises_is_caught_with_where_it_was_lowest():
    # The shape of a 30,000-step async run at the default rate: 0.12 at a tenth, 2.1 at the end.
    r = rise(_curve(30000, lambda t: 2.3 * math.exp(-30 * t) + 0.12 + 2.0 * max(0.0, t - 0.1) ** 1.5 / 0.9 ** 1.5))
    assert r is not None and r.last > 1.9 and r.low < 0.25 and r.at < 0.3
    assert "0.1" in r.message() and "--lr" in r.message()


def test_a_converging_or_plateaued_noisy_loss_is_not():
    assert rise(_curve(30000, lambda t: 2.3 * math.exp(-10 * t) + 0.3, noise=0.3)) is None
    assert rise(_curve(30000, lambda t: 0.4, noise=0.4)) is None


def test_a_rise_below_the_absolute_floor_or_a_short_run_is_not_judged():
    assert rise(_curve(30000, lambda t: 0.01 + 0.03 * t, noise=0.0)) is None  # 3x, but only 0.03 above
    assert rise([0.1] * (MIN_STEPS // 2) + [5.0] * (MIN_STEPS // 2 - 1)) is None
