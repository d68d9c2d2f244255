"""Verdict rules of the remedies' claims: backup workers (E11), remedies for stale gradients (E12),
sparsified pushes with error feedback (E13).

Contract: as psgd/lab/verdicts.py, whose parts (`part`, `effect`, `no_worse`, `combine`: the
symmetric three-way rule, psgd/lab/rule.py) and accuracy margins (the file's own; the noise floor is
checked against them, never substituted: `accuracy_margin`) these rules are built from. Pure
functions from intervals to a `Verdict` carrying the effects it weighed; every outcome of every
rule has a synthetic test (tests/test_verdicts.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psgd.lab.stats import Interval
from psgd.lab.verdicts import (
    CONFIRMED,
    DEPENDS,
    INCONCLUSIVE,
    REFUTED,
    SHARE,
    Verdict,
    accuracy_margin,
    combine,
    effect,
    no_worse,
    part,
)

__all__ = ["backup_recovers", "RemedyCell", "remedies_close_the_gap", "error_feedback_keeps_accuracy"]


def backup_recovers(loss: Interval, recovered: Interval, accuracy_cost: Interval, share: float = 0.5,
                    margin: float = 0.01, measure: str = "recovered") -> Verdict:
    """E11: backup workers recover most of the throughput sync loses to a straggler (the share
    `recovered` of the loss above `share`; `measure` names it: "recovered", against sync's
    throughput without the straggler, or "avoided", against the backup arm's own) at little cost
    in accuracy (backup minus sync above -`margin`). Inconclusive when the straggler did not
    measurably slow sync (`loss`, the relative throughput loss, not above 0): nothing to recover."""
    margin, stated = accuracy_margin(margin)
    effects = (part(f"share of the straggler's loss {measure}", recovered, 0.0, "effect", SHARE, null=share),
               part("accuracy, backup - sync", accuracy_cost, margin, "no_worse"))
    if not loss.lo > 0:
        return Verdict(INCONCLUSIVE, f"the straggler cost sync {loss.fmt(2)} of its throughput: no loss to recover",
                       effects)
    parts = [e.outcome for e in effects]
    reason = (f"{measure} share of sync's straggler loss {recovered.fmt(2)} (claim: > {share:g}), accuracy backup - "
              f"sync {accuracy_cost.fmt(signed=True)} (margin -{stated})")
    outcome = combine(parts)
    if outcome == DEPENDS:
        reason += ": " + ("throughput recovered, accuracy lost" if parts[0] == CONFIRMED else
                          "accuracy kept, throughput not recovered")
    return Verdict(outcome, reason, effects)


@dataclass(frozen=True)
class RemedyCell:
    remedy: str                     # "staleness-aware rate", "DC-ASGD"
    workers: int
    lr: float
    gap: Interval                   # sync's final accuracy - plain async's, at this (N, lr)
    gain: Interval                  # the remedy's - plain async's
    closed: Interval | None = None  # gain / gap (shown in the reason)


def remedies_close_the_gap(cells: Sequence[RemedyCell], margin: float = 0.02) -> Verdict:
    """E12: at the (N, lr) cells of the map where plain async falls behind sync (gap confirmed
    beyond `margin`), each remedy gains on plain async (gain confirmed beyond `margin`). Per remedy,
    the cells combine (all agree -> that outcome; a mix -> depends: the rate decides); then the
    remedies combine the same way (one helps, one does not -> depends). Where plain async is never
    clearly behind sync there is no gap to close: inconclusive."""
    margin, stated = accuracy_margin(margin)
    degraded = [c for c in cells if effect(c.gap, margin) == CONFIRMED]
    if not degraded:
        return Verdict(INCONCLUSIVE, f"plain async is not behind sync by more than {stated} at any cell where a "
                                     "remedy ran: no gap to close",
                       tuple(part(f"sync - async, N={c.workers} lr {c.lr:g}", c.gap, margin, "effect")
                             for c in cells))
    remedies = list(dict.fromkeys(c.remedy for c in degraded))
    parts = tuple(part(f"{c.remedy} - async, N={c.workers} lr {c.lr:g}", c.gain, margin, "effect")
                  for c in degraded)
    per = {r: combine([effect(c.gain, margin) for c in degraded if c.remedy == r]) for r in remedies}
    cells_text = "; ".join(
        f"{c.remedy} at N={c.workers} lr {c.lr:g}: {c.gain.fmt(signed=True)} on a gap of {c.gap.fmt()}"
        + (f" ({c.closed.fmt(2)} of it closed)" if c.closed is not None else "") for c in degraded)
    outcome = combine(list(per.values()))
    summary = ", ".join(f"{r} {o}" for r, o in per.items())
    return Verdict(outcome, f"{summary} (accuracy gained on plain async where it trails sync: {cells_text}; "
                            f"margin {stated})", parts)



def error_feedback_keeps_accuracy(ef_minus_dense: dict[str, Interval], dense_minus_no_ef: dict[str, Interval],
                                  margin: float = 0.02) -> Verdict:
    """E13: at equal samples, top-k pushes with error feedback end within `margin` of dense pushes
    (`no_worse`, per fraction), and without error feedback more than `margin` below them (`effect`
    of dense - without). The first half decides alone when it fails: refuted when feedback loses
    accuracy at every fraction, depends when at some only, inconclusive when its intervals
    straddle. When it holds, the second half: confirmed when dropping the rest costs accuracy,
    depends when it does not (then sparse pushes keep up on this problem without feedback too)."""
    margin, stated = accuracy_margin(margin)
    parts = (tuple(part(f"{k} with error feedback - dense", ci, margin, "no_worse")
                   for k, ci in ef_minus_dense.items())
             + tuple(part(f"dense - {k} without", ci, margin, "effect") for k, ci in dense_minus_no_ef.items()))
    with_ef = combine([no_worse(ci, margin) for ci in ef_minus_dense.values()])
    without = combine([effect(ci, margin) for ci in dense_minus_no_ef.values()])
    reason = ("accuracy with error feedback minus dense: "
              + ", ".join(f"{k} {ci.fmt(signed=True)}" for k, ci in ef_minus_dense.items())
              + "; dense minus without it: "
              + ", ".join(f"{k} {ci.fmt(signed=True)}" for k, ci in dense_minus_no_ef.items())
              + f" (margin {stated})")
    if with_ef != CONFIRMED:
        if with_ef == DEPENDS:
            reason += "; error feedback keeps up at some fractions only"
        return Verdict(with_ef, reason, parts)
    if without in (REFUTED, DEPENDS):
        reason += ("; without error feedback the sparse pushes keep up too" if without == REFUTED
                   else "; without error feedback some fractions keep up")
        return Verdict(DEPENDS, reason, parts)
    return Verdict(without, reason, parts)
