"""Training loss that rises: the warning a long run at a constant rate needs.

Contract: `rise(losses)` reads a run's per-step training losses in the order metrics.jsonl holds
them and returns a `Rise` when the mean of the last twentieth of them is both 1.5x and 0.05 above
the lowest mean of any twentieth before it (a run that trained and then came apart), else None;
runs of fewer than `MIN_STEPS` steps are not judged (their twentieths are too noisy to compare).
`Rise.message()` is the one line the launcher prints.

Why a warning and not a fix: psgd's default optimizer is SGD with momentum 0.9 at a constant rate,
the setting every suite tunes around. Held for tens of epochs it stops converging, with one worker
as with many (docs/guide.md, "Long runs"); stale gradients make it come sooner and larger. The run
is the user's to shorten, or to give a lower --lr; psgd says so instead of changing what they ran.
"""

from __future__ import annotations

from dataclasses import dataclass

PARTS = 20        # the loss curve is judged in twentieths
MIN_STEPS = 2000  # below this a twentieth is under 100 steps: noise, not a trend
RATIO, ABOVE = 1.5, 0.05


@dataclass(frozen=True)
class Rise:
    low: float    # the lowest twentieth's mean loss
    at: float     # where it was, as a fraction of the run (0 = start)
    last: float   # the last twentieth's mean loss

    def message(self) -> str:
        return (f"warning: training loss rose from {self.low:.3f} ({self.at:.0%} into the run) to {self.last:.3f} "
                "at its end: the constant rate no longer converges (see docs/guide.md, 'Long runs'); "
                "a lower --lr or fewer --steps keeps the best of it")


def rise(losses: list[float]) -> Rise | None:
    """The rise of `losses` (see the module docstring), or None."""
    n = len(losses)
    if n < MIN_STEPS:
        return None
    size = n // PARTS
    means = [sum(losses[i * size:(i + 1) * size]) / size for i in range(PARTS)]
    low = min(means[:-1])
    last = means[-1]
    if last >= RATIO * low and last - low >= ABOVE:
        return Rise(low=low, at=means.index(low) / PARTS, last=last)
    return None
