"""The textbook parameter server: sync, async and SSP in one short file, to read first.

Contract. A `TextbookShard` holds the whole model as one flat fp32 tensor, its `version` (updates
applied so far), each worker's `clock` (gradients received from it) and one `threading.Condition`
that guards all of it. A worker loops: `pull(worker, clock)` -> (version, a copy of the
parameters), compute a gradient on its next batch, `push(worker, clock, base_version, grad)`, where
base_version is the version it pulled. The mode decides when a pull is served and when a gradient
is applied:

- sync (BSP): a step's gradients are buffered until all N arrived; their mean is applied once
  (summed in worker order, so every run gives the same bits). A pull for clock c waits until
  version == c: everyone computes step c on the same parameters.
- async (Dean et al. 2012, Downpour SGD): each gradient is applied on arrival and no pull ever
  waits; a gradient may be computed on old parameters.
- ssp(s) (Ho et al., NIPS 2013): applied on arrival, but a pull for clock c waits while
  c - slowest > s (the slowest worker's clock).

The kernel is shared, not copied: the rules are psgd/core/rules.py (`may_read`, `on_arrival`,
`slowest`), a sync step's sum is psgd/core/stepsum.py's `StepSum` (in worker order, whatever the
arrival order), every update psgd/core/optim.py's `SGD` (torch.optim.SGD's arithmetic): the very
objects the production shard runs (psgd/core/consistency.py, psgd/ps/shard.py), which adds the
start barrier, budget, backup, lost and joining workers, remedies, snapshots and checkpoints
around them. So this file is the production kernel with nothing around it; tests/test_textbook.py
checks the two against each other (sync and one-worker async: the same parameters bit for bit;
SSP: the same bounds hold).

The shard counts each gradient's staleness (its version then - base_version) and each pull's
clock gap (clock - slowest). `train` runs N workers on it.

    python -m psgd.core.textbook      # 3 workers fit a line in each mode; prints what each saw
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from psgd.core import rules
from psgd.core.optim import SGD
from psgd.core.sections import OptimConfig
from psgd.core.stepsum import StepSum

MODES = rules.RULES  # the registry itself: a registered mode is a mode here too


class TextbookShard:
    def __init__(self, params: torch.Tensor, num_workers: int, mode: str = "sync", staleness: int = 0,
                 lr: float = 0.1, momentum: float = 0.0, timeout: float | None = 60.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
        self.rule = rules.make(mode, staleness=staleness)  # when a pull may be served, what a gradient does
        self.params = params.detach().to(torch.float32).flatten().clone()  # the shard's own copy
        self.num_workers, self.mode, self.timeout = num_workers, mode, timeout
        self.opt = SGD(self.params, OptimConfig(lr=lr, momentum=momentum))  # steps self.params with its .grad
        self.version = 0                       # updates applied so far
        self.clocks = [0] * num_workers        # gradients received from each worker
        self.cond = threading.Condition()      # guards every field; a held pull waits on it
        self.step = StepSum()                  # sync: this step's gradients, summed in worker order
        self.staleness: Counter = Counter()    # staleness -> gradients taken
        self.gaps: Counter = Counter()         # clock gap -> pulls served

    def _may_read(self, clock: int) -> bool:
        return self.rule.may_read(self.version, clock, rules.slowest(self.clocks))

    def pull(self, worker: int, clock: int) -> tuple[int, torch.Tensor]:
        """Wait until the mode lets `worker` read for `clock`; return (version, parameters)."""
        with self.cond:
            if clock != self.clocks[worker]:
                raise ValueError(f"worker {worker} pulled for clock {clock}, its next push is {self.clocks[worker]}")
            if not self.cond.wait_for(lambda: self._may_read(clock), self.timeout):
                raise TimeoutError(f"{self.mode}: worker {worker} held at clock {clock}, clocks {self.clocks}")
            self.gaps[clock - rules.slowest(self.clocks)] += 1
            return self.version, self.params.clone()  # a copy: later updates must not change it

    def push(self, worker: int, clock: int, base_version: int, grad: torch.Tensor) -> None:
        """Take `worker`'s gradient of `clock`, computed on `base_version`: buffer or apply it."""
        with self.cond:
            if clock != self.clocks[worker] or base_version > self.version:
                raise ValueError(f"worker {worker}: push of clock {clock} on version {base_version} refused "
                                 f"(its clock is {self.clocks[worker]}, the version {self.version})")
            self.staleness[self.version - base_version] += 1
            self.clocks[worker] += 1
            if self.rule.on_arrival:
                self._update(grad)  # async and SSP: on arrival (SSP bounds staleness at pull time)
            else:
                # Sync: hold the step's gradients; once all N are in, apply their mean: what one
                # process computing N x b samples would, up to float rounding.
                last = self.step.arrived + 1 == self.num_workers
                self.step.add(worker, grad, completes=last)
                if last:
                    self.step.apply(lambda total, count: self._update(total.div_(count)), keep=self.num_workers)
            self.cond.notify_all()  # a pull waiting for this version or this clock may go now

    def _update(self, grad: torch.Tensor) -> None:
        """One SGD update, cond held: buf = grad at first, then momentum * buf + grad; params -= lr * buf."""
        self.params.grad = grad
        self.opt.step()
        self.params.grad = None  # the step's sum is StepSum's buffer, reused by the next step
        self.version += 1


def train(shard, model: torch.nn.Module, loss_fn: Callable, batches: Sequence[Sequence[tuple]],
          lockstep: bool = False, straggle: Callable[[int, int], None] | None = None):
    """Workers w = 0..len(batches)-1 each take batches[w][c] at clock c: pull, gradient, push.

    Each on its own copy of `model`; `shard`: anything with TextbookShard's pull/push. One thread
    per worker, or with `lockstep` one thread taking the workers in turn at each clock (the same
    order every run). `straggle(worker, clock)` runs before each push: to make a straggler."""
    replicas = [copy.deepcopy(model) for _ in batches]

    def step(w: int, clock: int) -> None:
        version, params = shard.pull(w, clock)
        m = replicas[w]
        torch.nn.utils.vector_to_parameters(params, m.parameters())  # the model now computes on them
        m.zero_grad(set_to_none=True)
        x, y = batches[w][clock]
        loss_fn(m(x), y).backward()
        grad = torch.nn.utils.parameters_to_vector([p.grad for p in m.parameters()])
        if straggle is not None:
            straggle(w, clock)
        shard.push(w, clock, version, grad)

    if lockstep:
        for clock in range(max(len(b) for b in batches)):
            for w, b in enumerate(batches):
                if clock < len(b):
                    step(w, clock)
        return shard
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for clock in range(len(batches[w])):
                step(w, clock)
        except BaseException as e:  # re-raised by the caller's thread, below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,), name=f"textbook-worker-{w}", daemon=True)
               for w in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return shard


def main() -> None:
    import time

    torch.manual_seed(0)
    n, steps, batch = 3, 30, 16
    data = [[(x, 2 * x + 1) for x in torch.randn(steps, batch, 1)] for _ in range(n)]  # the line y = 2x + 1
    model = torch.nn.Linear(1, 1)
    start = torch.nn.utils.parameters_to_vector(model.parameters())

    def straggle(w: int, clock: int) -> None:
        time.sleep(0.002 if w == 0 else 0)  # worker 0 is slower (a demo: the tests never sleep)

    print(f"{n} workers x {steps} steps fit y = 2x + 1, worker 0 a straggler; start {start.tolist()}")
    for mode, s in (("sync", 0), ("async", 0), ("ssp", 1)):
        shard = TextbookShard(start, n, mode, staleness=s, lr=0.1, momentum=0.5)
        train(shard, model, torch.nn.functional.mse_loss, data, straggle=straggle)
        name = f"ssp({s})" if mode == "ssp" else mode
        w, b = shard.params.tolist()
        print(f"{name:>7}: w {w:.4f} b {b:.4f}, {shard.version} updates, staleness "
              f"{dict(sorted(shard.staleness.items()))}, max clock gap {max(shard.gaps)}")


if __name__ == "__main__":
    main()
