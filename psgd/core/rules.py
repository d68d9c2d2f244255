"""The mode rules of a parameter server: the kernel that the textbook and the production shard share.

A mode is two answers, asked with the shard's lock held:

- `may_read(version, clock, slowest)`: may a pull for `clock` be served now? `version` is the
  updates applied so far, `slowest` the clock of the slowest worker still in the run (a clock of a
  worker = the gradients the shard has received from it).
- `on_arrival`: does a gradient update the parameters when it arrives (True), or wait in the
  step's sum until the step's quorum has arrived, whose mean is then applied once (False)?

The three classic modes:

- `Sync` (BSP, bulk synchronous parallel): a pull for clock c waits until c updates are applied,
  so everyone computes step c on the same parameters; a step's gradients are summed, in worker
  order (`step_sum`), and their mean applied once.
- `Async` (Dean et al. 2012, "Large Scale Distributed Deep Networks", Downpour SGD): no pull ever
  waits, each gradient is applied on arrival; a gradient may be computed on old parameters.
- `SSP(bound)` (Ho et al., NIPS 2013, "More Effective Distributed ML via a Stale Synchronous
  Parallel Parameter Server"): applied on arrival, but a pull for clock c waits while
  c - slowest > bound. That caps how stale a gradient can get: (N-1)(2s+1) updates.

psgd/core/textbook.py asks these rules in one file of under 200 lines, with nothing else around them;
psgd/core/consistency.py asks the same objects with production's membership, budget and start
barrier around them (tests/test_textbook.py compares the two). A new mode is a class here with
these two answers and its name in `RULES` (tests/test_textbook.py plugs one in from a test file).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch


class Rule(Protocol):
    name: ClassVar[str]
    on_arrival: ClassVar[bool]

    def may_read(self, version: int, clock: int, slowest: int) -> bool: ...


@dataclass(frozen=True)
class Sync:
    name: ClassVar[str] = "sync"
    on_arrival: ClassVar[bool] = False  # buffered: the step's mean is applied once its quorum arrived

    def may_read(self, version: int, clock: int, slowest: int) -> bool:
        # Step `clock` starts on the parameters of `clock` updates. The version never passes the
        # clock: update `clock` needs this worker's own push of `clock`.
        return version >= clock


@dataclass(frozen=True)
class Async:
    name: ClassVar[str] = "async"
    on_arrival: ClassVar[bool] = True

    def may_read(self, version: int, clock: int, slowest: int) -> bool:
        return True  # never wait, whatever the others do


@dataclass(frozen=True)
class SSP:
    bound: int = 0  # s: how many clocks the fastest may be ahead of the slowest
    name: ClassVar[str] = "ssp"
    on_arrival: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.bound < 0:
            raise ValueError(f"staleness bound must be >= 0, got {self.bound}")

    def may_read(self, version: int, clock: int, slowest: int) -> bool:
        return clock - slowest <= self.bound


RULES: dict[str, type] = {"sync": Sync, "async": Async, "ssp": SSP}


def make(mode: str, staleness: int = 0) -> Rule:
    """The rule of a mode by name; SSP's bound is `staleness`."""
    if mode not in RULES:
        raise ValueError(f"unknown parameter-server mode {mode!r}; choose one of {', '.join(RULES)}")
    return RULES[mode](staleness) if mode == "ssp" else RULES[mode]()


def step_sum(parts: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The sum of one sync step's gradients, by worker: ((g0 + g1) + g2) + ..., in worker order, into
    a new tensor. Float addition is not associative, so with 3 or more workers the arrival order
    would change the sum's last bits and two identical runs would end apart; worker order is the
    same every run. Divided once by the count, it is within float rounding of one process
    computing the whole global batch. (Production's Sync computes exactly this sum while reusing
    its buffers: psgd/core/stepsum.py.)"""
    order = [parts[w] for w in sorted(parts)]
    total = order[0].clone()
    for g in order[1:]:
        total.add_(g)
    return total
