"""The one SGD that every update in psgd takes: `torch.optim.SGD` with a linear warmup.

A shard server (psgd/ps/shard.py) steps it on its slice of the parameters, an all-reduce
replica (psgd/allreduce/collective.py) and a local-SGD worker (psgd/ps/exchange.py) on their
whole flat parameter buffer: the same arithmetic everywhere, so a sync PS run, an all-reduce
run and a single-process torch loop agree step for step.

Warmup (Goyal et al. 2017, sec. 2.2): update number n + 1 (n = 0, 1, ...) uses
lr x min(1, (n + 1) / warmup), i.e. from lr / warmup up to lr over `warmup` updates, then lr;
`torch.optim.lr_scheduler.LambdaLR` applies it and counts the updates (`step()` advances both).

    opt = SGD(flat.params, OptimConfig(lr=0.1, momentum=0.9, warmup=100))
    flat.params.grad = flat.grads; ...backward...; opt.step()
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

from psgd.core.config import OptimConfig


def warmup_factor(warmup: int):
    """LambdaLR's multiplier of the base lr for update number n + 1 (see the module docstring)."""
    return lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0


class SGD:
    """torch.optim.SGD over one tensor, with the warmup schedule; for one thread.

    `fused=True` takes torch's fused CPU kernel where this torch has one (one pass over the
    memory: 14 vs 22 ms for 16M elements on this machine), the same update up to float rounding.
    """

    def __init__(self, param: torch.Tensor, cfg: OptimConfig, fused: bool = False) -> None:
        kw = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        opt = None
        if fused:
            try:
                opt = torch.optim.SGD([param], fused=True, **kw)
            except (RuntimeError, TypeError, ValueError):
                opt = None  # no fused kernel for this tensor / torch: the plain one is the same update
        self.opt = opt or torch.optim.SGD([param], **kw)
        # The schedule only while it changes the rate: a LambdaLR step costs ~30 us, more than a
        # small shard's whole update (measured with cProfile on the TCP data plane's push path).
        self.warmup = cfg.warmup
        self.schedule = LambdaLR(self.opt, warmup_factor(cfg.warmup)) if cfg.warmup else None

    @property
    def lr(self) -> float:
        """The rate the next step will use."""
        return self.opt.param_groups[0]["lr"]

    def step(self) -> None:
        """One update with the gradient in the parameter's .grad; then the schedule advances."""
        self.opt.step()
        if self.schedule is not None and self.schedule.last_epoch < self.warmup:
            self.schedule.step()  # from here on the factor is 1: the rate is the base lr
