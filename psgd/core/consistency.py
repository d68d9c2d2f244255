"""Consistency policies of a parameter shard, by mode name: when a pull is served, when a gradient is applied.

`make_policy(mode, ...)` is what a shard is built with (psgd/train/assemble.py). Where each thing
lives, each file's docstring the contract of its part:

- psgd/core/rules.py: the modes themselves (`may_read`, `on_arrival`, `slowest`), the words
  (clock, staleness, clock gap) and the registry `RULES`: a new mode is one class there;
- psgd/core/policy.py: `Policy`, the state machine every mode shares (versions, clocks, budget,
  the shard's callbacks); async and SSP are it with their rule;
- psgd/core/roster.py: who is in the run (start barrier, lost, departed and joining workers);
- psgd/core/sync.py: `Sync`, BSP's quorum and backup workers; psgd/core/stepsum.py its step's sum;
- psgd/core/outcomes.py: what push and pull return, `Stats`, the errors.

`Async` and `SSP` below are `Policy` with their rule, for tests and examples that build one by hand.
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
