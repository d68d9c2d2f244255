"""Who is in the run: the membership collaborator of a consistency policy (psgd/core/policy.py).

The rules (psgd/core/rules.py) speak of "the slowest worker still in the run"; the roster says who
that is. It keeps, for the policy's `num_workers` slots:

- absent: slots not (yet) admitted (`--elastic`, `--max-workers`); pending: admitted async / SSP
  joiners whose first pull is not served yet, with the update it waits for; offset: a joiner's
  clock lead (it counts its clocks from 0, but starts at the slowest live worker's clock);
- lost and departed workers (in the run's `Stats`, which the shard reports), and how often a lost
  one rejoined; the membership log (the update, the worker, joined / left / lost);
- when each worker was last heard from, and which pulls the policy holds now (a held worker is not
  silent: the policy is keeping it waiting), for leases (`silent`);
- the start barrier: who asked for its first pull (clock 0), and whether the barrier is down.

Every method is called with the policy's lock held: the roster has no lock of its own. It knows
nothing of steps, quorums or budgets (those are the policy's); `gone()` is what the rules need.
"""

from __future__ import annotations

import time

from psgd.core import rules
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

    def gone(self) -> set[int]:
        """Workers nobody waits for: lost, departed, absent, or admitted and not yet served."""
        return self.stats.lost.keys() | self.stats.departed.keys() | self.absent | self.pending.keys()

    def slowest(self, clocks: list[int]) -> int:
        """The rules' `slowest` (psgd/core/rules.py) over this run's workers: the gone ones left out,
        joiners' offsets counted."""
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
        self.at_start.discard(worker)

    def served(self, worker: int, clock: int, slowest: int, version: int) -> None:
        """A pending joiner's first pull is served: it is in the run from here, at the slowest clock."""
        self.offset[worker] = slowest - clock
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
