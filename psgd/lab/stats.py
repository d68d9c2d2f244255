"""Intervals over seeds: percentile bootstrap of a mean, a difference of means, a ratio of means.

Contract: every function takes plain sequences of per-seed numbers and returns an `Interval`
(estimate, lo, hi) at 95% by default. The bootstrap resamples each group with replacement
(Efron & Tibshirani 1993, ch. 13, the percentile interval) from a fixed seed, so a report is
reproducible bit for bit. With one value per group there is nothing to resample: the interval
is the point itself and `Interval.n` says so (the report prints "1 seed, no interval").

Why a bootstrap and not a t interval: accuracies are bounded and a diverged run is an outlier,
so normality is a poor guess with 3-5 seeds; the bootstrap makes no such assumption. With so
few seeds it is still coarse (3 values give at most 10 distinct resampled means): read the
interval as "how much the seeds disagree", and run `--full` (5 seeds) for a tighter one.

Pure: numpy only, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
RESAMPLES = 4000
SEED = 20261130


@dataclass(frozen=True)
class Interval:
    estimate: float
    lo: float
    hi: float
    n: int = 0          # seeds behind it (the smaller group for a difference or ratio)

    def fmt(self, digits: int = 3, signed: bool = False) -> str:
        sign = "+" if signed else ""
        if self.n <= 1 or not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return f"{self.estimate:{sign}.{digits}f}"
        return f"{self.estimate:{sign}.{digits}f} [{self.lo:{sign}.{digits}f}, {self.hi:{sign}.{digits}f}]"

    def straddles(self, value: float) -> bool:
        return self.lo <= value <= self.hi


def _clean(values: Sequence[float]) -> np.ndarray:
    a = np.asarray([float(v) for v in values], dtype=np.float64)
    if a.size == 0:
        raise ValueError("an interval needs at least one value")
    return a


def _resampled_means(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    idx = rng.integers(0, a.size, size=(RESAMPLES, a.size))
    return a[idx].mean(axis=1)


def _percentiles(samples: np.ndarray, estimate: float, n: int, level: float) -> Interval:
    if n <= 1:
        return Interval(estimate, estimate, estimate, n)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return Interval(estimate, float(lo), float(hi), n)


def mean_ci(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of the values and its bootstrap interval."""
    a = _clean(values)
    rng = np.random.default_rng(SEED)
    return _percentiles(_resampled_means(a, rng), float(a.mean()), a.size, level)


def _two(a_values: Sequence[float], b_values: Sequence[float], combine: Callable[[np.ndarray, np.ndarray], np.ndarray],
         level: float) -> Interval:
    a, b = _clean(a_values), _clean(b_values)
    rng = np.random.default_rng(SEED)
    samples = combine(_resampled_means(a, rng), _resampled_means(b, rng))
    estimate = float(combine(np.array([a.mean()]), np.array([b.mean()]))[0])
    return _percentiles(samples, estimate, min(a.size, b.size), level)


def diff_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """mean(a) - mean(b): independent groups (different runs), each resampled on its own."""
    return _two(a, b, lambda x, y: x - y, level)


def ratio_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """mean(a) / mean(b), for positive quantities (throughputs, times)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _two(a, b, lambda x, y: x / y, level)


def gap_closed_ci(plain: Sequence[float], remedy: Sequence[float], reference: Sequence[float],
                  level: float = LEVEL) -> Interval:
    """(mean(remedy) - mean(plain)) / (mean(reference) - mean(plain)): the fraction of the gap
    between `plain` and `reference` that `remedy` closes (1: all of it; 0: none; < 0: it widens it).
    Three independent groups, each resampled on its own; meaningful only where the gap is clearly
    nonzero (a resampled gap near 0 makes the ratio explode, which the percentiles then show)."""
    p, r, ref = _clean(plain), _clean(remedy), _clean(reference)
    rng = np.random.default_rng(SEED)
    mp, mr, mref = (_resampled_means(a, rng) for a in (p, r, ref))
    with np.errstate(divide="ignore", invalid="ignore"):
        samples = (mr - mp) / (mref - mp)
        estimate = float((r.mean() - p.mean()) / (ref.mean() - p.mean()))
    return _percentiles(samples, estimate, min(p.size, r.size, ref.size), level)


def recovered_ci(base: Sequence[float], hurt: Sequence[float], remedy: Sequence[float],
                 level: float = LEVEL) -> Interval:
    """(mean(remedy) - mean(hurt)) / (mean(base) - mean(hurt)): the share of a loss (base -> hurt)
    that a remedy wins back; 1 = all of it, 0 = none, > 1 = more. Three independent groups, each
    resampled on its own; a resample whose loss is not positive has no share (left out)."""
    a, h, r = _clean(base), _clean(hurt), _clean(remedy)
    rng = np.random.default_rng(SEED)
    ma, mh, mr = (_resampled_means(x, rng) for x in (a, h, r))
    with np.errstate(divide="ignore", invalid="ignore"):
        samples = (mr - mh) / (ma - mh)
    samples = samples[ma > mh]
    loss = a.mean() - h.mean()
    estimate = float((r.mean() - h.mean()) / loss) if loss > 0 else float("nan")
    n = min(a.size, h.size, r.size)
    if samples.size == 0:
        return Interval(estimate, float("nan"), float("nan"), n)
    return _percentiles(samples, estimate, n, level)
