"""Verdict rules: pure functions from measured numbers (with their intervals) to an outcome.

Contract: every rule returns one of five outcomes, and a rule can reach each of its outcomes
from some input (tests/test_verdicts.py feeds synthetic numbers for every one):

- confirmed      the interval of the effect lies on the claimed side and the effect is large
                 enough to matter (its estimate beyond the rule's margin);
- refuted        the interval lies wholly below the margin: the effect is reversed or too small
                 to matter;
- depends        parts of the claim come out opposite ways (say on what: the rule's reason does);
- inconclusive   the interval straddles the margin: these seeds cannot tell;
- not testable here   the claim needs hardware this run did not have (say which).

The margins are the smallest differences worth a sentence (1 accuracy point for accuracy, 0.2x
for a slowdown ratio); they are arguments, stated in the report next to every verdict. Accounting
facts (fp16 moves half the bytes, k-fold accumulation pushes k times less) are not claims: they
are tests of the code (tests/test_accounting.py) and a line in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psgd.lab.stats import Interval

CONFIRMED, REFUTED, DEPENDS, INCONCLUSIVE, NOT_TESTABLE = (
    "confirmed", "refuted", "depends", "inconclusive", "not testable here")
OUTCOMES = (CONFIRMED, REFUTED, DEPENDS, INCONCLUSIVE, NOT_TESTABLE)


@dataclass(frozen=True)
class Verdict:
    outcome: str
    reason: str          # one sentence: which numbers decided it


def effect(ci: Interval, margin: float) -> str:
    """Claim "the effect is positive and matters": confirmed when the interval excludes 0 and the
    estimate exceeds `margin`; refuted when even the interval's top is below `margin`."""
    if ci.lo > 0 and ci.estimate > margin:
        return CONFIRMED
    if ci.hi < margin:
        return REFUTED
    return INCONCLUSIVE


def no_worse(ci: Interval, margin: float) -> str:
    """Claim "the change costs less than `margin`" (ci = new - old): confirmed when the whole
    interval is above -margin, refuted when it is wholly below."""
    if ci.lo > -margin:
        return CONFIRMED
    if ci.hi < -margin:
        return REFUTED
    return INCONCLUSIVE


def combine(parts: Sequence[str]) -> str:
    """All parts agree -> that outcome; any inconclusive -> inconclusive; a mix -> depends."""
    parts = list(parts)
    if not parts:
        return INCONCLUSIVE
    if NOT_TESTABLE in parts:
        return NOT_TESTABLE
    if INCONCLUSIVE in parts:
        return INCONCLUSIVE
    if all(p == parts[0] for p in parts):
        return parts[0]
    return DEPENDS


# -- one rule per claim -------------------------------------------------------------------------
def baseline(mlp_minus_logreg: Interval, cnn_minus_mlp: Interval, margin: float = 0.02) -> Verdict:
    """E0: the paper's ranking on MNIST-1D, logistic regression < MLP < CNN."""
    parts = [effect(mlp_minus_logreg, margin), effect(cnn_minus_mlp, margin)]
    return Verdict(combine(parts), f"MLP - logreg {mlp_minus_logreg.fmt(signed=True)}, CNN - MLP "
                                   f"{cnn_minus_mlp.fmt(signed=True)} (margin {margin})")


def sync_beats_async(sync_minus_async: Interval, margin: float = 0.01) -> Verdict:
    """E1: at each mode's tuned rate and equal samples, sync ends more accurate than async."""
    return Verdict(effect(sync_minus_async, margin),
                   f"sync - async accuracy {sync_minus_async.fmt(signed=True)} (margin {margin})")


def straggler_hurts_sync_more(sync_minus_async_slowdown: Interval, margin: float = 0.2) -> Verdict:
    """E2: one slow worker slows sync down by more (ratio of throughputs) than async."""
    return Verdict(effect(sync_minus_async_slowdown, margin),
                   f"sync's slowdown - async's {sync_minus_async_slowdown.fmt(2, signed=True)}x (margin {margin}x)")


@dataclass(frozen=True)
class StabilityCell:
    lr: float
    control_diverged: float    # fraction of seeds that diverged without staleness (N=1, same update batch)
    async_diverged: float      # fraction of seeds of async with N workers that diverged
    gap: Interval | None = None  # control's final accuracy - async's (None: not measured)


def staleness_destabilises(cells: Sequence[StabilityCell], margin: float = 0.02) -> Verdict:
    """E3: "oscillation or non-convergence". Against the stale-free control (one worker, the same
    batch per update, the same samples), at the same rate, async with N workers either
    - diverges in every seed where the control converges in every seed (non-convergence), or
    - ends clearly worse where the control converges (its accuracy interval below the control's
      by more than `margin`: the stale updates cost what the control kept).
    Refuted when neither happens at any rate and the gaps are all below the margin; inconclusive
    when seeds disagree, or nothing was measured."""
    if not cells:
        return Verdict(INCONCLUSIVE, "no stale-free control ran at the async runs' rates")
    shown = [c.lr for c in cells if c.async_diverged == 1.0 and c.control_diverged == 0.0]
    if shown:
        return Verdict(CONFIRMED, f"async diverges in every seed at lr {', '.join(f'{x:g}' for x in shown)} "
                                  f"where the stale-free control converges in every seed")
    stable = [c for c in cells if c.control_diverged == 0.0 and c.async_diverged == 0.0 and c.gap is not None]
    worse = [c for c in stable if effect(c.gap, margin) == CONFIRMED]
    if worse:
        c = max(worse, key=lambda c: c.gap.estimate)
        return Verdict(CONFIRMED, f"no run collapses that the control does not, but at lr {c.lr:g} async ends "
                                  f"{c.gap.fmt(signed=True)} below the stale-free control in accuracy "
                                  f"(margin {margin})")
    settled = all(c.async_diverged in (0.0, 1.0) and c.async_diverged == c.control_diverged for c in cells)
    if settled and all(effect(c.gap, margin) == REFUTED for c in stable) and stable:
        return Verdict(REFUTED, "async diverges exactly where the stale-free control does, and where both converge "
                                f"it ends within {margin} of the control")
    return Verdict(INCONCLUSIVE, "seeds disagree at the edge of stability, or the accuracy gaps straddle the margin")


def retuning_pays(tuned_minus_fixed: Interval, lr_changed: bool, margin: float = 0.01) -> Verdict:
    """E6: at the largest batch, its own tuned rate beats the small batch's rate."""
    outcome = effect(tuned_minus_fixed, margin)
    if outcome == CONFIRMED and not lr_changed:
        outcome = INCONCLUSIVE  # the "tuned" rate is the small batch's: the gain is seed noise
    return Verdict(outcome, f"tuned - small-batch rate at the largest batch {tuned_minus_fixed.fmt(signed=True)} "
                            f"(margin {margin})")


def skew_hurts(local_drop: Interval, sync_drop: Interval, margin: float = 0.01) -> Verdict:
    """E7: label skew costs accuracy. Expected to depend on how often replicas are averaged:
    local SGD (H steps apart) drifts; averaging every step keeps the mean gradient unbiased."""
    local, every = effect(local_drop, margin), effect(sync_drop, margin)
    outcome = combine([local, every])
    reason = (f"drop with skew: local SGD {local_drop.fmt(signed=True)}, averaging every step "
              f"{sync_drop.fmt(signed=True)} (margin {margin})")
    if outcome == DEPENDS:
        reason += "; it depends on how often the replicas are averaged"
    return Verdict(outcome, reason)


def keeps_accuracy(diffs: dict[str, Interval], margin: float = 0.01) -> Verdict:
    """E8 / E9: each variant's accuracy minus the baseline's stays above -margin."""
    outcome = combine([no_worse(ci, margin) for ci in diffs.values()])
    return Verdict(outcome, ", ".join(f"{k}: {ci.fmt(signed=True)}" for k, ci in diffs.items())
                   + f" (margin -{margin})")


def keeps_loss(gaps: dict[str, Interval], margin: float) -> Verdict:
    """E14: each variant's test loss stays within `margin` of the baseline's (gaps: baseline minus
    variant, so a worse variant is negative): confirmed when every interval is above -margin."""
    outcome = combine([no_worse(ci, margin) for ci in gaps.values()])
    return Verdict(outcome, ", ".join(f"{k}: {ci.fmt(signed=True)}" for k, ci in gaps.items())
                   + f" (baseline minus variant, margin -{margin} nats)")


def communication_wall(fast_minus_slow_speedup: Interval, margin: float = 0.2) -> Verdict:
    """E10: the speedup from adding workers is smaller on a slow link than on a fast one."""
    return Verdict(effect(fast_minus_slow_speedup, margin),
                   f"speedup on the fast link - on the slow one {fast_minus_slow_speedup.fmt(2, signed=True)}x "
                   f"(margin {margin}x)")


def library_far_faster(backend: str, ring_over_library: Interval, factor: float = 10.0) -> Verdict:
    """E5: the seed's claim is about NCCL on GPUs; gloo on CPUs cannot test it."""
    if backend != "nccl":
        return Verdict(NOT_TESTABLE, f"the claim is about NCCL on GPUs; this run had {backend} on CPUs "
                                     f"(needs 2+ CUDA GPUs with NCCL)")
    shifted = Interval(ring_over_library.estimate - factor, ring_over_library.lo - factor,
                       ring_over_library.hi - factor, ring_over_library.n)
    return Verdict(effect(shifted, 0.0), f"ring / NCCL time {ring_over_library.fmt(2)}x (claim: > {factor:g}x)")


def server_bottleneck(hosts: int, ring_minus_ps_speedup: Interval, margin: float = 0.2) -> Verdict:
    """E4: from 1 to N workers the ring's throughput grows more than a one-shard PS's. A server's
    link as the bottleneck needs processes on separate hosts (separate NICs): on one host every
    process shares the cores and loopback, and the rule does not apply."""
    if hosts <= 1:
        return Verdict(NOT_TESTABLE, "every process shares one host's cores and loopback, so CPU, not the "
                                     "server's link, is the scarce resource; needs workers and servers on "
                                     "separate hosts")
    return Verdict(effect(ring_minus_ps_speedup, margin),
                   f"ring speedup - PS speedup {ring_minus_ps_speedup.fmt(2, signed=True)}x (margin {margin}x)")


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
    degraded = [c for c in cells if effect(c.gap, margin) == CONFIRMED]
    if not degraded:
        return Verdict(INCONCLUSIVE, f"plain async is not behind sync by more than {margin} at any cell where a "
                                     "remedy ran: no gap to close")
    remedies = list(dict.fromkeys(c.remedy for c in degraded))
    per = {r: combine([effect(c.gain, margin) for c in degraded if c.remedy == r]) for r in remedies}
    cells_text = "; ".join(
        f"{c.remedy} at N={c.workers} lr {c.lr:g}: {c.gain.fmt(signed=True)} on a gap of {c.gap.fmt()}"
        + (f" ({c.closed.fmt(2)} of it closed)" if c.closed is not None else "") for c in degraded)
    outcome = combine(list(per.values()))
    summary = ", ".join(f"{r} {o}" for r, o in per.items())
    return Verdict(outcome, f"{summary} (accuracy gained on plain async where it trails sync: {cells_text}; "
                            f"margin {margin})")


def backup_recovers(loss: Interval, recovered: Interval, accuracy_cost: Interval, share: float = 0.5,
                    margin: float = 0.01) -> Verdict:
    """E11: backup workers recover most of the throughput sync loses to a straggler (the share
    `recovered` of the loss above `share`) at little cost in accuracy (backup minus sync above
    -`margin`). Inconclusive when the straggler did not measurably slow sync (`loss`, the relative
    throughput loss, not above 0): there is nothing to recover."""
    if not loss.lo > 0:
        return Verdict(INCONCLUSIVE, f"the straggler cost sync {loss.fmt(2)} of its throughput: no loss to recover")
    shifted = Interval(recovered.estimate - share, recovered.lo - share, recovered.hi - share, recovered.n)
    parts = [effect(shifted, 0.0), no_worse(accuracy_cost, margin)]
    reason = (f"recovered share of sync's straggler loss {recovered.fmt(2)} (claim: > {share:g}), accuracy backup - "
              f"sync {accuracy_cost.fmt(signed=True)} (margin -{margin})")
    outcome = combine(parts)
    if outcome == DEPENDS:
        reason += ": " + ("throughput recovered, accuracy lost" if parts[0] == CONFIRMED else
                          "accuracy kept, throughput not recovered")
    return Verdict(outcome, reason)


# -- the remedies -------------------------------------------------------------------------------
def error_feedback_keeps_accuracy(ef_minus_dense: dict[str, Interval], dense_minus_no_ef: dict[str, Interval],
                                  margin: float = 0.02) -> Verdict:
    """E13: at equal samples, top-k pushes with error feedback end within `margin` of dense pushes
    (`no_worse`, per fraction), and without error feedback more than `margin` below them (`effect`
    of dense - without). The first half decides alone when it fails: refuted when feedback loses
    accuracy at every fraction, depends when at some only, inconclusive when its intervals
    straddle. When it holds, the second half: confirmed when dropping the rest costs accuracy,
    depends when it does not (then sparse pushes keep up on this problem without feedback too)."""
    with_ef = combine([no_worse(ci, margin) for ci in ef_minus_dense.values()])
    without = combine([effect(ci, margin) for ci in dense_minus_no_ef.values()])
    reason = ("accuracy with error feedback minus dense: "
              + ", ".join(f"{k} {ci.fmt(signed=True)}" for k, ci in ef_minus_dense.items())
              + "; dense minus without it: "
              + ", ".join(f"{k} {ci.fmt(signed=True)}" for k, ci in dense_minus_no_ef.items())
              + f" (margin {margin})")
    if with_ef != CONFIRMED:
        if with_ef == DEPENDS:
            reason += "; error feedback keeps up at some fractions only"
        return Verdict(with_ef, reason)
    if without in (REFUTED, DEPENDS):
        reason += ("; without error feedback the sparse pushes keep up too" if without == REFUTED
                   else "; without error feedback some fractions keep up")
        return Verdict(DEPENDS, reason)
    return Verdict(without, reason)
