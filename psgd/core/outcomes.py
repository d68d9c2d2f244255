"""What a consistency policy answers: its refusals, the outcome of a push and of a pull, its stats.

Pure data, shared by the policy (psgd/core/policy.py), its collaborators (roster.py, stepsum.py)
and the shard that reports them (psgd/ps/shard.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class PolicyError(ValueError):
    """A request that breaks the protocol (wrong clock, duplicate push): refused, state unchanged."""


class PullTimeout(TimeoutError):
    """The policy held a pull longer than the caller's deadline."""


@dataclass(frozen=True)
class PushOutcome:
    version: int       # shard version after handling the push
    applied: bool      # the gradient (or the mean it joined) was applied now
    done: bool         # budget spent: this gradient was refused and the worker should stop
    staleness: int     # version when applied (or buffered) - base_version
    skipped: bool = False
    refused: bool = False  # budget already spent: not taken
    dropped: bool = False  # sync with backup workers: late for its step, taken but never applied
    kept: bool = False     # push(keep=True): the policy kept `grad`'s memory, see `spare`
    spare: torch.Tensor | None = None  # with kept: the buffer the caller gets instead (None: none)


@dataclass(frozen=True)
class PullOutcome(Generic[T]):
    version: int
    done: bool
    wait_s: float      # time held by the policy
    clock_gap: int
    value: T | None    # what read() returned; None when done


@dataclass
class Stats:
    """What the shard reports at the end of a run."""
    staleness: Counter = field(default_factory=Counter)   # staleness -> count of gradients
    max_clock_gap: int = 0
    gaps: Counter = field(default_factory=Counter)         # clock gap -> count of served pulls
    skipped_nonfinite: int = 0
    refused_after_budget: int = 0
    lost: dict = field(default_factory=dict)               # worker -> its clock when declared lost
    departed: dict = field(default_factory=dict)           # worker -> its clock when it left before the end
    rejoined: Counter = field(default_factory=Counter)     # worker -> times a lost worker came back
    dropped: Counter = field(default_factory=Counter)     # worker -> late gradients dropped (backup workers)
    membership: list = field(default_factory=list)         # {update, worker, event, clock}: joined / left / lost
