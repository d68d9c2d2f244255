"""Who is in the run: the membership of a consistency policy (psgd/core/policy.py), in two parts.

`Roster`, the bookkeeping: for the policy's `num_workers` slots, who is absent (not yet admitted:
`--elastic`, `--max-workers`), pending (an admitted async / SSP joiner whose first pull is not
served yet, with the update it waits for), each joiner's clock offset (it counts its clocks from 0
but starts at the slowest live worker's clock), the lost and departed workers (in the run's
`Stats`, which the shard reports) and the membership log (the update, the worker, joined / left /
lost), when each worker was last heard from and which pulls the policy holds now (a held worker is
not silent: the policy is keeping it waiting). `gone()` is what the rules need: the workers
`slowest` leaves out (psgd/core/rules.py). It knows nothing of steps, quorums or budgets.

`Membership`, the policy's side (a mixin of `Policy`; Sync adjusts its quorum in the `_on_*`
hooks, psgd/core/sync.py):

- Start barrier (opt-in, `start_barrier=True`; the shard server always sets it): every worker's
  first pull (clock 0) is held until all N workers have asked for theirs, so nobody trains before
  the last one has started up, and the run's clock starts at the same instant for all. It only
  ever holds clock-0 pulls, and once down it stays down; `close()` releases it, a pull deadline
  ends the wait with PullTimeout as usual. Off, a unit test may drive any subset.
- Lost workers (async and SSP: the shard calls `expire(lease)` now and then, psgd/ps/server.py):
  a worker that sent no push or pull for `lease` seconds, and whose pull the policy is not
  holding, is declared lost at its clock. It leaves the clock bookkeeping (SSP waits on the live
  workers only, the start barrier counts it as arrived), its later requests are refused, and the
  run's budget is spent by the others; a worker that pulls again at the clock it was lost at (a
  restarted process) rejoins there. In sync a lost worker departs instead: the quorum shrinks at
  once, the step it held up is applied from the others, and it cannot rejoin.
- Departed workers (`depart(worker)`, on a worker's Leave): one that finished before the run's
  budget was spent (a user's loop ran out of batches, psgd.connect) sends nothing more, and nobody
  waits for it: SSP's slowest clock and the start barrier skip it, and Sync takes a step's update
  from the workers still in the run, its budget dropping by the steps the departed one will not
  push. A worker that leaves once the budget is spent (every worker of `psgd run`) changes nothing.
- Elastic membership (`members` < `num_workers`, and `admit(worker, at)`; psgd/core/elastic.py
  has the schedules): the first `members` slots are in the run from the start, the others count
  as gone until admitted. Async / SSP: a joiner's first pull is held until the shard's version
  reaches `at`; served, it is in, at the slowest live worker's clock (its offset), so SSP's bound
  neither stalls the others for it nor lets it run ahead; the budget (gradients in all) is
  unchanged. Sync: its quorum grows at step `at` (psgd/core/sync.py). `admission(worker)` is that
  update while the first pull waits for it; `stats.membership` logs every change;
  `Roster.admit(None)` takes the lowest absent slot (psgd worker --join).

Every method runs with the policy's lock (`cond`) held or takes it: no lock of its own.
"""

from __future__ import annotations

import threading
import time

from psgd.core import rules
from psgd.core.clocks import Clocks
from psgd.core.outcomes import PolicyError, Stats


class Roster:
    def __init__(self, num_workers: int, members: int, stats: Stats, start_barrier: bool) -> None:
        self.num_workers = num_workers
        self.stats = stats                       # lost, departed, rejoined and the log live there
        self.absent: set[int] = set(range(members, num_workers))  # slots not (yet) admitted
        self.pending: dict[int, int] = {}        # async / SSP: admitted worker -> the update its first pull waits for
        self.offset = [0] * num_workers          # async / SSP: a joiner's clock lead (see `join`)
        self.at_start: set[int] = set()          # workers that asked for their first pull (clock 0)
        self.started = not start_barrier         # the start barrier is down (or was never up)
        # When each worker's last request came; None until its first. A worker never heard from is
        # measured from the first request of any worker: before that, all are still starting up.
        self.last_seen: list[float | None] = [None] * num_workers
        self.first_seen: float | None = None
        self.held: set[int] = set()              # workers whose pull the policy is holding now
        self.epoch = 0                           # in-place offset changes (Clocks' index is rebuilt on one)

    def gone(self) -> set[int]:
        """Workers nobody waits for: lost, departed, absent, or admitted and not yet served."""
        return self.stats.lost.keys() | self.stats.departed.keys() | self.absent | self.pending.keys()

    def slowest(self, clocks: list[int]) -> int:
        """The rules' `slowest` (psgd/core/rules.py) over this run's workers: the gone ones left out,
        joiners' offsets counted. The policy's `Clocks` answers from its index (psgd/core/clocks.py)."""
        if isinstance(clocks, Clocks):
            return clocks.slowest(self.gone(), self.offset, self.epoch)
        return rules.slowest(clocks, self.gone(), self.offset)

    def check_live(self, worker: int) -> None:
        """Refuse a lost, departed or absent worker; note when a live one was last heard from."""
        if worker in self.absent:
            raise PolicyError(f"worker slot {worker} is not in the run (join it first: psgd worker --join)")
        if worker in self.stats.departed:
            raise PolicyError(f"worker {worker} left the run at clock {self.stats.departed[worker]}")
        if worker in self.stats.lost:
            raise PolicyError(f"worker {worker} was declared lost at clock {self.stats.lost[worker]} (silent for "
                              "longer than --worker-lease); the run goes on without it")
        self.heard(worker)

    def heard(self, worker: int) -> None:
        self.last_seen[worker] = time.monotonic()
        if self.first_seen is None:
            self.first_seen = self.last_seen[worker]

    def arrive(self, worker: int) -> None:
        """`worker` asks for its first pull: the barrier is down once every slot arrived or is gone."""
        self.at_start.add(worker)
        self.recount()

    def recount(self) -> None:
        self.started = self.started or len(self.at_start | self.gone()) == self.num_workers

    def silent(self, now: float, lease: float) -> list[int]:
        """Live workers not heard from for more than `lease` seconds whose pull is not held. An
        admitted joiner not yet served (pending) counts too: one that died before its first pull would
        otherwise keep its slot, and the shard would never finish. [] before anyone was heard from."""
        if self.first_seen is None:
            return []
        quiet = ((self.gone() - self.pending.keys()) | self.held | self.stats.lost.keys()
                 | self.stats.departed.keys())
        return [w for w in range(self.num_workers) if w not in quiet and w not in self.absent
                and now - (self.last_seen[w] or self.first_seen) > lease]

    def lose(self, worker: int, clock: int, version: int) -> None:
        self.pending.pop(worker, None)
        self.stats.lost[worker] = clock
        self.log(worker, "lost", version, clock)

    def rejoin(self, worker: int) -> None:
        """A lost worker asks again for the clock it was lost at (a restarted process): it is back."""
        del self.stats.lost[worker]
        self.stats.rejoined[worker] += 1

    def depart(self, worker: int, clock: int, version: int) -> None:
        self.stats.departed[worker] = clock
        self.log(worker, "left", version, clock)

    def admit(self, worker: int | None) -> int:
        """Take absent slot `worker` (None: the lowest absent one) into the run; returns the slot."""
        if worker is None:
            if not self.absent:
                raise PolicyError(f"the run is full: all {self.num_workers} worker slots are taken (start its "
                                  "shards with more, psgd run --max-workers)")
            worker = min(self.absent)
        elif worker not in self.absent:
            raise PolicyError(f"worker slot {worker} is in the run already")
        return worker

    def admitted(self, worker: int) -> None:
        self.absent.discard(worker)
        self.last_seen[worker] = time.monotonic()  # a lease counts from its admission, not the run's start

    def cancel(self, worker: int) -> None:
        """Undo an admission whose worker has not begun: the slot is absent again."""
        self.absent.add(worker)
        self.offset[worker], self.last_seen[worker] = 0, None
        self.epoch += 1
        self.at_start.discard(worker)

    def served(self, worker: int, clock: int, slowest: int, version: int) -> None:
        """A pending joiner's first pull is served: it is in the run from here, at the slowest clock."""
        self.offset[worker] = slowest - clock
        self.epoch += 1
        del self.pending[worker]
        self.log(worker, "joined", version, clock)

    def log(self, worker: int, event: str, version: int, clock: int) -> None:
        self.stats.membership.append({"update": version, "worker": worker, "event": event,
                                      "clock": clock + self.offset[worker], "time": time.time()})

    def state(self) -> dict:
        """Who is in the run, for a checkpoint (`restore` takes it back)."""
        return {"absent": sorted(self.absent), "pending": {str(w): a for w, a in self.pending.items()},
                "offset": list(self.offset), "departed": {str(w): c for w, c in self.stats.departed.items()},
                "lost": {str(w): c for w, c in self.stats.lost.items()}, "log": list(self.stats.membership)}

    def restore(self, state: dict) -> None:
        self.absent = set(state["absent"])
        self.pending = {int(w): a for w, a in state["pending"].items()}
        self.offset = list(state["offset"])
        self.stats.departed = {int(w): c for w, c in state["departed"].items()}
        self.stats.lost = {int(w): c for w, c in state["lost"].items()}
        self.stats.membership = list(state["log"])


class Membership:
    """The policy's membership protocol (a mixin of psgd/core/policy.py `Policy`, whose fields it
    reads: cond, roster, clocks, version, stats, budget, done); the `_on_*` hooks are a mode's own
    part, Async's and SSP's here, Sync's in psgd/core/sync.py."""

    cond: threading.Condition
    roster: Roster
    clocks: list[int]
    version: int
    num_workers: int
    stats: Stats
    budget: int | None
    done: bool

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise PolicyError(f"worker id {worker} out of range 0..{self.num_workers - 1}")

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

    # -- the protocol (the roster keeps who is in; the mode adjusts its quorum) ----------------
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
