"""Consistency policies of a parameter shard: when a pull is served, when a gradient is applied.

The rules of the three modes are psgd/core/rules.py (the textbook's own, psgd/core/textbook.py);
a policy is a rule with production's bookkeeping around it, in four small files:
psgd/core/policy.py (the shared state machine: versions, clocks, budget, start barrier),
roster.py (who is in the run), sync.py (the quorum, backup workers) and stepsum.py (a step's sum
in worker order, with buffers reused). This file names them and states the contract:

- `Sync` (BSP, bulk synchronous parallel): gradients for step t are buffered until all N
  workers have pushed; their mean is applied once and the version becomes t+1. A pull for
  step t+1 blocks until then, so every worker computes on the same parameters.
  With b backup workers (`--backup-workers b`, Chen et al. 2016, "Revisiting distributed
  synchronous SGD") the mean of the first N-b gradients of step t is applied; the b late ones
  are dropped and counted (see `Sync` for the clock bookkeeping).
- `Async` (Hogwild-style parameter server, Dean et al. 2012 "Downpour SGD"): each gradient is
  applied on arrival; pulls never block. Gradients are stale by about N-1 updates.
- `SSP(s)` (stale synchronous parallel, Ho et al., NIPS 2013): applies on arrival like Async,
  but a worker whose clock is more than s ahead of the slowest worker blocks on pull until the
  slowest catches up. s = 0 makes every worker wait for every other after each step.

Start barrier (opt-in, `start_barrier=True`; the shard server always sets it): every worker's
first pull (clock 0) is held until all N workers have asked for theirs, so nobody trains
before the last one has started up, and the run's clock starts at the same instant for all.
It only ever holds clock-0 pulls, and once down it stays down; `close()` releases it, a pull
deadline ends the wait with PullTimeout as usual. Off, a unit test may drive any subset.

The policy does no math and no I/O: the shard passes an `apply(grad)` callback (the optimizer
step) that the policy calls under its lock, after counting the update (so `version` is then the
version that update makes), and a `read()` callback that copies the parameters under the same
lock. An optional `adjust(grad, worker, staleness)` callback (the remedies for stale gradients,
psgd/core/staleness.py) returns the gradient to take instead of an arriving one (None: skip it,
counted like a non-finite gradient): it is called under the lock once the push is accepted,
before the gradient is buffered or applied, with the staleness the policy measured, so it sees
the same version the update is applied to. If it raises, the push is refused, state unchanged.
Everything here is thread-safe; `self.cond` guards all fields.

Lost workers (async and SSP, opt-in: the shard calls `expire(lease)` now and then, see
psgd/ps/server.py): a worker that sent no push or pull for `lease` seconds, and whose pull the
policy is not holding, is declared lost at its clock. It leaves the clock bookkeeping (SSP waits on
the live workers only, the start barrier counts it as arrived), its later requests are refused, and
the run's budget is spent by the others; a worker that pulls again at the clock it was lost at (a
restarted process) rejoins there. In sync a lost worker departs instead (see below): the quorum
shrinks at once, the step it held up is applied from the others, and it cannot rejoin.

Departed workers (`depart(worker)`, the shard calls it on a worker's Leave): a worker that
finished before the run's budget was spent (a user's own loop ran out of batches, psgd.connect)
sends nothing more, and nobody waits for it: SSP's slowest clock and the start barrier skip it
as they skip a lost worker, and Sync (without backup workers) takes a step's update from the
workers still in the run (the mean of the gradients that came), and its budget drops by the
steps the departed worker will not push. A worker that leaves once the budget is spent (every
worker of `psgd run`) changes nothing.

Elastic membership (`members` < `num_workers`, and `admit`; psgd/core/elastic.py has the schedules):
the policy has `num_workers` slots, of which the first `members` are in the run from the start;
the others are absent, and count as gone (nobody waits for them) until admitted. `admit(worker,
at)` takes a slot in from update `at`:
- Sync: the worker computes step `at` first (its clock starts there), and the step's quorum grows
  by one at that step boundary: step `at` is the first whose update averages its gradient too;
  the budget grows by the steps it will push. `at` must not be a step already applied. The
  update stays the mean of the step's gradients: with a fixed per-worker batch the effective
  batch follows the quorum and the rate does not; `quorum_lr` divides the sum by the starting
  workers instead (the rate scales with the quorum, the linear scaling rule of Goyal et al. 2017).
- Async / SSP: its first pull is held until the shard's version reaches `at`; served, it is in,
  with the slowest live worker's clock as its own (an offset on the clock it counts from 0), so
  SSP's bound neither stalls the others for it nor lets it run ahead. The budget (gradients in
  all) is unchanged: the newcomer spends part of it.
- Either way, `admission(worker)` is that update while the first pull waits for it, and `pull`'s
  `admission_timeout` bounds each hold of it (a long poll: the wait may outlast any deadline).
Departures and losses work as for any worker; `stats.membership` logs every change (the update,
the worker, joined / left / lost). `Roster.admit(None)` takes the lowest absent slot (psgd worker --join).

Clock of a worker = how many of its gradients this shard has received. Staleness of an
applied gradient = shard version when applied - version the worker computed it from.
Clock gap of a served pull = the pulling worker's clock - the slowest worker's clock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from psgd.core import rules
from psgd.core.outcomes import PolicyError, PullOutcome, PullTimeout, PushOutcome, Stats
from psgd.core.policy import Adjust, Policy
from psgd.core.sync import Sync

__all__ = ["SSP", "Adjust", "Async", "Policy", "PolicyError", "PullOutcome", "PullTimeout", "PushOutcome",
           "Stats", "Sync", "make_policy"]


class Async(Policy):
    """Apply every gradient on arrival; never block (rules.Async)."""

    def __init__(self, num_workers: int, apply: Callable[[torch.Tensor], None] | None = None,
                 budget: int | None = None, start_barrier: bool = False, adjust: Adjust | None = None,
                 members: int | None = None) -> None:
        super().__init__(num_workers, rules.Async(), apply, budget, start_barrier, adjust, members)


class SSP(Policy):
    """Apply on arrival; block a pull whose clock is more than `staleness` ahead of the slowest (rules.SSP)."""

    def __init__(self, num_workers: int, apply: Callable[[torch.Tensor], None],
                 staleness: int, budget: int | None = None, start_barrier: bool = False,
                 adjust: Adjust | None = None, members: int | None = None) -> None:
        super().__init__(num_workers, rules.SSP(staleness), apply, budget, start_barrier, adjust, members)


def make_policy(mode: str, num_workers: int, apply: Callable[[torch.Tensor], None],
                staleness: int = 0, budget: int | None = None, start_barrier: bool = False,
                adjust: Adjust | None = None, backup: int = 0, members: int | None = None) -> Policy:
    """The policy of a registered mode (psgd/core/rules.py `RULES`; `staleness`: the setting its rule
    may take): a rule applied on arrival runs in `Policy` as it is (`adjust`: the remedies, for those
    alone), a buffering one in `Sync`, with its quorum and `backup` backup workers."""
    rule = rules.make(mode, staleness=staleness)
    if rule.on_arrival:
        if backup:
            raise ValueError(f"backup workers are a rule of sync mode, not of {mode}")
        return Policy(num_workers, rule, apply, budget, start_barrier, adjust, members)
    assert adjust is None, "sync applies the mean of fresh gradients: nothing to adjust"
    return Sync(num_workers, apply, budget, start_barrier, backup, members, rule=rule)
