"""Intervals over seeds: Student t intervals of a mean, of a paired (or Welch) difference, of a ratio.

Contract: every function takes plain sequences of per-seed numbers and returns an `Interval`
(estimate, lo, hi) at 95% by default; with one value there is no interval: its ends are nan (never
a zero-width interval that a rule could read as certain; `Interval.n` says so, and the report
prints the estimate alone).

- `mean_ci`: mean +- t(n-1) x sd / sqrt(n).
- `diff_ci(a, b, paired=True)`: arms run on the same seeds (the same initialisation and data order
  in both arms of a seed, which the suite gives every arm) are compared seed by seed: the t
  interval of the per-seed differences, which removes what the seeds share. Unequal seed counts (or
  paired=False): Welch's interval with the Welch-Satterthwaite degrees of freedom.
- `ratio_ci(a, b)`: for positive quantities (throughputs, times): the t interval of the per-seed
  log ratios (paired) or of log a - log b (Welch), exponentiated: a ratio's interval.
- `gap_closed_ci`, `recovered_ci`, `avoided_ci`: ratios of differences of three (four) arms, from the paired per-seed
  values when the arms share their seeds (a t interval of the per-seed ratio), else a percentile
  bootstrap (Efron & Tibshirani 1993, ch. 13) from a fixed seed.

Why t and not the percentile bootstrap this module used before: with 3 seeds the percentile
interval of a mean is [min, max] of the seeds (3 values give at most 10 distinct resampled
means), which covers a normal mean only about 75% of the time; the t interval covers 95% at
every n by construction for normal data, and tests/test_stats.py checks both figures by
simulation. Accuracies are bounded and a diverged seed is an outlier, so the report also says
how many seeds converged; an interval never hides that.

Pure: numpy and scipy.stats (for t quantiles), no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _scipy

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


def _no_interval(estimate: float, n: int) -> Interval:
    """One value: the estimate without an interval (nan ends, so no rule reads it as certain)."""
    return Interval(estimate, float("nan"), float("nan"), n)


def _percentiles(samples: np.ndarray, estimate: float, n: int, level: float) -> Interval:
    if n <= 1:
        return _no_interval(estimate, n)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return Interval(estimate, float(lo), float(hi), n)


def _t(mean: float, se: float, df: float, n: int, level: float) -> Interval:
    if n <= 1 or not math.isfinite(se):
        return _no_interval(mean, n)
    half = float(_scipy.t.ppf(0.5 + level / 2, df)) * se
    return Interval(mean, mean - half, mean + half, n)


def mean_ci(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of the values and its t interval."""
    a = _clean(values)
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else float("nan")
    return _t(float(a.mean()), se, a.size - 1, a.size, level)


POWER_FLOOR = 8   # the fewest seeds the power rule asks for where seeds are the replicates


def spread_of(ci: Interval, level: float = LEVEL) -> float | None:
    """The seed-to-seed standard deviation behind a t interval, read back from its half-width
    (sd = half-width x sqrt(n) / t(n-1)); for an asymmetric interval (a ratio's) the mean of its two
    half-widths. None where it cannot be read: fewer than 2 seeds, a non-finite or zero-width interval."""
    finite = all(math.isfinite(v) for v in (ci.estimate, ci.lo, ci.hi))
    if ci.n < 2 or not finite or ci.hi <= ci.lo:
        return None
    return (ci.hi - ci.lo) / 2 * math.sqrt(ci.n) / float(_scipy.t.ppf(0.5 + level / 2, ci.n - 1))


def half_width(sd: float, n: int, level: float = LEVEL) -> float:
    """The half-width of a t interval of a mean of n values with standard deviation sd."""
    return float(_scipy.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)


def seeds_for_margin(ci: Interval, margin: float, level: float = LEVEL, least: int = POWER_FLOOR,
                     most: int = 1000) -> int | None:
    """The power rule: the smallest n with t(0.975, n-1) x sd / sqrt(n) <= margin / 2, sd the
    seed-to-seed spread measured (`spread_of`), and at least `least` (POWER_FLOOR where seeds are
    the replicates; 2 gives the rule's own n). An interval that narrow decides the claim whichever
    side of the margin the estimate lands on, so n is fixed before the seeds are run, not chosen
    after. `most` + 1 where more than `most` would be needed; None where the spread cannot be read
    or the margin is not positive (no smallest effect of interest: nothing to size)."""
    sd = spread_of(ci, level)
    if sd is None or not margin > 0:
        return None
    for n in range(max(2, least), most + 1):
        if half_width(sd, n, level) <= margin / 2:
            return n
    return most + 1


def welch_ci(a_values: Sequence[float], b_values: Sequence[float], level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) of independent groups: Welch's t interval."""
    a, b = _clean(a_values), _clean(b_values)
    n = min(a.size, b.size)
    if n <= 1:
        return _no_interval(float(a.mean() - b.mean()), n)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)) if va + vb > 0 else 1.0
    return _t(float(a.mean() - b.mean()), se, df, n, level)


def diff_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL, paired: bool = True) -> Interval:
    """mean(a) - mean(b): per-seed differences when paired (same seeds, same order, same count),
    else Welch's interval (see the module docstring)."""
    if paired and len(a) == len(b):
        return mean_ci(_clean(a) - _clean(b), level)
    return welch_ci(a, b, level)


def ratio_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL, paired: bool = True) -> Interval:
    """mean(a) / mean(b), for positive quantities: the interval of the log ratio, exponentiated."""
    x, y = _clean(a), _clean(b)
    estimate = float(x.mean() / y.mean()) if y.mean() != 0 else float("nan")
    if not (np.all(x > 0) and np.all(y > 0)):
        return Interval(estimate, float("nan"), float("nan"), min(x.size, y.size))
    logs = diff_ci(np.log(x), np.log(y), level, paired)
    # The interval is of the geometric-mean ratio; centred on it, and reported beside the ratio of means.
    return Interval(estimate, math.exp(logs.lo), math.exp(logs.hi), logs.n)


def _paired_share(num: np.ndarray, den: np.ndarray, estimate: float, level: float) -> Interval | None:
    """The t interval of per-seed shares num / den, when every seed's denominator is clearly
    positive (else None: the ratio explodes and only the bootstrap below can say so)."""
    if num.size < 2 or not np.all(den > 0):
        return None
    shares = num / den
    ci = mean_ci(shares, level)
    return Interval(estimate, ci.lo, ci.hi, ci.n)


def gap_closed_ci(plain: Sequence[float], remedy: Sequence[float], reference: Sequence[float],
                  level: float = LEVEL) -> Interval:
    """(mean(remedy) - mean(plain)) / (mean(reference) - mean(plain)): the fraction of the gap
    between `plain` and `reference` that `remedy` closes (1: all of it; 0: none; < 0: it widens it).
    Three independent groups, each resampled on its own; meaningful only where the gap is clearly
    nonzero (a resampled gap near 0 makes the ratio explode, which the percentiles then show)."""
    p, r, ref = _clean(plain), _clean(remedy), _clean(reference)
    if p.size == r.size == ref.size:
        with np.errstate(divide="ignore", invalid="ignore"):
            paired = _paired_share(r - p, ref - p, float((r.mean() - p.mean()) / (ref.mean() - p.mean())), level)
        if paired is not None:
            return paired
    rng = np.random.default_rng(SEED)
    mp, mr, mref = (_resampled_means(a, rng) for a in (p, r, ref))
    with np.errstate(divide="ignore", invalid="ignore"):
        samples = (mr - mp) / (mref - mp)
        estimate = float((r.mean() - p.mean()) / (ref.mean() - p.mean()))
    return _percentiles(samples, estimate, min(p.size, r.size, ref.size), level)


def avoided_ci(base: Sequence[float], hurt: Sequence[float], remedy_base: Sequence[float],
               remedy_hurt: Sequence[float], level: float = LEVEL) -> Interval:
    """1 - (mean(remedy_base) - mean(remedy_hurt)) / (mean(base) - mean(hurt)): the share of a loss
    (base -> hurt, the plain arm without and with the fault) that the remedy does not suffer on its
    own footing (remedy_base -> remedy_hurt). 1: the fault costs the remedy nothing; 0: as much as
    the plain arm; unlike `recovered_ci` it is not inflated by a remedy that is faster anyway.
    Paired per seed where every group has one run per seed and every seed's loss is positive;
    otherwise the four groups are resampled on their own (a resample without a loss is left out)."""
    a, h, rb, rh = _clean(base), _clean(hurt), _clean(remedy_base), _clean(remedy_hurt)
    loss = a.mean() - h.mean()
    estimate = float(1.0 - (rb.mean() - rh.mean()) / loss) if loss > 0 else float("nan")
    if a.size == h.size == rb.size == rh.size and loss > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            paired = _paired_share((a - h) - (rb - rh), a - h, estimate, level)
        if paired is not None:
            return paired
    rng = np.random.default_rng(SEED)
    ma, mh, mrb, mrh = (_resampled_means(x, rng) for x in (a, h, rb, rh))
    with np.errstate(divide="ignore", invalid="ignore"):
        samples = 1.0 - (mrb - mrh) / (ma - mh)
    samples = samples[ma > mh]
    n = min(a.size, h.size, rb.size, rh.size)
    if samples.size == 0:
        return Interval(estimate, float("nan"), float("nan"), n)
    return _percentiles(samples, estimate, n, level)


def recovered_ci(base: Sequence[float], hurt: Sequence[float], remedy: Sequence[float],
                 level: float = LEVEL) -> Interval:
    """(mean(remedy) - mean(hurt)) / (mean(base) - mean(hurt)): the share of a loss (base -> hurt)
    that a remedy wins back; 1 = all of it, 0 = none, > 1 = more. Three independent groups, each
    resampled on its own; a resample whose loss is not positive has no share (left out)."""
    a, h, r = _clean(base), _clean(hurt), _clean(remedy)
    loss = a.mean() - h.mean()
    if a.size == h.size == r.size and loss > 0:
        paired = _paired_share(r - h, a - h, float((r.mean() - h.mean()) / loss), level)
        if paired is not None:
            return paired
    rng = np.random.default_rng(SEED)
    ma, mh, mr = (_resampled_means(x, rng) for x in (a, h, r))
    with np.errstate(divide="ignore", invalid="ignore"):
        samples = (mr - mh) / (ma - mh)
    samples = samples[ma > mh]
    estimate = float((r.mean() - h.mean()) / loss) if loss > 0 else float("nan")
    n = min(a.size, h.size, r.size)
    if samples.size == 0:
        return Interval(estimate, float("nan"), float("nan"), n)
    return _percentiles(samples, estimate, n, level)
