"""Updates to a target: Dai et al.'s second measure of what staleness costs an optimizer (E16, E17).

A fixed budget asks how far each arm got; this asks how many more updates a stale arm needs than its
one-worker control to reach the same target, with each optimizer, over a range of targets stated in
the experiment file before the runs (`[params] targets`, psgd/lab/targets.py) and kept where every
arm reaches them on average. Every arm of these claims takes the same batch per update, so samples
to the target are updates to it.

Contract (issue 57):
- `samples_to(evals, target, key, lower)`: the samples at which `key` first reached `target` (at or
  above it; at or below where `lower`, a loss), linearly interpolated between the two evaluations
  around the crossing (so a grid of evaluations does not round every crossing up to its next point);
  inf where it never did.
- `slowdowns(control, stale, target, key, lower)`: per seed, the stale arm's samples to the target
  over its control's (nan where either never reached it).
- `ratio_of_slowdowns(adam, base)`: AdamW's slowdown over the base optimizer's, paired by seed over
  the seeds where both reached the target: the t interval of the per-seed log ratio, exponentiated
  (stats.ratio_ci); fewer than 2 such seeds: no interval (n = 0, never a verdict).
- `kept_targets(targets, plateaus, lower)`: targets.py's split, for a loss too (a target is kept
  where every arm's final loss is below it).
- `judge(parts, margin)`: the claim "staleness slows AdamW more than the base, by more than `margin`
  (a ratio of slowdowns above 1 + margin)", one `verdicts.part` per (stale arm, target), combined
  over the range (targets.over_range) and the arms.
Pure: no I/O; the Groups are psgd/lab/results.py's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from psgd.lab import stats
from psgd.lab import targets as T
from psgd.lab import verdicts as V


def samples_to(evals: Sequence[Mapping], target: float, key: str, lower: bool = False) -> float:
    """Samples until `key` first reached `target` (see the contract); inf: never."""
    prev = None
    for e in evals:
        v, s = e.get(key), e.get("samples")
        if v is None or s is None or not math.isfinite(float(v)):
            prev = None
            continue
        v, s = float(v), float(s)
        if (v <= target) if lower else (v >= target):
            if prev is None or v == target:
                return s
            # The straight line between the last evaluation short of the target and this one.
            return prev[0] + (s - prev[0]) * (target - prev[1]) / (v - prev[1])
        prev = (s, v)
    return math.inf


def slowdowns(control, stale, target: float, key: str, lower: bool = False) -> list[float]:
    """Per seed (the two Groups pair by seed): stale's samples to `target` over control's."""
    out = []
    for c, s in zip(control.runs, stale.runs, strict=True):
        a, b = samples_to(s.evals, target, key, lower), samples_to(c.evals, target, key, lower)
        out.append(a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan)
    return out


def ratio_of_slowdowns(adam: Sequence[float], base: Sequence[float]) -> stats.Interval:
    both = [(a, b) for a, b in zip(adam, base, strict=True) if math.isfinite(a) and math.isfinite(b)]
    if len(both) < 2:
        return stats.Interval(math.nan, -math.inf, math.inf, 0)
    return stats.ratio_ci([a for a, _ in both], [b for _, b in both])


def kept_targets(targets: Sequence[float], plateaus: Mapping[str, float], lower: bool) -> tuple[tuple, tuple]:
    """(targets every arm reaches on average, those left out): targets.split_by_plateau, mirrored for a loss."""
    if not lower:
        kept, dropped = T.split_by_plateau(targets, plateaus)
        return tuple(sorted(kept)), tuple(sorted(dropped))
    kept, dropped = T.split_by_plateau([-t for t in targets], {k: -v for k, v in plateaus.items()})
    return tuple(sorted(-t for t in kept)), tuple(sorted(-t for t in dropped))


def judge(parts: Mapping[tuple[str, float], stats.Interval], margin: float, base: str) -> V.Verdict:
    """`parts`: (stale arm, target) -> AdamW's slowdown over `base`'s; see the contract."""
    effects = tuple(V.part(f"AdamW's slowdown to {t:g} / {base}'s ({arm})", ci, margin, "effect", V.RATIO, null=1.0)
                    for (arm, t), ci in parts.items())
    by_arm: dict[str, list[str]] = {}
    for (arm, _), e in zip(parts, effects, strict=True):
        by_arm.setdefault(arm, []).append(e.outcome)
    outcome = V.combine([T.over_range(o) for o in by_arm.values()])
    reason = "; ".join(f"{arm} at {t:g}: {ci.fmt(2)}x" for (arm, t), ci in parts.items())
    return V.Verdict(outcome, f"AdamW's slowdown in updates to the target over {base}'s: {reason} "
                              f"(margin {1 + margin:g}x)", effects)
