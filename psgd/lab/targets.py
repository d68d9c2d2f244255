"""Time to a target as a curve: the range of targets a time-to-accuracy claim is judged over, stated
in its experiment file before the runs, and kept below every arm's plateau.

Contract (issue 57):
- `targets_of(params)`: `[params] targets = [...]` (the range, in advance), else the one
  `target_accuracy` (an older file: a range of one).
- `split_by_plateau(targets, plateaus)`: (the targets below every arm's plateau, those at or above
  the lowest): a target an arm does not reach on average measures its plateau, not its speed, so
  such a target is left out of the verdict and named.
- `over_range(outcomes)`: one check's outcome over the range: all targets agree -> that outcome;
  any inconclusive -> inconclusive; confirmed at some and refuted at others -> depends (on the
  target), as verdicts.combine.
- `range_text(targets, dropped, plateaus, lower)`: the report's sentence on the range (in nats
  where `lower`: the targets are losses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from psgd.lab import verdicts as V


def targets_of(params: Mapping) -> tuple[float, ...]:
    raw = params.get("targets")
    if raw is None:
        return (float(params.get("target_accuracy", 0.6)),)
    if not isinstance(raw, list) or not raw or not all(isinstance(t, (int, float)) for t in raw):
        raise ValueError(f"[params] targets must be a non-empty list of accuracies, got {raw!r}")
    return tuple(sorted(float(t) for t in raw))


def split_by_plateau(targets: Sequence[float], plateaus: Mapping[str, float]) -> tuple[tuple, tuple]:
    lowest = min(plateaus.values()) if plateaus else float("inf")
    return tuple(t for t in targets if t < lowest), tuple(t for t in targets if t >= lowest)


def over_range(outcomes: Sequence[str]) -> str:
    return V.combine(list(outcomes))


def range_text(targets: Sequence[float], dropped: Sequence[float], plateaus: Mapping[str, float],
               lower: bool = False) -> str:
    """`lower`: the targets are losses, kept above every arm's final loss (psgd/lab/updates_to_target.py)."""
    fmt = (lambda t: f"{t:g}") if lower else (lambda t: f"{t:.0%}")
    span = (fmt(targets[0]) if len(targets) == 1 else
            f"{fmt(targets[0])} to {fmt(targets[-1])} ({', '.join(map(fmt, targets))})") if targets else "none"
    edge = (max if lower else min)(plateaus, key=plateaus.get) if plateaus else ""
    text = f"{'target losses' if lower else 'targets'} {span}, stated in the experiment file before the runs"
    if edge:
        text += (", above every arm's final loss (the highest: " if lower else
                 ", below every arm's plateau (the lowest: ") + f"{edge}, {plateaus[edge]:.3f})"
    if dropped:
        text += f"; left out, at or {'below' if lower else 'above'} that {'loss' if lower else 'plateau'}: " \
                + ", ".join(map(fmt, dropped))
    return text
