"""Consistency policies of a parameter shard: when a pull is served, when a gradient is applied.

Three policies share one small state machine (version counter, per-worker clocks, a budget):

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
the worker, joined / left / lost). `free_slot()` names the lowest absent slot (psgd worker --join).

Clock of a worker = how many of its gradients this shard has received. Staleness of an
applied gradient = shard version when applied - version the worker computed it from.
Clock gap of a served pull = the pulling worker's clock - the slowest worker's clock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
Adjust = Callable[[torch.Tensor, int, int], torch.Tensor | None]   # (grad, worker, staleness) -> what to take


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


class Policy:
    """Base state machine; subclasses set `_pull_ready` and `_on_gradient`."""

    name = "base"

    def __init__(self, num_workers: int, apply: Callable[[torch.Tensor], None] | None = None,
                 budget: int | None = None, start_barrier: bool = False, adjust: Adjust | None = None,
                 members: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        members = num_workers if members is None else members
        if not 1 <= members <= num_workers:
            raise ValueError(f"members must be in 1..{num_workers}, got {members}")
        self.num_workers = num_workers
        self.members = members                  # slots in the run from the start
        self.absent: set[int] = set(range(members, num_workers))  # slots not (yet) admitted
        self.pending: dict[int, int] = {}       # async / SSP: admitted worker -> the update its first pull waits for
        self.offset = [0] * num_workers         # async / SSP: a joiner's clock lead (see `admit`)
        self.budget = budget                    # gradients to accept in total; None = unlimited
        self.at_start: set[int] = set()         # workers that asked for their first pull (clock 0)
        self.started = not start_barrier        # the start barrier is down (or was never up)
        self._apply = apply
        self._adjust = adjust
        self.cond = threading.Condition()
        self.version = 0
        self.accepted = 0
        self.clocks = [0] * num_workers
        self.closed = False
        # When each worker's last request came; None until its first. A worker never heard from is
        # measured from the first request of any worker: before that, all are still starting up.
        self.last_seen: list[float | None] = [None] * num_workers
        self.first_seen: float | None = None
        self.held: set[int] = set()             # workers whose pull the policy is holding now
        self.pushing: tuple[int, int] | None = None  # (worker, clock) of the push being handled
        # push(keep=True), for one push under the lock: whether the caller offered its buffer, and
        # whether the policy kept it (and what it gives back instead).
        self._offered, self._kept = False, False
        self._spare: torch.Tensor | None = None
        self.stats = Stats()

    def attach(self, apply: Callable[[torch.Tensor], None], adjust: Adjust | None = None) -> None:
        """Give the policy its callbacks after construction: a shard builds around a policy it is
        given (psgd/ps/shard.py), and attaches its optimizer step and its remedies here."""
        with self.cond:
            self._apply, self._adjust = apply, adjust

    # -- rules, overridden per policy (called with self.cond held) --------------------------
    def _pull_ready(self, worker: int, clock: int) -> bool:
        raise NotImplementedError

    def _on_gradient(self, worker: int, clock: int, grad: torch.Tensor | None) -> bool:
        """Take one arrived gradient (None = skipped); return True if an update was applied."""
        raise NotImplementedError

    def _late(self, worker: int, base_version: int) -> bool:
        """True: the gradient is too late to be used, and is dropped (only Sync with backup workers)."""
        return False

    # -- public API ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.closed or (self.budget is not None and self.accepted >= self.budget)

    def push(self, worker: int, clock: int, base_version: int,
             grad: torch.Tensor | None, keep: bool = False) -> PushOutcome:
        """Hand over one worker's gradient (None: non-finite, counted as skipped). Never blocks.

        keep=True: the caller gives up `grad`'s memory, and the policy may keep it instead of
        copying it (Sync keeps a step's first gradient as the step's sum); the outcome then says
        `kept` and hands back a `spare` buffer of the same size in its place (or None)."""
        self._check_worker(worker)
        with self.cond:
            self._check_live(worker)
            if worker in self.pending:
                raise PolicyError(f"worker {worker} pushed before its first pull was served (it joins at update "
                                  f"{self.pending[worker]})")
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
            self._offered, self._kept, self._spare = keep, False, None
            try:
                applied = self._on_gradient(worker, clock, grad)
            finally:
                self.pushing, self._offered = None, False
            kept, spare, self._spare = self._kept, self._spare, None
            self.clocks[worker] = clock + 1
            self.accepted += 1
            self.stats.staleness[staleness] += 1
            if grad is None:
                self.stats.skipped_nonfinite += 1
            self.cond.notify_all()
            return PushOutcome(self.version, applied=applied, done=self.done, staleness=staleness,
                               skipped=grad is None, kept=kept, spare=spare)

    def pull(self, worker: int, clock: int, read: Callable[[], T],
             timeout: float | None = None, admission_timeout: float | None = None) -> PullOutcome[T]:
        """Block until the policy allows `worker` at `clock` to read, then call read() locked.

        Returns done (and no value) once the budget is spent. Raises PullTimeout after
        `timeout` seconds, leaving the state untouched; a pull that waits for its worker's
        admission (`admission`), after `admission_timeout` seconds when given, saying "ask again":
        a joiner's wait may be far longer than any deadline, so it is a long poll.
        """
        self._check_worker(worker)
        start = time.perf_counter()
        with self.cond:
            if worker in self.stats.lost and clock == self.clocks[worker] and self.name != "sync":
                # A restarted worker (psgd run --restart-workers) asks for the clock it was lost at:
                # it rejoins the bookkeeping there, as if it had only been slow.
                del self.stats.lost[worker]
                self.stats.rejoined[worker] += 1
            self._check_live(worker)
            # A pull's clock is the clock of the push that follows it: anything else would
            # let a wrong clock slip past the gate (a pull at clock 0 is never held by SSP).
            # Once the run is done every pull is answered done, whatever its clock.
            if clock != self.clocks[worker] and not self.done:
                raise PolicyError(f"worker {worker} pulled for clock {clock}, but its next push is clock "
                                  f"{self.clocks[worker]}")
            if clock == 0 and not self.started:
                self.at_start.add(worker)
                self.started = len(self.at_start | self._gone()) == self.num_workers
                self.cond.notify_all()  # the barrier may be down now (and observers see arrivals)
            awaits = self._awaits(worker)
            hold = admission_timeout if awaits is not None and admission_timeout is not None else timeout
            self.held.add(worker)  # a worker we hold is not silent: we are the ones keeping it waiting
            try:
                ok = self.cond.wait_for(
                    lambda: self.done or ((clock > 0 or self.started) and self.version >= self.pending.get(worker, 0)
                                          and self._pull_ready(worker, clock)), hold)
            finally:
                self.held.discard(worker)
                self.last_seen[worker] = time.monotonic()
            waited = time.perf_counter() - start
            if not ok and awaits is not None:
                raise PullTimeout(f"worker {worker} is admitted from update {awaits} and {self.name} is at version "
                                  f"{self.version}: ask again")
            if not ok:
                at_barrier = "" if self.started else \
                    f", at the start barrier: {len(self.at_start)} of {self.num_workers} workers arrived"
                raise PullTimeout(f"worker {worker} at clock {clock} held {waited:.1f}s by {self.name} "
                                  f"(slowest clock {self._slowest()}, version {self.version}{at_barrier})")
            if self.done:
                return PullOutcome(self.version, done=True, wait_s=waited, clock_gap=0, value=None)
            if worker in self.pending:  # a joiner's first pull, served: it is in the run from here
                self.offset[worker] = self._slowest() - clock  # the others' slowest (it is still pending)
                del self.pending[worker]
                self._log(worker, "joined")
            gap = max(0, clock + self.offset[worker] - self._slowest())
            self.stats.gaps[gap] += 1
            self.stats.max_clock_gap = max(self.stats.max_clock_gap, gap)
            return PullOutcome(self.version, done=False, wait_s=waited, clock_gap=gap, value=read())

    def _commit(self, grad: torch.Tensor) -> None:
        """Count one update, then apply it: apply() sees the version its update makes. If apply
        fails the count is taken back, so the version always names the parameters' state."""
        self.version += 1
        try:
            self._apply(grad)
        except BaseException:
            self.version -= 1
            raise

    def expire(self, lease: float, now: float | None = None) -> list[tuple[int, int]]:
        """Declare lost every live worker not heard from for more than `lease` seconds whose pull
        is not being held (see the module docstring); returns the newly lost with their clocks.
        Never once the run is done, never before any worker was heard from (they are all starting
        up). In sync a lost worker departs (`_on_depart`): the quorum shrinks, so the step it held
        up is applied from the others, and it cannot come back. `now` (time.monotonic) lets a test
        drive it without waiting."""
        now = time.monotonic() if now is None else now
        with self.cond:
            if self.done or self.first_seen is None:
                return []
            # An admitted joiner not yet served (async / SSP pending) counts too: one that died before its
            # first pull would otherwise keep its slot, and the shard would never finish.
            quiet = ((self._gone() - self.pending.keys()) | self.held | self.stats.lost.keys()
                     | self.stats.departed.keys())
            gone = [w for w in range(self.num_workers) if w not in quiet and w not in self.absent
                    and now - (self.last_seen[w] or self.first_seen) > lease]
            self._declare_lost(gone)
            return [(w, self.stats.lost[w]) for w in gone]

    def lose(self, worker: int) -> int | None:
        """Declare `worker` lost now, as `expire` would once its lease ran out: its process was seen
        to die (psgd run's launcher), so there is nothing to wait for. Returns its clock; None when
        it is gone already (lost, departed, absent) or the run is done."""
        self._check_worker(worker)
        with self.cond:
            if self.done or worker in self.stats.lost.keys() | self.stats.departed.keys() | self.absent:
                return None
            self._declare_lost([worker])
            return self.stats.lost[worker]

    def _declare_lost(self, gone: list[int]) -> None:
        """Take `gone` out of the run at their clocks (cond held): see `expire`."""
        for w in gone:
            self.pending.pop(w, None)
            self.stats.lost[w] = self.clocks[w]
            self._log(w, "lost")
            if self.name == "sync":
                self._on_depart(w)
        if gone:
            self.started = self.started or len(self.at_start | self._gone()) == self.num_workers
            self.cond.notify_all()  # SSP's slowest clock and the start barrier may have moved

    def depart(self, worker: int) -> None:
        """`worker` sends nothing more (see the module docstring). Idempotent; no-op once done."""
        self._check_worker(worker)
        with self.cond:
            if self.done or worker in self.stats.departed or worker in self.stats.lost:
                return
            self.stats.departed[worker] = self.clocks[worker]
            self._log(worker, "left")
            self._on_depart(worker)
            self.started = self.started or len(self.at_start | self._gone()) == self.num_workers
            self.cond.notify_all()

    def admit(self, worker: int | None, at: int | None) -> tuple[int, int]:
        """Take absent slot `worker` (None: the lowest absent one, picked and taken under one lock)
        into the run from update `at` (None: the next safe one, see `_on_admit`); returns (the slot,
        the clock its first pull and push carry). PolicyError, state unchanged, when the run is
        done, full, the slot is taken, or (sync) step `at` is applied already."""
        if worker is not None:
            self._check_worker(worker)
        with self.cond:
            if self.done:
                raise PolicyError("the run has finished (its budget is spent): nothing to join")
            if worker is None:
                if not self.absent:
                    raise PolicyError(f"the run is full: all {self.num_workers} worker slots are taken (start its "
                                      "shards with more, psgd run --max-workers)")
                worker = min(self.absent)
            elif worker not in self.absent:
                raise PolicyError(f"worker slot {worker} is in the run already")
            clock = self._on_admit(worker, at)
            self.absent.discard(worker)
            self.last_seen[worker] = time.monotonic()  # a lease counts from its admission, not the run's start
            self.cond.notify_all()
            return worker, clock

    def admission(self, worker: int) -> int | None:
        """The update an admitted worker's first pull waits for while it waits (not yet served),
        else None: `pull` holds such a pull for `admission_timeout` at most."""
        with self.cond:
            return self._awaits(worker)

    def _awaits(self, worker: int) -> int | None:
        """`admission` for this policy (cond held): async and SSP hold the first pull (`pending`)."""
        return self.pending.get(worker)

    def cancel(self, worker: int) -> None:
        """Undo an admission whose worker has not begun (a join that another shard refused): the slot
        is absent again and the budget as before. PolicyError when it has begun (then it Leaves)."""
        self._check_worker(worker)
        with self.cond:
            if worker in self.absent or not self._on_cancel(worker):
                raise PolicyError(f"worker slot {worker} has no admission to cancel (it is absent, or it has begun: "
                                  "it must leave instead)")
            self.absent.add(worker)
            self.clocks[worker], self.offset[worker], self.last_seen[worker] = 0, 0, None
            self.at_start.discard(worker)
            self.cond.notify_all()

    def _on_cancel(self, worker: int) -> bool:
        """A policy's own undo of `_on_admit` (cond held); False when the worker has begun."""
        return self.pending.pop(worker, None) is not None

    def _on_admit(self, worker: int, at: int | None) -> int:
        """A policy's own bookkeeping for an admission (cond held): async and SSP hold the first pull
        (`at` None: not at all)."""
        self.pending[worker] = self.version if at is None else at
        self.clocks[worker] = 0
        return 0

    def _log(self, worker: int, event: str) -> None:
        self.stats.membership.append({"update": self.version, "worker": worker, "event": event,
                                      "clock": self.clocks[worker] + self.offset[worker], "time": time.time()})

    def membership_state(self) -> dict:
        """Who is in the run, for a checkpoint (cond held; `restore_membership` takes it back)."""
        return {"absent": sorted(self.absent), "pending": {str(w): a for w, a in self.pending.items()},
                "offset": list(self.offset), "departed": {str(w): c for w, c in self.stats.departed.items()},
                "lost": {str(w): c for w, c in self.stats.lost.items()}, "log": list(self.stats.membership),
                "budget": self.budget}

    def restore_membership(self, state: dict) -> None:
        with self.cond:
            self.absent = set(state["absent"])
            self.pending = {int(w): a for w, a in state["pending"].items()}
            self.offset = list(state["offset"])
            self.stats.departed = {int(w): c for w, c in state["departed"].items()}
            self.stats.lost = {int(w): c for w, c in state["lost"].items()}
            self.stats.membership = list(state["log"])
            self.budget = state["budget"]

    def _on_depart(self, worker: int) -> None:
        """A policy's own bookkeeping for a departure (cond held)."""

    def _gone(self) -> set[int]:
        """Workers nobody waits for: lost, departed, absent, or admitted and not yet served (cond held)."""
        return self.stats.lost.keys() | self.stats.departed.keys() | self.absent | self.pending.keys()

    def _check_live(self, worker: int) -> None:
        """Refuse a lost, departed or absent worker (cond held); note when a live one was last heard from."""
        if worker in self.absent:
            raise PolicyError(f"worker slot {worker} is not in the run (join it first: psgd worker --join)")
        if worker in self.stats.departed:
            raise PolicyError(f"worker {worker} left the run at clock {self.stats.departed[worker]}")
        if worker in self.stats.lost:
            raise PolicyError(f"worker {worker} was declared lost at clock {self.stats.lost[worker]} (silent for "
                              "longer than --worker-lease); the run goes on without it")
        self.last_seen[worker] = time.monotonic()
        if self.first_seen is None:
            self.first_seen = self.last_seen[worker]

    def _slowest(self) -> int:
        """The slowest live worker's clock (cond held); a lost or departed worker holds nobody back."""
        gone = self._gone()
        live = [c + self.offset[w] for w, c in enumerate(self.clocks) if w not in gone]
        return min(live) if live else max(c + o for c, o in zip(self.clocks, self.offset, strict=True))

    def close(self) -> None:
        """Stop: wake every blocked pull (they return done) and refuse further pushes."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise PolicyError(f"worker id {worker} out of range 0..{self.num_workers - 1}")


class Async(Policy):
    """Apply every gradient on arrival; never block."""

    name = "async"

    def _pull_ready(self, worker: int, clock: int) -> bool:
        return True

    def _on_gradient(self, worker: int, clock: int, grad: torch.Tensor | None) -> bool:
        if grad is None:
            return False
        self._commit(grad)
        return True


class SSP(Async):
    """Apply on arrival; block a pull whose clock is more than `staleness` ahead of the slowest."""

    name = "ssp"

    def __init__(self, num_workers: int, apply: Callable[[torch.Tensor], None],
                 staleness: int, budget: int | None = None, start_barrier: bool = False,
                 adjust: Adjust | None = None, members: int | None = None) -> None:
        if staleness < 0:
            raise ValueError(f"staleness bound must be >= 0, got {staleness}")
        super().__init__(num_workers, apply, budget, start_barrier, adjust, members)
        self.staleness_bound = staleness

    def _pull_ready(self, worker: int, clock: int) -> bool:
        return clock + self.offset[worker] - self._slowest() <= self.staleness_bound


class Sync(Policy):
    """BSP: buffer the gradients of step t, apply their mean once, then release step t+1.

    Without backup workers (b = 0) a step's update waits for all N gradients, and a worker's
    clock is the step it computes: its push of clock c must come while the shard is at version c.

    With b backup workers (0 < b < N; Chen et al. 2016) the update of step t is applied once the
    first N-b gradients computed from version t arrived; the b that come later are dropped. The
    step a gradient belongs to is the version it was computed from (its `base_version`), no longer
    its clock, because a slow worker falls behind:

    - a push whose base_version is older than the shard's version is late: it is taken (the
      worker's clock, the count of its pushes, moves on as always) and dropped, never applied,
      and counted in `stats.dropped` per worker. Not in the budget (`accepted`), which counts the
      gradients that went into updates: the budget is `steps x (N - b)`, so the run still ends at
      exactly `steps` updates, and the late gradients still arriving then are refused with done;
    - a worker's pull is served once the update of the step it last pushed for is applied
      (`version > last_step[worker]`). A late worker's step is applied already, so its next pull
      is served at once, with the newest parameters, and its next push is for the current step:
      it catches up, however many steps it fell behind (the client tags each push with the
      version its pull returned). A worker that was in time waits for its step's update, as in
      BSP, so no worker pushes twice for one step (a second push for a step is refused);
    - the start barrier is unchanged: every worker's clock-0 pull waits until all N arrived.

    With K > 1 shards each shard picks its own first N-b, so one update may hold worker A's
    gradient on shard 0 and worker B's on shard 1 (TensorFlow's SyncReplicasOptimizer does the
    same per variable): every slice of the update is still a mean of N-b gradients of step t.
    With b = 0 every rule above reduces to BSP's, and the code takes BSP's path unchanged.
    """

    name = "sync"

    def __init__(self, num_workers: int, apply: Callable[[torch.Tensor], None],
                 budget: int | None = None, start_barrier: bool = False, backup: int = 0,
                 members: int | None = None) -> None:
        if not 0 <= backup < num_workers:
            raise ValueError(f"backup workers must be in 0..{num_workers - 1} (N - 1), got {backup}")
        super().__init__(num_workers, apply, budget, start_barrier, members=members)
        if backup and self.members < num_workers:
            raise ValueError("backup workers and elastic membership exclude each other")
        self.backup = backup
        self.quorum = self.members - backup         # gradients that make a step's update
        self.last_step = [-1] * num_workers         # step (base_version) of each worker's last push
        self._held: dict[int, torch.Tensor] = {}  # this step's gradients by worker, the policy's own
        self._last: tuple[int, torch.Tensor] | None = None  # the gradient that completes the step
        self._spares: list[torch.Tensor] = []  # buffers of earlier steps, reused
        self._arrived = 0
        self._steps = budget // self.members if budget is not None and not backup else 0  # each worker's share
        self._shrink = 0  # departed workers whose last gradient is in the current step (`_on_depart`)
        self._future: dict[int, int] = {}  # admitted workers whose first step is still to come -> that step
        self.quorum_lr = False  # scale each update with its quorum (`--quorum-lr`; set by the assembler)

    def _pull_ready(self, worker: int, clock: int) -> bool:
        if self.backup:
            return self.version > self.last_step[worker]  # its last step's update is applied
        # Step `clock` may start once `clock` mean updates have been applied.
        return self.version >= clock

    def _late(self, worker: int, base_version: int) -> bool:
        if not self.backup:
            return False
        if base_version <= self.last_step[worker]:
            raise PolicyError(f"sync: worker {worker} pushed for step {base_version} after pushing for step "
                              f"{self.last_step[worker]}")
        self.last_step[worker] = base_version
        return base_version < self.version

    def _on_gradient(self, worker: int, clock: int, grad: torch.Tensor | None) -> bool:
        if not self.backup and clock != self.version:
            raise PolicyError(f"sync: worker {worker} pushed for step {clock} while the shard is at step "
                              f"{self.version}")
        if grad is not None:
            if self._arrived + 1 >= self.quorum:
                self._last = (worker, grad)  # completes the step: read in the sum below, never kept
            else:
                self._held[worker] = self._own(grad)
        self._arrived += 1
        return self._maybe_update()

    def _own(self, grad: torch.Tensor) -> torch.Tensor:
        """A tensor of the policy's holding `grad`'s values until the step is applied (cond held).
        The caller's own buffer when it gave it up (push(keep=True)), a spare of an earlier step going
        back in its place: one pass over the shard less than a copy (17 MB for 4.3M parameters)."""
        if self._offered:
            self._kept, self._spare = True, self._take_spare(grad)
            return grad
        return self._scratch(grad).copy_(grad)

    def _take_spare(self, like: torch.Tensor) -> torch.Tensor | None:
        for i, t in enumerate(self._spares):
            if t.shape == like.shape and t.dtype == like.dtype:
                return self._spares.pop(i)
        return None

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        buf = self._take_spare(like)
        return torch.empty_like(like) if buf is None else buf

    def _maybe_update(self) -> bool:
        """Apply the step's mean once its quorum has arrived (cond held); True if it did.

        The gradients are summed in worker order, not arrival order: floating-point addition is not
        associative, so with 3 or more workers the arrival order would change the sum's last bits
        and two identical runs would end apart. ((g0 + g1) + g2) + ..., then divided once: within
        float rounding of one process computing the whole global batch, and the same every run."""
        if self._arrived == 0 or self._arrived < self.quorum:
            return False
        held, last = self._held, self._last
        self._arrived, self._held, self._last = 0, {}, None
        parts = dict(held)
        if last is not None:
            parts[last[0]] = last[1]
        owned = list(held.values())
        try:
            if parts:
                order = [parts[w] for w in sorted(parts)]
                mine = [any(g is t for t in owned) for g in order[:2]]
                if len(order) == 1:
                    total = order[0] if mine[0] else self._scratch(order[0]).copy_(order[0])
                elif mine[0]:
                    total = order[0].add_(order[1])
                elif mine[1]:
                    total = torch.add(order[0], order[1], out=order[1])  # a + b == b + a, bit for bit
                else:
                    total = torch.add(order[0], order[1], out=self._scratch(order[0]))
                for g in order[2:]:
                    total.add_(g)
                owned.append(total)
                # The mean; with `quorum_lr` the sum over the starting workers instead: a step of
                # N gradients is N / members times as large (the linear scaling rule, for SGD).
                self._commit(total.div_(self.members if self.quorum_lr else len(order)))
            else:
                self.version += 1  # every gradient of the round was skipped: an update that changes nothing
        finally:
            # Back for later steps (the completing caller's buffer is never among them).
            self._spares.extend({id(t): t for t in owned}.values())
            del self._spares[self.quorum + 1:]
        joining = sorted(w for w, at in self._future.items() if at == self.version)
        self.quorum, self._shrink = self.quorum - self._shrink + len(joining), 0
        for w in joining:  # their first step begins now: the next update averages their gradients too
            del self._future[w]
            self._log(w, "joined")
        return True

    def _on_admit(self, worker: int, at: int | None) -> int:
        if self.backup:
            raise PolicyError("sync with backup workers has a fixed quorum: no worker can join it")
        # None: two steps on, a boundary no shard has reached (sync shards are at most one step apart).
        at = self.version + 2 if at is None else at
        if at < self.version:
            raise PolicyError(f"step {at} is applied already (the shard is at step {self.version}): join at a "
                              "later step")
        self.clocks[worker] = at
        if self.budget is not None:
            self.budget += max(0, self._steps - at)
        if at > 0 or self.started:
            self.at_start.add(worker)  # it never pulls at the start barrier
        if at == self.version:  # the current step is not complete (it would be applied): it waits for this one too
            self.quorum += 1
            self._log(worker, "joined")
        else:
            self._future[worker] = at
        return at

    def _awaits(self, worker: int) -> int | None:
        return self._future.get(worker)  # its step is still to come: its first pull waits for that version

    def _on_cancel(self, worker: int) -> bool:
        at = self._future.pop(worker, None)
        if at is None:
            return False
        if self.budget is not None:
            self.budget -= max(0, self._steps - at)
        return True

    def membership_state(self) -> dict:
        # Taken inside an update's apply (checkpoints), before `_maybe_update` moves the quorum on:
        # saved as it is once this update is done, so a restored shard starts its next step right.
        out = super().membership_state()
        joining = [w for w, at in self._future.items() if at == self.version]
        out["quorum"] = self.quorum - self._shrink + len(joining)
        out["future"] = {str(w): at for w, at in self._future.items() if at != self.version}
        out["log"] = out["log"] + [{"update": self.version, "worker": w, "event": "joined",
                                    "clock": self.version, "time": time.time()} for w in sorted(joining)]
        return out

    def restore_membership(self, state: dict) -> None:
        super().restore_membership(state)
        with self.cond:
            self.quorum = state["quorum"]
            self._future = {int(w): at for w, at in state["future"].items()}

    def _on_depart(self, worker: int) -> None:
        if self.backup:
            # Each step is made from the first N-b gradients; once more than b workers are gone, from
            # every worker still in the run (and the budget counts the gradients of that quorum).
            live = self.num_workers - len(self._gone() | {worker})
            if live < self.quorum and live > 0:
                steps_left = max(0, (self.budget - self.accepted) // self.quorum) if self.budget is not None else 0
                self.quorum = live
                if self.budget is not None:
                    self.budget = self.accepted + steps_left * live
                self._maybe_update()
            return
        # The departed worker pushes no more gradients: one fewer per step from now on, and the
        # budget (steps x N gradients) loses the steps it will not push, so the run still ends at
        # `steps` updates. If it pushed for the current step already, that gradient stays in the
        # step, which still waits for everyone else: the quorum shrinks once the step is applied.
        if self.budget is not None:
            self.budget -= max(0, self._steps - self.clocks[worker])
        if self._future.pop(worker, None) is not None:
            return  # admitted for a step still to come: it was never in a quorum
        if self.clocks[worker] > self.version:
            self._shrink += 1
        else:
            self.quorum -= 1
            self._maybe_update()

def make_policy(mode: str, num_workers: int, apply: Callable[[torch.Tensor], None],
                staleness: int = 0, budget: int | None = None, start_barrier: bool = False,
                adjust: Adjust | None = None, backup: int = 0, members: int | None = None) -> Policy:
    """The policy for a run mode: 'sync' (with `backup` backup workers), 'async' or 'ssp' (`adjust`:
    async and SSP only)."""
    if backup and mode != "sync":
        raise ValueError(f"backup workers are a rule of sync mode, not of {mode}")
    if mode == "sync":
        assert adjust is None, "sync applies the mean of fresh gradients: nothing to adjust"
        return Sync(num_workers, apply, budget, start_barrier, backup, members)
    if mode == "async":
        return Async(num_workers, apply, budget, start_barrier, adjust, members)
    if mode == "ssp":
        return SSP(num_workers, apply, staleness, budget, start_barrier, adjust, members)
    raise ValueError(f"unknown parameter-server mode {mode!r}; choose sync, async or ssp")
