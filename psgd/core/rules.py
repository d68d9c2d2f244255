"""The mode rules of a parameter server: the kernel that the textbook and the production shard share.

Words. A worker's clock = how many of its gradients this shard has received; the shard's version =
updates applied so far. Staleness of an applied gradient = the version when applied - the version
it was computed from. Clock gap of a served pull = the pulling worker's clock - `slowest`, the
clock of the slowest worker still in the run (lost, departed and not-yet-admitted workers hold
nobody back: psgd/core/roster.py says who is in).

A mode is two answers, asked with the shard's lock held:

- `may_read(version, clock, slowest)`: may a pull for `clock` be served now?
- `on_arrival`: does a gradient update the parameters when it arrives (True), or wait in the
  step's sum until the step's quorum has arrived, whose mean is then applied once (False; the sum
  in worker order, psgd/core/stepsum.py)? The textbook and the production policy both branch on it
  (psgd/core/consistency.py `make_policy`: a buffering rule gets Sync's quorum, psgd/core/sync.py).

The three classic modes:

- `Sync` (BSP, bulk synchronous parallel): a pull for clock c waits until c updates are applied,
  so everyone computes step c on the same parameters; a step's gradients are summed in worker
  order and their mean applied once.
- `Async` (Dean et al. 2012, "Large Scale Distributed Deep Networks", Downpour SGD): no pull ever
  waits, each gradient is applied on arrival; a gradient may be computed on old parameters
  (about N-1 updates old).
- `SSP(staleness)` (Ho et al., NIPS 2013, "More Effective Distributed ML via a Stale Synchronous
  Parallel Parameter Server"): applied on arrival, but a pull for clock c waits while
  c - slowest > staleness. That caps how stale a gradient can get: (N-1)(2s+1) updates. s = 0
  makes every worker wait for every other after each step.

A new mode is one class here, decorated `@register`: its `name` is its key in `RULES`, the one
list of parameter-server modes (the `--mode` choices, psgd/core/schema.py, and -h's lines, its
`help`, psgd/train/roles.py, are read from it). Its
parameters are dataclass fields named after the run's setting they take (SSP's `staleness`, the
`--staleness` flag): `make` fills each from the setting of that name. tests/test_textbook.py plugs
one in from the test file and counts what it touched. Stdlib only: the config schema imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol


class Rule(Protocol):
    name: ClassVar[str]
    on_arrival: ClassVar[bool]
    help: ClassVar[str]  # its lines under "modes:" in `psgd run -h` (psgd/train/roles.py)

    def may_read(self, version: int, clock: int, slowest: int) -> bool: ...


RULES: dict[str, type] = {}  # mode name -> its rule class, in registration order


def register(cls: type) -> type:
    """Make `cls` a mode under its own `name`: its one registration (a class decorator)."""
    assert cls.name not in RULES, f"mode {cls.name!r} is registered already"
    RULES[cls.name] = cls
    return cls


@register
@dataclass(frozen=True)
class Sync:
    name: ClassVar[str] = "sync"
    on_arrival: ClassVar[bool] = False  # buffered: the step's mean is applied once its quorum arrived
    help: ClassVar[str] = ("Bulk synchronous (BSP): each shard waits for one gradient from every worker,\n"
                           "applies their mean once; nobody starts step t+1 before all finished step t.")

    def may_read(self, version: int, clock: int, slowest: int) -> bool:
        # Step `clock` starts on the parameters of `clock` updates. The version never passes the
        # clock: update `clock` needs this worker's own push of `clock`.
        return version >= clock


@register
@dataclass(frozen=True)
class Async:
    name: ClassVar[str] = "async"
    on_arrival: ClassVar[bool] = True
    help: ClassVar[str] = ("Every gradient is applied the moment it arrives; nobody ever waits, but a\n"
                           "gradient is computed on parameters about N-1 updates old (stale).")

    def may_read(self, version: int, clock: int, slowest: int) -> bool:
        return True  # never wait, whatever the others do


@register
@dataclass(frozen=True)
class SSP:
    staleness: int = 0  # s: how many clocks the fastest may be ahead of the slowest (--staleness)
    name: ClassVar[str] = "ssp"
    on_arrival: ClassVar[bool] = True
    help: ClassVar[str] = ("Stale synchronous parallel (Ho et al. 2013): applied on arrival like async, but a\n"
                           "worker more than --staleness steps ahead of the slowest blocks until it catches up.")

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError(f"staleness bound must be >= 0, got {self.staleness}")

    def may_read(self, version: int, clock: int, slowest: int) -> bool:
        return clock - slowest <= self.staleness


def make(mode: str, **settings) -> Rule:
    """The rule of a mode by name, each of its parameters (dataclass fields) taken from the setting
    of that name (SSP's `staleness`); settings it has no field for are not its own."""
    if mode not in RULES:
        raise ValueError(f"unknown parameter-server mode {mode!r}; choose one of {', '.join(RULES)}")
    cls = RULES[mode]
    return cls(**{f.name: settings[f.name] for f in dataclasses.fields(cls) if f.name in settings})


def slowest(clocks: Sequence[int], gone: Collection[int] = (), offset: Sequence[int] | None = None) -> int:
    """The clock of the slowest worker still in the run: `clocks` by worker, `gone` the workers that
    hold nobody back, `offset` each worker's clock lead (a joiner counts its clocks from 0 but
    starts at the slowest clock). When every worker is gone, the furthest clock."""
    lead = offset if offset is not None else [0] * len(clocks)
    live = [c + lead[w] for w, c in enumerate(clocks) if w not in gone]
    return min(live) if live else max(c + o for c, o in zip(clocks, lead, strict=True))
