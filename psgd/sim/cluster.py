"""The simulated cluster: K real shards and N virtual workers on one virtual clock, in one thread.

The shards are production's (`psgd.train.assemble.shard`: the `Shard` of psgd/ps/shard.py with the
run's policy, rule, optimizer and remedies); nothing of them is re-implemented. Their methods are
called as the transports' adapters call them, at the virtual moment a message arrives, and never
block: a pull asks `Shard.pull` with a zero deadline, and one the policy holds (sync's step, SSP's
bound, the start barrier) waits in the shard's list of held pulls until the shard's state moves
(version, slowest clock, barrier, done); a sync push asks `policy.turn` the same way and waits its
turn (lower ranks first) in the shard's list of held pushes.

One step of a worker, as psgd/ps/exchange.py's PushPull does it: the pushes leave when its compute
ends (one message per shard, through its NIC and the shard's: psgd/sim/timemodel.py), each shard's
CPU takes them one at a time, the shard pushes (`Shard.push`) and at once serves the pull of the
next clock (or answers done), and the reply crosses back; the step ends when all K replies are
in. The first step pulls alone (clock 0, held by the start barrier).
"""

from __future__ import annotations

import torch

from psgd.core import codec, sharding
from psgd.core.errors import Code, ShardError
from psgd.sim.events import Clock, Queue, take_both
from psgd.sim.timemodel import TimeModel
from psgd.sim.workers import Replica, VWorker, end_line, step_line
from psgd.train.supervise import RunFailed


class Stalled(RunFailed):
    """No event is left and a worker has not finished: the run cannot go on (the message says who waits)."""


class Refused(RunFailed):
    """A shard refused a request (a non-finite gradient, say): a real worker fails on it, so does the run."""


class Cluster:
    """Run `shards` (real, initialised by `run`) and `workers` on one clock; `write(line)` takes metrics lines."""

    def __init__(self, shards: list, workers: list[VWorker], replica: Replica, tm: TimeModel, wire_dtype: str,
                 all_done: bool, write, base_time: float) -> None:
        self.shards, self.workers, self.replica, self.tm = shards, workers, replica, tm
        self.dtype, self.all_done, self.write, self.base = wire_dtype, all_done, write, base_time
        self.clock = Clock()
        n, k = len(workers), len(shards)
        self.ranges = sharding.shard_ranges(replica.flat.params.numel(), k)
        self.nic_in, self.nic_out, self.cpu = [Queue() for _ in range(k)], [Queue() for _ in range(k)], \
            [Queue() for _ in range(k)]
        self.up, self.down = [Queue() for _ in range(n)], [Queue() for _ in range(n)]
        self.held_pulls: list[list[tuple[int, int, float]]] = [[] for _ in range(k)]
        self.held_pushes: list[list[tuple[int, int, int, float]]] = [[] for _ in range(k)]
        self._seen: list[tuple | None] = [None] * k
        self.version_at: list[dict[int, float]] = [{0: 0.0} for _ in range(k)]  # update -> virtual time
        self.in_flight = self.peak_in_flight = 0  # parameter vectors held for workers (pulled copies, gradients)

    # -- messages -----------------------------------------------------------------------------
    def _send(self, t: float, nbytes: int, src: Queue, dst: Queue) -> float:
        """When a message of `nbytes` sent at `t` from `src`'s NIC arrives at `dst`'s."""
        alpha = self.tm.latency_s + self.tm.message_s
        if nbytes == 0:
            return t + alpha  # a header alone: no queue, the wire's latency
        return take_both(t, self.tm.transfer_s(nbytes), src, dst) + alpha

    def _nbytes(self, k: int) -> int:
        lo, hi = self.ranges[k]
        return (hi - lo) * codec.itemsize(self.dtype)

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> float:
        """Every worker pulls clock 0 at time 0; run until the clock has no event; returns the end time."""
        for w in self.workers:
            w.new_round()
            for k in range(len(self.shards)):
                self.clock.at(self._send(0.0, 0, self.up[w.rank], self.nic_in[k]), self._pull_arrives, k, w.rank, 0)
        try:
            self.clock.run()
        except ShardError as e:  # what a real shard answers its worker with, and the run fails
            raise Refused(f"at {self.clock.now:.6f} s (virtual): {e.code.value}: {e}") from None
        waiting = [w.rank for w in self.workers if not w.finished]
        if waiting:
            held = {k: [(w, c) for w, c, _ in h] for k, h in enumerate(self.held_pulls) if h}
            raise Stalled(f"the simulation ran out of events with workers {waiting[:8]} unfinished; held pulls "
                          f"(worker, clock) by shard: {held}")
        return self.clock.now

    # -- the shard's side ---------------------------------------------------------------------
    def _pull_arrives(self, k: int, w: int, clock: int) -> None:
        if not self._serve(k, w, clock, self.clock.now):
            self.held_pulls[k].append((w, clock, self.clock.now))
        self._wake(k)

    def _serve(self, k: int, w: int, clock: int, since: float) -> bool:
        """Serve worker w's pull of `clock` now if the policy allows (a zero deadline); False if it holds it."""
        now, worker = self.clock.now, self.workers[w]
        try:
            with self.shards[k].pull(w, k, clock, self.dtype, timeout=0) as p:
                if not p.done:
                    if worker.pulled is None:
                        worker.pulled = torch.empty_like(self.replica.flat.params)
                        self._held(+1)
                    lo, hi = self.ranges[k]
                    worker.pulled[lo:hi].copy_(p.values)  # decoded to fp32, as the client writes it
                done, version, gap = p.done, p.version, p.clock_gap
        except ShardError as e:
            if e.code is Code.DEADLINE_EXCEEDED:
                return False
            raise
        arrive = self._send(now, 0 if done else self._nbytes(k), self.nic_out[k], self.down[w])
        self.clock.at(arrive, self._reply, w, k, done, version, gap, now - since, 0 if done else self._nbytes(k))
        return True

    def _wake(self, k: int) -> None:
        """Serve the held pulls of shard k that the policy now lets go (whenever its state moved)."""
        policy = self.shards[k].policy
        while self.held_pulls[k]:
            key = (policy.version, policy.roster.slowest(policy.clocks), policy.roster.started, policy.done)
            if key == self._seen[k]:
                return
            self._seen[k] = key
            held, self.held_pulls[k] = self.held_pulls[k], []
            for w, clock, since in held:
                if not self._serve(k, w, clock, since):
                    self.held_pulls[k].append((w, clock, since))

    def _push_arrives(self, k: int, w: int, clock: int, base: int) -> None:
        if self.shards[k].policy.turn(w, clock, timeout=0):
            self._take(k, w, clock, base)
        else:
            self.held_pushes[k].append((w, clock, base, self.clock.now))

    def _take(self, k: int, w: int, clock: int, base: int) -> None:
        """The shard's CPU takes one push: fold or apply, one at a time (`apply_s_per_byte`)."""
        lo, hi = self.ranges[k]
        end = self.cpu[k].take(self.clock.now, self.tm.apply_s_per_byte * 4 * (hi - lo))
        self.clock.at(end, self._apply, k, w, clock, base)

    def _apply(self, k: int, w: int, clock: int, base: int) -> None:
        shard, worker, now = self.shards[k], self.workers[w], self.clock.now
        lo, hi = self.ranges[k]
        if shard.policy.done:
            grad = torch.zeros(hi - lo)  # refused unread, whatever it holds: no need to compute it
        else:
            if worker.grad is None:
                worker.grad, worker.loss = self.replica.gradient(worker.pulled, worker.batches, clock)
                worker.pulled = None
            grad = worker.grad[lo:hi]
            if self.dtype != "fp32":  # what the wire carries: rounded to its dtype, received as fp32
                grad = grad.to(codec.WIRE_DTYPES[self.dtype]).to(torch.float32)
        before = shard.policy.version
        out = shard.push(w, clock, base, grad, self.dtype)
        for v in range(before + 1, shard.policy.version + 1):
            self.version_at[k][v] = now
        worker.taken += 1
        worker.refused |= out.refused
        worker.times.applied = max(worker.times.applied, now)
        if worker.taken == len(self.shards) and worker.grad is not None:
            worker.grad = None  # every shard has it: its memory goes
            self._held(-1)
        if out.done:
            self.clock.at(self._send(now, 0, self.nic_out[k], self.down[w]), self._reply, w, k, True, out.version,
                          0, 0.0, 0)
        else:
            self._pull_arrives(k, w, clock + 1)  # PushPull: the next clock's pull, asked at once
        self._retry_pushes(k)
        self._wake(k)

    def _retry_pushes(self, k: int) -> None:
        """Sync: the held pushes whose turn has come (every lower rank of the step has pushed)."""
        while self.held_pushes[k]:
            policy, held = self.shards[k].policy, self.held_pushes[k]
            # A step is folded in rank order: while every held push is of the current step and from a
            # live worker, a higher rank's turn cannot come before the lowest held rank's, so that one
            # is the only push to ask about (O(1) asks per push, not O(N)). Otherwise ask them all.
            plain = not policy.done and all(h[1] == policy.version for h in held) \
                and not policy.roster.gone() & {h[0] for h in held}
            asked = [min(held)] if plain else held
            ready = [h for h in asked if policy.turn(h[0], h[1], timeout=0)]
            if not ready:
                return
            self.held_pushes[k] = [h for h in self.held_pushes[k] if h not in ready]
            for w, clock, base, _ in ready:
                self._take(k, w, clock, base)

    def _held(self, change: int) -> None:
        self.in_flight += change
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    # -- the worker's side --------------------------------------------------------------------
    def _reply(self, w: int, k: int, done: bool, version: int, gap: int, wait: float, nbytes: int) -> None:
        worker = self.workers[w]
        worker.replies += 1
        worker.done_flags.append(done)
        if not done:
            worker.versions[k] = version
            worker.totals["bytes_pulled"] += nbytes
        worker.next_gap, worker.next_wait = max(worker.next_gap, gap), max(worker.next_wait, wait)
        if worker.replies == len(self.shards):
            self._step_done(worker)

    def _step_done(self, worker: VWorker) -> None:
        now = self.clock.now
        if worker.pushed:
            if worker.loss is not None:  # a gradient no shard took was never computed: no line (see workers.py)
                self.write(step_line(worker, now, self.base))
            t = worker.totals
            t["steps"] += 0 if worker.refused else 1
            t["compute_s"] += worker.times.compute
            t["wait_s"] += worker.next_wait
            t["push_s"] += max(0.0, worker.times.applied - worker.times.sent)
            t["pull_s"] += max(0.0, now - worker.times.applied - worker.next_wait)
            if not worker.refused:
                t["bytes_pushed"] += sum(self._nbytes(k) for k in range(len(self.shards)))
            worker.clock += 1
        elif worker.train_start is None:
            worker.train_start = now - worker.next_wait  # the barrier's hold is start-up, as in a real run
        flags = worker.done_flags
        if (all(flags) if self.all_done else any(flags)):
            self._finish(worker)
            return
        tm = self.tm
        compute = worker.compute_s(tm.compute_s, tm.speeds[worker.rank], tm.delays_s[worker.rank], tm.jitter_s,
                                   tm.jitter_tail, tm.spread)
        worker.times = type(worker.times)(sent=now + compute, gap=worker.next_gap, compute=compute)
        worker.loss, worker.taken, worker.pushed = None, 0, True
        self.clock.at(now + compute, self._push, worker.rank)

    def _push(self, w: int) -> None:
        worker, now = self.workers[w], self.clock.now
        worker.new_round()
        for k in range(len(self.shards)):
            arrive = self._send(now, self._nbytes(k), self.up[w], self.nic_in[k])
            self.clock.at(arrive, self._push_arrives, k, w, worker.clock, worker.versions[k])

    def _finish(self, worker: VWorker) -> None:
        """The worker leaves every shard (as a real one's close does) and writes its worker_end line."""
        self._held(-(worker.pulled is not None) - (worker.grad is not None))
        worker.finished, worker.pulled, worker.grad = True, None, None
        for k, shard in enumerate(self.shards):
            shard.leave(worker.rank, k)
            self._retry_pushes(k)
            self._wake(k)
        self.write(end_line(worker, self.clock.now, self.base))
