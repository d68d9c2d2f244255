"""Who is in a shard's run: join, leave, loss (the `Membership` part of `psgd.ps.shard.Shard`).

- `join(worker_id, clock, num_elements)`: a worker asks for a slot in the running job (psgd worker
  --join): worker_id None takes the lowest free slot (the first shard's answer; the worker then
  names that slot, and sync's `clock`, to the other shards). Sync: its first step is `clock`, or
  (None) two steps past this shard's version, a step boundary no shard has reached yet (sync
  shards are at most one step apart). Async / SSP: its first pull is served at once and it starts
  at the slowest worker's clock. Returns (worker_id, clock, version); refused with
  FAILED_PRECONDITION when the shard is not initialised, the run has finished or is full, and
  INVALID_ARGUMENT for another model's length (the policy's `admit`). `cancel_join(worker_id)`
  undoes a join whose worker has not begun (another shard refused it), so no slot is lost.
- `leave(worker_id, shard)`: a worker has finished and sends nothing more; returns how many
  distinct workers have left. Once all N have, `finished` is set: the shard's run is over and its
  server stops by itself (psgd/train/serve.py), so a run started by hand ends without a signal.
- `expire(lease)` / `lose(worker)`: workers declared lost (silent past their lease, or seen dead
  by the launcher) count as gone for `finished`, and the DC-ASGD snapshot each held goes back.
"""

from __future__ import annotations

from psgd.core.consistency import PolicyError
from psgd.core.errors import Code, ShardError


class Membership:
    """The Shard's membership requests (the policy keeps the roster: psgd/core/roster.py)."""

    def leave(self, worker_id: int, shard: int) -> int:
        """Worker `worker_id` has finished; returns how many distinct workers have left. A second
        Leave of one worker counts once (a retried RPC must not end the run early). A worker that
        leaves before the budget is spent departs the policy (psgd/core/consistency.py)."""
        self._check_sender(worker_id, shard)
        # Before the budget is spent (a user's own loop that ran out of batches), nobody waits for it
        # from now on (the policy's `depart`); at the end of a run, as `psgd run`'s workers leave, a no-op.
        self.policy.depart(worker_id)
        self._write_pending()  # an update the departure completed: its checkpoint, as a push would write it
        with self.lock:
            self.left.add(worker_id)
            for remedy in self.remedies:
                remedy.forget(self, worker_id)
            self._maybe_finished()
            return len(self.left)

    def join(self, worker_id: int | None, clock: int | None, num_elements: int) -> tuple[int, int, int]:
        """A worker asks for a slot in the running job (see the module docstring)."""
        if not self.ready.is_set():
            raise ShardError(Code.FAILED_PRECONDITION, f"shard {self.index} is not initialised yet: join once the "
                             "run has started")
        if num_elements != self.num_elements:
            raise ShardError(Code.INVALID_ARGUMENT, f"shard {self.index} of this run has {self.num_elements} "
                             f"elements, the joining worker's model gives it {num_elements}: another model")
        try:
            if worker_id is not None:
                self._check_sender(worker_id, self.index)
            # clock None: the policy picks it under its lock (sync: two steps past this version).
            worker, first = self.policy.admit(worker_id, clock)
        except PolicyError as e:
            raise ShardError(Code.FAILED_PRECONDITION, str(e)) from None
        return worker, first, self.policy.version

    def cancel_join(self, worker_id: int) -> None:
        """Undo `join` for a worker that has not begun (another shard refused it): its slot is free
        again. FAILED_PRECONDITION when it has begun (it must Leave instead)."""
        self._check_sender(worker_id, self.index)
        try:
            self.policy.cancel(worker_id)
        except PolicyError as e:
            raise ShardError(Code.FAILED_PRECONDITION, str(e)) from None

    def expire(self, lease: float) -> list[tuple[int, int]]:
        """Declare lost the workers silent for `lease` seconds (the policy's `expire`), with their
        clocks; a lost worker never Leaves, so it counts as gone for `finished`, and the DC-ASGD
        snapshot it held goes back."""
        gone = self.policy.expire(lease)
        self._forget_lost(gone)
        return gone

    def lose(self, worker: int) -> int | None:
        """Declare `worker` lost now (the launcher saw its process die; the policy's `lose`), as
        `expire` would after its lease; returns its clock, None when it was gone already."""
        clock = self.policy.lose(worker)
        self._forget_lost([] if clock is None else [(worker, clock)])
        return clock

    def _forget_lost(self, gone: list[tuple[int, int]]) -> None:
        if gone:
            self._write_pending()  # sync: a lost worker's departure may have completed a step
            with self.lock:
                for w, _ in gone:
                    for remedy in self.remedies:
                        remedy.forget(self, w)
                self._maybe_finished()

    def _maybe_finished(self) -> None:
        if len(self.left | self.policy.stats.lost.keys() | self.policy.roster.absent) == self.workers:  # lock held
            self.finished.set()
