"""The simulated cluster's workers: N virtual workers over one real model replica.

A real worker (psgd/train/worker.py) loops pull -> forward / backward -> push. Its gradient
depends only on the parameters it pulled and its batch, so here the N workers share one model
(`Replica`): a worker's gradient is computed from its own pulled copy when its value is first
needed (its first shard applies it), with the same arithmetic as the real loop (`FlatParams`, the
loss over --accumulate micro-batches each divided by their count, the real `Batches` slice of
the global batch), and kept until every shard has taken it. A gradient that no shard takes (the
budget was spent before it arrived: every shard refuses it) is never computed, and that step,
not counted in a real run either, has no step line. Memory: one parameter vector per worker in
flight (its pulled copy, then its gradient).

`VWorker` is one worker's state between events, and its totals and step lines (psgd/train/worker.py's
fields, in virtual seconds).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from psgd.sim.timemodel import spread_factor
from psgd.train import losses, models
from psgd.train.worker import Batches, jitter_draw


class Replica:
    """The one model all virtual workers compute on (its flat buffers, psgd/train/models.py)."""

    def __init__(self, model: torch.nn.Module, loss: losses.Loss, accumulate: int) -> None:
        self.model, self.loss, self.accumulate = model, loss, accumulate
        self.flat = models.FlatParams(model)
        self.computed = 0  # gradients computed (the simulation's cost)

    def gradient(self, params: torch.Tensor, batches: Batches, clock: int) -> tuple[torch.Tensor, float]:
        """The gradient of step `clock` of `batches`' worker at `params`, and its loss: psgd/train/worker.py
        `_compute`'s arithmetic (the mean loss per micro-batch / k, accumulated)."""
        flat = self.flat
        flat.params.copy_(params)
        flat.zero_grad()
        loss_sum = 0.0
        for xb, yb in batches.micro(clock, self.accumulate):
            loss = self.loss(self.model(xb), yb) / self.accumulate
            loss.backward()
            loss_sum += float(loss.detach())
        flat.zeroed = False
        self.computed += 1
        return flat.grads.clone(), loss_sum


@dataclass
class StepTimes:
    """One step's moments and waits (virtual seconds), for its step line."""
    sent: float = 0.0        # compute ended, the pushes left
    applied: float = 0.0     # the last shard applied (or refused) the push
    wait: float = 0.0        # the longest a shard held this step's pull
    gap: int = 0             # the pull's clock gap (the largest over shards)
    compute: float = 0.0


@dataclass
class VWorker:
    """One virtual worker between events."""
    rank: int
    batches: Batches
    shards: int
    jitter: random.Random
    spread: random.Random | None = None  # its spread stream (psgd/sim/timemodel.py), None: no spread
    clock: int = 0
    versions: list[int] = field(default_factory=list)  # per shard: the version its last pull returned
    replies: int = 0                                  # replies of this step arrived so far
    done_flags: list[bool] = field(default_factory=list)
    refused: bool = False
    pushed: bool = False        # this step pushed (clock 0's first pull did not)
    pulled: torch.Tensor | None = None  # the parameters it computes on (shard slices as they come)
    grad: torch.Tensor | None = None
    loss: float | None = None
    taken: int = 0              # shards that have applied (or refused) the current gradient
    times: StepTimes = field(default_factory=StepTimes)
    next_gap: int = 0
    next_wait: float = 0.0
    train_start: float | None = None
    finished: bool = False
    totals: dict = field(default_factory=lambda: dict(steps=0, compute_s=0.0, pull_s=0.0, push_s=0.0, wait_s=0.0,
                                                      bytes_pulled=0, bytes_pushed=0))

    def __post_init__(self) -> None:
        self.versions = [0] * self.shards

    def new_round(self) -> None:
        """Before the replies of a push (or the first pull) come in."""
        self.replies, self.done_flags, self.refused = 0, [], False
        self.next_gap, self.next_wait = 0, 0.0

    def compute_s(self, base_s: float, speed: float, delay_s: float, jitter_s: float, tail: str,
                  cv: float = 0.0) -> float:
        """This step's compute time: the device's time at its speed times its spread, plus its straggler laws."""
        extra_ms = jitter_draw(self.jitter, jitter_s * 1e3, tail)
        factor = spread_factor(self.spread, cv) if self.spread is not None else 1.0
        return base_s / speed * factor + delay_s + extra_ms / 1e3


def step_line(w: VWorker, now: float, base: float) -> dict:
    """The step line of the push just answered (psgd/train/worker.py's fields, virtual seconds)."""
    t = w.times
    push_s = max(0.0, t.applied - t.sent)
    pull_s = max(0.0, now - t.sent - push_s - w.next_wait)
    return dict(event="step", rank=w.rank, clock=w.clock, loss=w.loss, compute_s=t.compute, pull_s=pull_s,
                wait_s=w.next_wait, push_s=push_s, clock_gap=t.gap, time=base + now)


def end_line(w: VWorker, now: float, base: float) -> dict:
    """The worker_end line (its totals; the device is this process's CPU, where it computed)."""
    from psgd.train.worker import device_info  # noqa: PLC0415

    start = base + (w.train_start if w.train_start is not None else now)
    return dict(event="worker_end", **w.totals, rank=w.rank, train_start=start, train_end=base + now,
                process_start=base, cpu_cgroup="", simulated=True, **device_info(torch.device("cpu")))
