"""A consistency policy: a mode's rule (psgd/core/rules.py) with production's bookkeeping around it.

The state machine every mode shares: versions, clocks, a budget (gradients to accept; then every
pull and push is answered done), the start barrier and membership (psgd/core/roster.py). A rule
applied on arrival (async, SSP, a registered one) runs in this class as it is; a buffering rule
(sync) in Sync, which adds the step's sum, its quorum and backup workers (psgd/core/sync.py).

- push: checks clock and version, measures staleness, lets the remedies `adjust` the gradient, then
  the rule's `on_arrival` says whether it is applied now or gathered into the step's sum (Sync's
  `_gather`); never blocks. `turn`: may a push's data be read now (Sync's worker order).
- pull: waits until the rule's `may_read` allows the read (start barrier down, a joiner
  admitted), then read(); PullTimeout after its deadline, state untouched.
- expire / lose / depart / admit / cancel: membership (roster.py); `membership_state` carries it
  in checkpoints.

No math and no I/O. The shard (psgd/ps/shard.py) hands over `apply(grad)`, its optimizer step,
which the policy calls under its lock after counting the update (so `version` is then the
version that update makes; if apply raises, the count is taken back), and `read()`, which copies
the parameters under the same lock. An optional `adjust(grad, worker, staleness)` (the remedies for
stale gradients, psgd/ps/remedies.py) returns the gradient to take instead of an arriving one
(None: skip it, counted like a non-finite gradient): called under the lock once the push is
accepted, before the gradient is buffered or applied, with the staleness the policy measured, so
it sees the version the update is applied to; if it raises, the push is refused, state unchanged.
Thread-safe: `self.cond` guards every field here and in the roster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from psgd.core.clocks import Clocks
from psgd.core.outcomes import PolicyError, PullOutcome, PullTimeout, PushOutcome, Stats
from psgd.core.roster import Membership, Roster
from psgd.core.rules import Rule

T = TypeVar("T")
Adjust = Callable[[torch.Tensor, int, int], torch.Tensor | None]   # (grad, worker, staleness) -> what to take


class Policy(Membership):
    """The shared state machine around one `Rule`; Sync overrides `_gather` and the `_on_*` hooks."""

    rejoins = True  # a lost worker that asks again at its clock (a restarted process) is back in

    def __init__(self, num_workers: int, rule: Rule, apply: Callable[[torch.Tensor], None] | None = None,
                 budget: int | None = None, start_barrier: bool = False, adjust: Adjust | None = None,
                 members: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        members = num_workers if members is None else members
        if not 1 <= members <= num_workers:
            raise ValueError(f"members must be in 1..{num_workers}, got {members}")
        self.rule, self.name = rule, rule.name
        self.num_workers = num_workers
        self.members = members                  # slots in the run from the start
        self.budget = budget                    # gradients to accept in total; None = unlimited
        self._apply, self._adjust = apply, adjust
        self.cond = threading.Condition()
        self.version = 0
        self.accepted = 0
        self.clocks = Clocks([0] * num_workers)  # a list that keeps its slowest (psgd/core/clocks.py)
        self.closed = False
        self.pushing: tuple[int, int] | None = None  # (worker, clock) of the push being handled
        self.stats = Stats()
        self.roster = Roster(num_workers, members, self.stats, start_barrier)

    def attach(self, apply: Callable[[torch.Tensor], None], adjust: Adjust | None = None) -> None:
        """The shard's optimizer step and remedies, given after construction (psgd/ps/shard.py)."""
        with self.cond:
            self._apply, self._adjust = apply, adjust

    @property
    def done(self) -> bool:
        return self.closed or (self.budget is not None and self.accepted >= self.budget)

    # -- a mode's own part (cond held); Async and SSP take these as they are -------------------
    def _pull_ready(self, worker: int, clock: int) -> bool:
        return self.rule.may_read(self.version, self._step(worker, clock), self.roster.slowest(self.clocks))

    def _step(self, worker: int, clock: int) -> int:
        """The clock the rule judges a pull by: a joiner's clock counts from the slowest's (its offset)."""
        return clock + self.roster.offset[worker]

    def _arrive(self, grad: torch.Tensor | None) -> tuple[bool, bool, torch.Tensor | None]:
        """A gradient of an on-arrival rule (None = skipped): applied now. (applied, kept, spare)."""
        if grad is None:
            return False, False, None
        self._commit(grad)
        return True, False, None

    def _gather(self, worker: int, clock: int, grad: torch.Tensor | None,
                keep: bool) -> tuple[bool, bool, torch.Tensor | None]:
        """A gradient of a buffering rule: into the step's sum, applied with its quorum (Sync's)."""
        raise AssertionError(f"{self.name}: a buffering rule needs a step and its quorum (psgd/core/sync.py)")

    def _late(self, worker: int, base_version: int) -> bool:
        return False  # True: taken but never applied (only Sync with backup workers)

    # -- the protocol ---------------------------------------------------------------------------
    def push(self, worker: int, clock: int, base_version: int,
             grad: torch.Tensor | None, keep: bool = False) -> PushOutcome:
        """Hand over one worker's gradient (None: non-finite, counted as skipped). Never blocks.

        keep=True: the caller gives up `grad`'s memory, and the policy may keep it instead of
        copying it (Sync keeps a step's gradients); the outcome then says `kept` and hands back a
        `spare` buffer of the same size in its place (or None)."""
        self._check_worker(worker)
        with self.cond:
            self.roster.check_live(worker)
            if worker in self.roster.pending:
                raise PolicyError(f"worker {worker} pushed before its first pull was served (it joins at update "
                                  f"{self.roster.pending[worker]})")
            if self.done:
                self.stats.refused_after_budget += 1
                return PushOutcome(self.version, applied=False, done=True, staleness=0, refused=True)
            if clock != self.clocks[worker]:
                raise PolicyError(f"worker {worker} pushed clock {clock}, expected {self.clocks[worker]}")
            if base_version > self.version:
                raise PolicyError(f"base_version {base_version} is ahead of shard version {self.version}")
            staleness = self.version - base_version
            if self._late(worker, base_version):
                # Taken (the worker's clock moves on, so its next pull is served) but never applied;
                # not in the staleness histogram, which is about applied gradients, nor in the budget.
                self.clocks[worker] = clock + 1
                self.stats.dropped[worker] += 1
                self.cond.notify_all()
                return PushOutcome(self.version, applied=False, done=self.done, staleness=staleness, dropped=True)
            if grad is not None and self._adjust is not None:
                adjusted = self._adjust(grad, worker, staleness)
                keep = keep and adjusted is grad  # a remedy's own buffer is never the caller's to give up
                grad = adjusted
            self.pushing = (worker, clock)  # for apply(): the clocks once this push is counted (checkpoints)
            try:
                applied, kept, spare = (self._arrive(grad) if self.rule.on_arrival
                                        else self._gather(worker, clock, grad, keep))
            finally:
                self.pushing = None
            self.clocks[worker] = clock + 1
            self.accepted += 1
            self.stats.staleness[staleness] += 1
            if grad is None:
                self.stats.skipped_nonfinite += 1
            self.cond.notify_all()
            return PushOutcome(self.version, applied=applied, done=self.done, staleness=staleness,
                               skipped=grad is None, kept=kept, spare=spare)

    def turn(self, worker: int, clock: int, timeout: float | None = None,
             idle: Callable[[], bool] = lambda: True) -> bool:
        """May `worker`'s push of `clock` be received now? Asked before its data is read; True at
        once here (Sync waits for its turn in the step's worker order: psgd/core/sync.py)."""
        return True

    def pull(self, worker: int, clock: int, read: Callable[[], T],
             timeout: float | None = None, admission_timeout: float | None = None) -> PullOutcome[T]:
        """Block until the rule allows `worker` at `clock` to read, then call read() locked; done (no
        value) once the budget is spent. PullTimeout after `timeout` s, state untouched, or after
        `admission_timeout` s for a joiner awaiting admission: "ask again" (a long poll)."""
        self._check_worker(worker)
        start = time.perf_counter()
        roster = self.roster
        with self.cond:
            if self.rejoins and worker in self.stats.lost and clock == self.clocks[worker]:
                roster.rejoin(worker)  # a restarted worker (--restart-workers) asks for the clock it was lost at
            roster.check_live(worker)
            # A pull's clock is the clock of the push that follows it: anything else would let a
            # wrong clock slip past the gate. Once the run is done every pull is answered done.
            if clock != self.clocks[worker] and not self.done:
                raise PolicyError(f"worker {worker} pulled for clock {clock}, but its next push is clock "
                                  f"{self.clocks[worker]}")
            if clock == 0 and not roster.started:
                roster.arrive(worker)
                self.cond.notify_all()  # the barrier may be down now (and observers see arrivals)
            awaits = self._awaits(worker)
            hold = admission_timeout if awaits is not None and admission_timeout is not None else timeout
            roster.held.add(worker)  # a worker we hold is not silent: we are the ones keeping it waiting
            try:
                ok = self.cond.wait_for(lambda: self.done or (
                    (clock > 0 or roster.started) and self.version >= roster.pending.get(worker, 0)
                    and self._pull_ready(worker, clock)), hold)
            finally:
                roster.held.discard(worker)
                roster.last_seen[worker] = time.monotonic()
            waited = time.perf_counter() - start
            if not ok and awaits is not None:
                raise PullTimeout(f"worker {worker} is admitted from update {awaits} and {self.name} is at version "
                                  f"{self.version}: ask again")
            if not ok:
                at_barrier = "" if roster.started else \
                    f", at the start barrier: {len(roster.at_start)} of {self.num_workers} workers arrived"
                raise PullTimeout(f"worker {worker} at clock {clock} held {waited:.1f}s by {self.name} "
                                  f"(slowest clock {roster.slowest(self.clocks)}, version {self.version}{at_barrier})")
            if self.done:
                return PullOutcome(self.version, done=True, wait_s=waited, clock_gap=0, value=None)
            if worker in roster.pending:  # a joiner's first pull, served: it is in the run from here
                roster.served(worker, clock, roster.slowest(self.clocks), self.version)
            gap = max(0, clock + roster.offset[worker] - roster.slowest(self.clocks))
            self.stats.gaps[gap] += 1
            self.stats.max_clock_gap = max(self.stats.max_clock_gap, gap)
            return PullOutcome(self.version, done=False, wait_s=waited, clock_gap=gap, value=read())

    def _commit(self, grad: torch.Tensor) -> None:
        """Count one update, then apply it (apply() sees the version its update makes); if apply
        fails the count is taken back: the version always names the parameters' state."""
        self.version += 1
        try:
            self._apply(grad)
        except BaseException:
            self.version -= 1
            raise

    def close(self) -> None:
        """Wake every blocked pull (they return done) and refuse further pushes."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
