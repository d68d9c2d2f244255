"""The outer step of async local SGD and async DiLoCo on a shard (`--mode async --local-steps H`).

In sync DiLoCo (psgd/core/localsgd.py) a round's N parameter changes are averaged and one outer
step is taken on the mean: m <- mu m + mean(delta); w <- w - lr (mean(delta) + mu m) (Nesterov).
Asynchronously each worker's change arrives on its own, computed from whatever version it pulled.
Applying a whole Nesterov step per arrival compounds momentum N times per round, which Liu et al.
2024 ("Asynchronous Local-SGD Training for Language Modeling", Section 4, "Delayed Nesterov
momentum") find unstable; their remedy is to update the momentum only once every N arrivals and to
take plain steps in between. psgd's form of it, over each arriving change delta_i with g = delta_i / N
(its share of a round's mean) and a buffer b of the g since the last momentum update:

    b <- b + g
    every N-th arrival:  m <- mu m + b;  w <- w - lr (g + mu m)  (Nesterov; heavy ball: lr (m - b + g))
    otherwise:           w <- w - lr g

so that N arrivals in one round move w exactly as sync DiLoCo's one outer step on their mean would
(tests/test_diloco.py checks it against torch's SGD), and with mu = 0 every arrival is the plain
step w <- w - lr delta_i / N: async local SGD at outer lr 1 is each replica's change applied as its
1/N share on arrival. The schedule (warmup) and weight decay of the outer step are not used (as in
`localsgd.outer_config`). For one thread: the shard calls `step()` under its lock, with the change
in `param.grad`; `param` may be replaced between steps (the shard's copy on write).
"""

from __future__ import annotations

import torch

from psgd.core.config import OptimConfig


class DelayedNesterov:
    def __init__(self, param: torch.Tensor, cfg: OptimConfig, workers: int) -> None:
        assert cfg.optimizer == "sgd", "the outer step is SGD (localsgd.outer_config)"
        self.param, self.cfg, self.workers = param, cfg, workers
        self.momentum_buffer = torch.zeros_like(param)
        self.pending = torch.zeros_like(param)  # b: the shares since the last momentum update
        self.arrivals = 0
        self.updates = 0

    @property
    def lr(self) -> float:
        return self.cfg.lr

    def step(self) -> None:
        with torch.no_grad():
            g = self.param.grad / self.workers
            self.pending.add_(g)
            self.arrivals += 1
            mu, lr = self.cfg.momentum, self.cfg.lr
            if mu == 0 or self.arrivals % self.workers:
                self.param.sub_(g, alpha=lr)
                if mu == 0:
                    self.pending.zero_()
            else:
                self.momentum_buffer.mul_(mu).add_(self.pending)
                if self.cfg.nesterov:
                    self.param.sub_(g + mu * self.momentum_buffer, alpha=lr)
                else:  # the round moved w by lr (b - g) already; heavy ball's step is lr m
                    self.param.sub_(self.momentum_buffer - self.pending + g, alpha=lr)
                self.pending.zero_()
        self.updates += 1

    def state_dict(self) -> dict:
        return {"momentum_buffer": self.momentum_buffer.clone(), "pending": self.pending.clone(),
                "arrivals": self.arrivals, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"momentum_buffer", "pending", "arrivals", "updates"}:
            raise ValueError("the checkpoint's optimizer state is not async local SGD's outer step (DelayedNesterov)")
        self.momentum_buffer = state["momentum_buffer"].clone()
        self.pending = state["pending"].clone()
        self.arrivals, self.updates = int(state["arrivals"]), int(state["updates"])
