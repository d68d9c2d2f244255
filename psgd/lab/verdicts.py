"""Verdict rules: pure functions from measured numbers (with their intervals) to an outcome.

Contract: every rule returns one of five outcomes, and a rule can reach each of its outcomes
from some input (tests/test_verdicts.py feeds synthetic numbers for every one):

- confirmed      the whole interval of the effect lies beyond the rule's margin;
- refuted        the whole interval lies short of the margin: the effect is reversed or too small
                 to matter (the symmetric three-way rule, psgd/lab/rule.py; fewer than 2 seeds:
                 no interval and no verdict);
- depends        parts of the claim come out opposite ways (say on what: the rule's reason does);
- inconclusive   the interval straddles the margin: these seeds cannot tell;
- not testable here   the claim needs hardware this run did not have (say which).

The margins are the smallest differences worth a sentence (1 accuracy point for accuracy, 0.2x
for a slowdown ratio), fixed before the runs: each experiment file declares its own with its reason
(`[margin]`, `margin_why`; psgd/lab/verdict_checks.py checks that the rule weighed those), the same
at every profile and every n. The measured noise floor (`noise_floor`: how far two identical
algorithms land apart, set by the suite from E1's sync PS and all-reduce) is checked against an
accuracy margin, never substituted for it: a claim with a margin below it says it is below what
this setup can resolve (verdict_checks.resolve).

Every verdict also carries its `effects`: each number the rule weighed, with its interval, the
margin it was held against, the test (`effect`: claimed above null + margin; `no_worse`: claimed
above null - margin) and the unit. The report's first figure, a forest plot of every claim, is
drawn from them (psgd/lab/forest.py), so it shows exactly what decided each verdict. The remedies'
rules (E11-E13) are in psgd/lab/verdicts_remedies.py, built from the same parts. Accounting
facts (fp16 moves half the bytes, k-fold accumulation pushes k times less) are not claims: they
are tests of the code (tests/test_accounting.py) and a line in the report.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from psgd.lab import rule as _rule
from psgd.lab.stats import Interval

CONFIRMED, REFUTED, DEPENDS, INCONCLUSIVE, NOT_TESTABLE = (
    "confirmed", "refuted", "depends", "inconclusive", "not testable here")
OUTCOMES = (CONFIRMED, REFUTED, DEPENDS, INCONCLUSIVE, NOT_TESTABLE)


ACCURACY, RATIO, NATS, SHARE = "accuracy", "x", "nats", "share"   # the units of an Effect


@dataclass(frozen=True)
class Effect:
    """One number a rule weighed: `ci` against `null` +- `margin`, as `test` ("effect": the claim is
    that it lies above null + margin; "no_worse": above null - margin), in `unit`, with the outcome
    that part reached on its own."""
    label: str
    ci: Interval
    margin: float
    test: str
    unit: str
    outcome: str
    null: float = 0.0


@dataclass(frozen=True)
class Verdict:
    outcome: str
    reason: str          # one sentence: which numbers decided it
    effects: tuple[Effect, ...] = ()


# -- the noise floor ------------------------------------------------------------------------------
_FLOOR: contextvars.ContextVar[float] = contextvars.ContextVar("accuracy_noise_floor", default=0.0)


@contextlib.contextmanager
def noise_floor(floor: float) -> Iterator[None]:
    """While inside, `floor` is the measured noise floor that accuracy margins are checked against
    (verdict_checks.resolve; never substituted for a margin)."""
    token = _FLOOR.set(max(0.0, float(floor)))
    try:
        yield
    finally:
        _FLOOR.reset(token)


def current_floor() -> float:
    """The noise floor set by `noise_floor` (0.0 outside it: none measured)."""
    return _FLOOR.get()


def accuracy_margin(configured: float) -> tuple[float, str]:
    """(the margin a rule uses, how the report states it): the configured margin, never the noise
    floor (the floor is checked against it: psgd/lab/verdict_checks.py resolve)."""
    return configured, f"{configured:g}"


def _part(label: str, ci: Interval, margin: float, test: str, unit: str = ACCURACY, null: float = 0.0) -> Effect:
    shifted = Interval(ci.estimate - null, ci.lo - null, ci.hi - null, ci.n)
    outcome = effect(shifted, margin) if test == "effect" else no_worse(shifted, margin)
    return Effect(label, ci, margin, test, unit, outcome, null)


def part(label: str, ci: Interval, margin: float, test: str, unit: str = ACCURACY, null: float = 0.0) -> Effect:
    """One part of a claim, judged on its own: `ci` against `null` +- `margin` by `test` ("effect" or
    "no_worse"). An analysis module's own rule builds its Verdict from these and `combine`."""
    return _part(label, ci, margin, test, unit, null)


def decision_point(e: Effect) -> float:
    """The value an inconclusive part's interval straddles, on the part's own scale: null + margin
    for "effect" (the symmetric rule decides both ways there), null - margin for "no_worse"."""
    return _rule.decision_point(e.test, e.margin, e.null)


def effect(ci: Interval, margin: float) -> str:
    """Claim "the effect exceeds `margin`": confirmed when the whole interval lies beyond it, refuted
    when the whole interval lies short of it (psgd/lab/rule.py)."""
    return _rule.effect(ci, margin)


def no_worse(ci: Interval, margin: float) -> str:
    """Claim "the change costs less than `margin`" (ci = new - old): confirmed when the whole
    interval is above -margin, refuted when it is wholly below (psgd/lab/rule.py)."""
    return _rule.no_worse(ci, margin)


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
    margin, stated = accuracy_margin(margin)
    parts = (_part("MLP - logreg", mlp_minus_logreg, margin, "effect"),
             _part("CNN - MLP", cnn_minus_mlp, margin, "effect"))
    return Verdict(combine([p.outcome for p in parts]), f"MLP - logreg {mlp_minus_logreg.fmt(signed=True)}, CNN - MLP "
                                                        f"{cnn_minus_mlp.fmt(signed=True)} (margin {stated})", parts)


def sync_beats_async(sync_minus_async: Interval, margin: float = 0.01, label: str = "sync - async") -> Verdict:
    """E1: at each mode's tuned rate and equal samples, sync ends more accurate than async."""
    margin, stated = accuracy_margin(margin)
    part = _part(label, sync_minus_async, margin, "effect")
    return Verdict(part.outcome, f"{label} accuracy {sync_minus_async.fmt(signed=True)} (margin {stated})", (part,))


def staleness_hurts_adam_more(adam_minus_sgd_damage: Interval | dict[str, Interval], margin: float = 0.02,
                              unit: str = ACCURACY, adam_damage: dict[str, Interval] | None = None,
                              sgd: str = "SGD") -> Verdict:
    """E16: the damage staleness does (the control's accuracy minus the stale arm's, or with `unit`
    NATS the stale arm's test loss minus the control's) is larger with AdamW than with SGD. One
    interval, or one per stale arm ({"async": ..., "ssp s=2": ...}): each is a part, and the
    verdict combines them (a claim about staleness should hold wherever there is some). Either margin
    is taken as set (the noise floor, measured in accuracy, is checked against an accuracy margin only).
    `sgd` names the SGD arm the damages were taken against ("plain SGD": Dai et al.'s own baseline)."""
    margin, stated = accuracy_margin(margin) if unit == ACCURACY else (margin, f"{margin:g} nats")
    by = adam_minus_sgd_damage if isinstance(adam_minus_sgd_damage, dict) else {"": adam_minus_sgd_damage}
    parts = tuple(_part(f"AdamW's staleness cost - {sgd}'s{f' ({arm})' if arm else ''}", ci, margin, "effect", unit)
                  for arm, ci in by.items())
    reason = "; ".join(f"{'' if not arm else arm + ': '}AdamW's staleness cost - {sgd}'s {ci.fmt(signed=True)}"
                       for arm, ci in by.items())
    outcomes = [x.outcome for x in parts]
    if adam_damage:
        # AdamW's own damage must exceed zero before it can exceed SGD's: a difference of damages
        # made by SGD gaining from staleness (it can act as momentum) says nothing of AdamW. Per
        # stale arm both must hold: confirmed when both are, refuted when either is.
        own = tuple(_part(f"AdamW's own staleness cost{f' ({arm})' if arm else ''}", ci, 0.0, "effect", unit)
                    for arm, ci in adam_damage.items())
        outcomes = [CONFIRMED if (a.outcome, b.outcome) == (CONFIRMED, CONFIRMED) else
                    REFUTED if REFUTED in (a.outcome, b.outcome) else INCONCLUSIVE
                    for a, b in zip(parts, own, strict=True)]
        parts += own
        reason += "; " + "; ".join(f"{'' if not arm else arm + ': '}AdamW's own cost {ci.fmt(signed=True)} (above 0)"
                                   for arm, ci in adam_damage.items())
    return Verdict(combine(outcomes), f"{reason} (margin {stated})", parts)


def straggler_hurts_sync_more(sync_minus_async_slowdown: Interval, margin: float = 0.2) -> Verdict:
    """E2: one slow worker slows sync down by more (ratio of throughputs) than async."""
    part = _part("sync's slowdown - async's", sync_minus_async_slowdown, margin, "effect", RATIO)
    return Verdict(part.outcome,
                   f"sync's slowdown - async's {sync_minus_async_slowdown.fmt(2, signed=True)}x (margin {margin}x)",
                   (part,))


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
    margin, stated = accuracy_margin(margin)
    parts = tuple(_part(f"control - async, lr {c.lr:g}", c.gap, margin, "effect") for c in cells if c.gap is not None)
    shown = [c.lr for c in cells if c.async_diverged == 1.0 and c.control_diverged == 0.0]
    if shown:
        return Verdict(CONFIRMED, f"async diverges in every seed at lr {', '.join(f'{x:g}' for x in shown)} "
                                  f"where the stale-free control converges in every seed", parts)
    stable = [c for c in cells if c.control_diverged == 0.0 and c.async_diverged == 0.0 and c.gap is not None]
    # Where the control converges in every seed, async ending clearly below it is the claim, whether
    # some of its seeds diverged on the way (non-convergence) or none did (oscillation's cost).
    worse = [c for c in cells if c.control_diverged == 0.0 and c.gap is not None and effect(c.gap, margin) == CONFIRMED]
    if worse:
        c = max(worse, key=lambda c: c.gap.estimate)
        how = (f", {c.async_diverged:.0%} of its seeds diverged (the control: none)" if c.async_diverged > 0 else
               ", with no seed diverged")
        return Verdict(CONFIRMED, f"at lr {c.lr:g} async ends {c.gap.fmt(signed=True)} below the stale-free control "
                                  f"in accuracy (margin {stated}){how}", parts)
    settled = all(c.async_diverged in (0.0, 1.0) and c.async_diverged == c.control_diverged for c in cells)
    if settled and all(effect(c.gap, margin) == REFUTED for c in stable) and stable:
        return Verdict(REFUTED, "async diverges exactly where the stale-free control does, and where both converge "
                                f"it ends within {stated} of the control", parts)
    return Verdict(INCONCLUSIVE, "seeds disagree at the edge of stability, or the accuracy gaps straddle the margin",
                   parts)


def retuning_pays(tuned_minus_fixed: Interval, lr_changed: bool, margin: float = 0.01) -> Verdict:
    """E6: at the largest batch, its own tuned rate beats the small batch's rate."""
    margin, stated = accuracy_margin(margin)
    part = _part("tuned - small-batch rate", tuned_minus_fixed, margin, "effect")
    outcome = part.outcome
    if outcome == CONFIRMED and not lr_changed:
        outcome = INCONCLUSIVE  # the "tuned" rate is the small batch's: the gain is seed noise
    return Verdict(outcome, f"tuned - small-batch rate at the largest batch {tuned_minus_fixed.fmt(signed=True)} "
                            f"(margin {stated})", (part,))


def skew_hurts(local_drop: Interval, sync_drop: Interval, margin: float = 0.01) -> Verdict:
    """E7: label skew costs accuracy. Expected to depend on how often replicas are averaged:
    local SGD (H steps apart) drifts; averaging every step keeps the mean gradient unbiased."""
    margin, stated = accuracy_margin(margin)
    parts = (_part("drop with skew, local SGD", local_drop, margin, "effect"),
             _part("drop with skew, every step", sync_drop, margin, "effect"))
    outcome = combine([p.outcome for p in parts])
    reason = (f"drop with skew: local SGD {local_drop.fmt(signed=True)}, averaging every step "
              f"{sync_drop.fmt(signed=True)} (margin {stated})")
    if outcome == DEPENDS:
        reason += "; it depends on how often the replicas are averaged"
    return Verdict(outcome, reason, parts)


def keeps_accuracy(diffs: dict[str, Interval], margin: float = 0.01) -> Verdict:
    """E8 / E9: each variant's accuracy minus the baseline's stays above -margin."""
    margin, stated = accuracy_margin(margin)
    parts = tuple(_part(f"{k} - baseline", ci, margin, "no_worse") for k, ci in diffs.items())
    return Verdict(combine([p.outcome for p in parts]), ", ".join(f"{k}: {ci.fmt(signed=True)}"
                                                                  for k, ci in diffs.items())
                   + f" (margin -{stated})", parts)


def keeps_loss(gaps: dict[str, Interval], margin: float) -> Verdict:
    """E14: each variant's test loss stays within `margin` of the baseline's (gaps: baseline minus
    variant, so a worse variant is negative): confirmed when every interval is above -margin."""
    parts = tuple(_part(f"baseline - {k}", ci, margin, "no_worse", NATS) for k, ci in gaps.items())
    return Verdict(combine([p.outcome for p in parts]), ", ".join(f"{k}: {ci.fmt(signed=True)}"
                                                                  for k, ci in gaps.items())
                   + f" (baseline minus variant, margin -{margin} nats)", parts)


def communication_wall(fast_minus_slow_speedup: Interval, margin: float = 0.2) -> Verdict:
    """E10: the speedup from adding workers is smaller on a slow link than on a fast one."""
    part = _part("speedup, fast link - slow link", fast_minus_slow_speedup, margin, "effect", RATIO)
    return Verdict(part.outcome,
                   f"speedup on the fast link - on the slow one {fast_minus_slow_speedup.fmt(2, signed=True)}x "
                   f"(margin {margin}x)", (part,))


def library_far_faster(backend: str, ring_over_library: Interval, factor: float = 10.0) -> Verdict:
    """E5: the seed's claim is about NCCL on GPUs; gloo on CPUs cannot test it."""
    if backend != "nccl":
        return Verdict(NOT_TESTABLE, f"the claim is about NCCL on GPUs; this run had {backend} on CPUs "
                                     f"(needs 2+ CUDA GPUs with NCCL)")
    part = _part("ring / NCCL time", ring_over_library, 0.0, "effect", RATIO, null=factor)
    return Verdict(part.outcome, f"ring / NCCL time {ring_over_library.fmt(2)}x (claim: > {factor:g}x)", (part,))


def server_bottleneck(hosts: int, ring_minus_ps_speedup: Interval, margin: float = 0.2,
                      label: str = "ring speedup - PS speedup") -> Verdict:
    """E4: from 1 to N workers the ring's throughput grows more than a one-shard PS's. A server's
    link as the bottleneck needs processes on separate hosts (separate NICs): on one host every
    process shares the cores and loopback, and the rule does not apply."""
    if hosts <= 1:
        return Verdict(NOT_TESTABLE, "every process shares one host's cores and loopback, so CPU, not the "
                                     "server's link, is the scarce resource; needs workers and servers on "
                                     "separate hosts")
    part = _part(label, ring_minus_ps_speedup, margin, "effect", RATIO)
    return Verdict(part.outcome, f"{label} {ring_minus_ps_speedup.fmt(2, signed=True)}x (margin {margin}x)", (part,))


# DiLoCo as Douillard et al. (2023) ran it (issue 57): 8 workers, each replica started from a checkpoint
# of synchronous training, then at least 100 outer steps (their 88k steps at H = 500).
DILOCO_PAPER_WORKERS, DILOCO_PAPER_OUTER_STEPS = 8, 100


def diloco_at_scale(workers: int, outer_steps: int, warm_start: bool, early: Verdict) -> Verdict:
    """E14, E18, E22: DiLoCo's claim where the runs match the paper's setup, else "not testable here"
    with the numbers that say why. The measured `early` verdict (what this scale shows: early training
    from random weights) keeps its effects and is named in the reason, reported, never the claim's."""
    short = ([f"{workers} workers (the paper: {DILOCO_PAPER_WORKERS})"] if workers < DILOCO_PAPER_WORKERS else []) \
        + ([f"{outer_steps} outer steps (the paper: at least {DILOCO_PAPER_OUTER_STEPS})"]
           if outer_steps < DILOCO_PAPER_OUTER_STEPS else []) \
        + ([] if warm_start else ["from random weights (the paper: warm-started from a synchronous checkpoint)"])
    if not short:
        return early
    return Verdict(NOT_TESTABLE, f"not at the paper's scale, which 2 cores cannot run: {'; '.join(short)}. "
                                 f"Early training here, reported and not judged: {early.outcome} ({early.reason})",
                   early.effects)
