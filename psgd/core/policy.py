"""A consistency policy: a mode's rule (psgd/core/rules.py) with production's bookkeeping around it.

The state machine every mode shares: versions, clocks, a budget, the start barrier, membership (its
collaborator, psgd/core/roster.py). Async and SSP are this class with their rule; Sync adds the
step's sum, its quorum and backup workers (psgd/core/sync.py).
- push: checks clock and version, measures staleness, lets the remedies `adjust` the gradient, then
  the rule's `on_arrival` says whether it is applied now or gathered into the step's sum (Sync's
  `_gather`); never blocks. `turn`: may a push's data be read now (Sync).
- pull: waits until the rule allows the read (start barrier down, a joiner admitted), then read().
- expire / lose / depart / admit / cancel: membership; `membership_state` carries it in checkpoints.
No math, no I/O: `apply(grad)` and `read()` are the shard's callbacks, called under `self.cond`,
which guards every field here and in the roster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from psgd.core.outcomes import PolicyError, PullOutcome, PullTimeout, PushOutcome, Stats
from psgd.core.roster import Roster
from psgd.core.rules import Rule

T = TypeVar("T")
Adjust = Callable[[torch.Tensor, int, int], torch.Tensor | None]   # (grad, worker, staleness) -> what to take


class Policy:
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
        self.clocks = [0] * num_workers
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

    def _on_lost(self, worker: int) -> None: ...    # a live worker was declared lost
    def _on_depart(self, worker: int) -> None: ...  # a worker left before the budget was spent

    def _on_admit(self, worker: int, at: int | None) -> int:
        """Async / SSP hold the admitted worker's first pull until update `at` (None: not at all)."""
        self.roster.pending[worker] = self.version if at is None else at
        self.clocks[worker] = 0
        return 0

    def _on_cancel(self, worker: int) -> bool:
        return self.roster.pending.pop(worker, None) is not None

    def _awaits(self, worker: int) -> int | None:
        return self.roster.pending.get(worker)

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

    # -- membership (the roster keeps who is in; the mode adjusts its quorum) ------------------
    def expire(self, lease: float, now: float | None = None) -> list[tuple[int, int]]:
        """Declare lost the workers silent for over `lease` s whose pull is not held (`Roster.silent`),
        never once the run is done; returns them with their clocks. `now`: time.monotonic, for tests."""
        now = time.monotonic() if now is None else now
        with self.cond:
            if self.done:
                return []
            gone = self.roster.silent(now, lease)
            self._declare_lost(gone)
            return [(w, self.stats.lost[w]) for w in gone]

    def lose(self, worker: int) -> int | None:
        """Declare `worker` lost now, as `expire` would after its lease: psgd run saw its process die.
        Returns its clock; None when it is gone already (lost, departed, absent) or the run is done."""
        self._check_worker(worker)
        with self.cond:
            if self.done or worker in self.stats.lost.keys() | self.stats.departed.keys() | self.roster.absent:
                return None
            self._declare_lost([worker])
            return self.stats.lost[worker]

    def _declare_lost(self, gone: list[int]) -> None:
        for w in gone:
            self.roster.lose(w, self.clocks[w], self.version)
            self._on_lost(w)
        if gone:
            self.roster.recount()
            self.cond.notify_all()  # SSP's slowest clock and the start barrier may have moved

    def depart(self, worker: int) -> None:
        """`worker` sends nothing more: nobody waits for it. Idempotent; no-op once done."""
        self._check_worker(worker)
        with self.cond:
            if self.done or worker in self.stats.departed or worker in self.stats.lost:
                return
            self.roster.depart(worker, self.clocks[worker], self.version)
            self._on_depart(worker)
            self.roster.recount()
            self.cond.notify_all()

    def admit(self, worker: int | None, at: int | None) -> tuple[int, int]:
        """Take absent slot `worker` (None: the lowest absent one) into the run from update `at` (None:
        the next safe one); returns (the slot, its first clock). PolicyError, state unchanged, when
        the run is done, full, the slot is taken, or (sync) step `at` is applied already."""
        if worker is not None:
            self._check_worker(worker)
        with self.cond:
            if self.done:
                raise PolicyError("the run has finished (its budget is spent): nothing to join")
            worker = self.roster.admit(worker)
            clock = self._on_admit(worker, at)
            self.roster.admitted(worker)
            self.cond.notify_all()
            return worker, clock

    def admission(self, worker: int) -> int | None:
        """The update an admitted worker's first pull waits for while it waits, else None."""
        with self.cond:
            return self._awaits(worker)

    def cancel(self, worker: int) -> None:
        """Undo an admission whose worker has not begun (another shard refused the join); PolicyError
        when it has begun (then it Leaves)."""
        self._check_worker(worker)
        with self.cond:
            if worker in self.roster.absent or not self._on_cancel(worker):
                raise PolicyError(f"worker slot {worker} has no admission to cancel (it is absent, or it has begun: "
                                  "it must leave instead)")
            self.roster.cancel(worker)
            self.clocks[worker] = 0
            self.cond.notify_all()

    def membership_state(self) -> dict:
        """Who is in the run, for a checkpoint (cond held; `restore_membership` takes it back)."""
        return {**self.roster.state(), "budget": self.budget}

    def restore_membership(self, state: dict) -> None:
        with self.cond:
            self.roster.restore(state)
            self.budget = state["budget"]

    def close(self) -> None:
        """Wake every blocked pull (they return done) and refuse further pushes."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise PolicyError(f"worker id {worker} out of range 0..{self.num_workers - 1}")
