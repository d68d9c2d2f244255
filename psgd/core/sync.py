"""Sync (BSP) as production runs it: the rule of psgd/core/rules.py with a quorum, backup workers
and elastic membership, its step's gradients summed by its collaborator psgd/core/stepsum.py.

Without backup workers or joins a step's update waits for all N gradients, then their mean (summed
in worker order) is applied once, and a pull of clock c waits for c updates: the textbook's BSP,
tests/test_textbook.py checks it bit for bit. The rest of this file is what a real run needs
around that rule: who makes the quorum when workers join (`--elastic`), leave or are lost, and
Chen et al.'s backup workers (see `Sync`).

Membership (psgd/core/roster.py has who is in): a worker lost or departed before the budget is
spent shrinks the quorum at once (if it pushed for the current step already, once that step is
applied), the step it held up is applied from the others, the budget loses the steps it will not
push (the run still ends at `--steps` updates), and it cannot rejoin. A worker admitted from
step `at` (`--elastic`) computes step `at` first (its clock starts there) and the quorum grows by
one at that step boundary; the budget grows by the steps it will push, and `at` must not be a
step already applied. The update stays the mean of the step's gradients: with a fixed per-worker
batch the effective batch follows the quorum and the rate does not; `quorum_lr` divides the sum by
the starting workers instead (the rate scales with the quorum, Goyal et al. 2017's linear rule).

Memory: the step is folded in worker order as it comes (stepsum.py), and the shard asks `turn`
before reading a push's data, so a push waits in its worker until every lower-ranked worker of the
step has pushed or is gone: a shard holds the running sum and the one gradient being received,
whatever N and the arrival order. The order only waits on lower ranks, the same on every shard,
so worker 0 never waits and no cycle can form. Backup workers keep the old path (their step is
the first N-b to arrive, so every gradient is held until the step is complete, then summed in
worker order); a joiner admitted into the running step below a worker already folded is added
where it comes (reproducible as far as its admission is).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from psgd.core import rules
from psgd.core.outcomes import PolicyError
from psgd.core.policy import Policy
from psgd.core.stepsum import StepSum


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

    rejoins = False  # a lost sync worker departs: the quorum shrank without it

    def __init__(self, num_workers: int, apply: Callable[[torch.Tensor], None],
                 budget: int | None = None, start_barrier: bool = False, backup: int = 0,
                 members: int | None = None, rule: rules.Rule | None = None) -> None:
        if not 0 <= backup < num_workers:
            raise ValueError(f"backup workers must be in 0..{num_workers - 1} (N - 1), got {backup}")
        rule = rules.Sync() if rule is None else rule
        assert not rule.on_arrival, f"{rule.name} applies on arrival: it has no step to gather (policy.py)"
        super().__init__(num_workers, rule, apply, budget, start_barrier, members=members)
        if backup and self.members < num_workers:
            raise ValueError("backup workers and elastic membership exclude each other")
        self.backup = backup
        self.quorum = self.members - backup         # gradients that make a step's update
        self.last_step = [-1] * num_workers         # step (base_version) of each worker's last push
        self.step = StepSum()  # this step's gradients, folded in worker order (`turn`)
        self._steps = budget // self.members if budget is not None and not backup else 0  # each worker's share
        self._shrink = 0  # departed workers whose last gradient is in the current step (`_on_depart`)
        self._future: dict[int, int] = {}  # admitted workers whose first step is still to come -> that step
        self.quorum_lr = False  # scale each update with its quorum (`--quorum-lr`; set by the assembler)

    def _step(self, worker: int, clock: int) -> int:
        # With backup workers a worker's next step is the one after the step it last pushed for, not
        # its clock: the rule serves a late worker at once, with the newest parameters (it catches up).
        return self.last_step[worker] + 1 if self.backup else clock

    def _late(self, worker: int, base_version: int) -> bool:
        if not self.backup:
            return False
        if base_version <= self.last_step[worker]:
            raise PolicyError(f"sync: worker {worker} pushed for step {base_version} after pushing for step "
                              f"{self.last_step[worker]}")
        self.last_step[worker] = base_version
        return base_version < self.version

    def _gather(self, worker: int, clock: int, grad: torch.Tensor | None,
                keep: bool) -> tuple[bool, bool, torch.Tensor | None]:
        if not self.backup and clock != self.version:
            raise PolicyError(f"sync: worker {worker} pushed for step {clock} while the shard is at step "
                              f"{self.version}")
        # Backup workers' step is the first N-b to arrive, unknown until they have: summed at the end.
        upto = 0 if self.backup else self._lowest_due(worker)
        kept, spare = self.step.add(worker, grad, self.step.arrived + 1 >= self.quorum, keep, upto)
        return self._maybe_update(), kept, spare

    def _lowest_due(self, but: int) -> int:
        """The lowest worker other than `but` whose gradient of the current step is still to come
        (not pushed, not gone, not a joiner of a later step); N when none (cond held)."""
        gone = self.roster.gone()
        return next((w for w in range(self.num_workers)
                     if w != but and self.clocks[w] == self.version and w not in gone), self.num_workers)

    def turn(self, worker: int, clock: int, timeout: float | None = None,
             idle: Callable[[], bool] = lambda: True) -> bool:
        """Wait until `worker`'s push of step `clock` is the next the step folds: every lower-ranked
        worker of the step has pushed or is gone. The shard asks before reading the push's data, so
        early pushes wait in their workers (their bytes in the transport's flow-control window), and
        it holds the running sum and one gradient being received, whatever N and the arrival order.
        `idle()` (asked under the lock): the previous push's buffer is back, so that this one reuses
        it (the shard's). False after `timeout`. At once for backup workers (their step is the first N-b to arrive), a
        push of another step (refused by `push`), a worker that is gone, and a done run."""
        if self.backup:
            return True
        self._check_worker(worker)
        with self.cond:
            self.roster.held.add(worker)  # we keep it waiting: not silent (--worker-lease)
            try:
                return self.cond.wait_for(lambda: self.done or clock != self.version or worker in self.roster.gone()
                                          or (self._lowest_due(worker) > worker and idle()), timeout)
            finally:
                self.roster.held.discard(worker)
                self.roster.last_seen[worker] = time.monotonic()

    def _maybe_update(self) -> bool:
        """Apply the step's mean once its quorum has arrived (cond held); True if it did."""
        if self.step.arrived == 0 or self.step.arrived < self.quorum:
            return False

        def finish(total: torch.Tensor, count: int) -> None:
            # The mean; with `quorum_lr` the sum over the starting workers instead: a step of N
            # gradients is N / members times as large (the linear scaling rule, for SGD).
            self._commit(total.div_(self.members if self.quorum_lr else count))

        if not self.step.apply(finish, keep=self.quorum + 1):
            self.version += 1  # every gradient of the round was skipped: an update that changes nothing
        joining = sorted(w for w, at in self._future.items() if at == self.version)
        self.quorum, self._shrink = self.quorum - self._shrink + len(joining), 0
        for w in joining:  # their first step begins now: the next update averages their gradients too
            del self._future[w]
            self.roster.log(w, "joined", self.version, self.clocks[w])
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
        if at > 0 or self.roster.started:
            self.roster.at_start.add(worker)  # it never pulls at the start barrier
        if at == self.version:  # the current step is not complete (it would be applied): it waits for this one too
            self.quorum += 1
            self.roster.log(worker, "joined", self.version, at)
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

    def _on_lost(self, worker: int) -> None:
        self._on_depart(worker)  # the quorum shrinks at once; it cannot come back

    def _on_depart(self, worker: int) -> None:
        if self.backup:
            # Each step is made from the first N-b gradients; once more than b workers are gone, from
            # every worker still in the run (and the budget counts the gradients of that quorum).
            live = self.num_workers - len(self.roster.gone() | {worker})
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
