"""The one SGD that every update in psgd takes: torch's SGD update with a linear warmup.

A shard server (psgd/ps/shard.py) steps it on its slice of the parameters, an all-reduce
replica (psgd/allreduce/collective.py) and a local-SGD worker (psgd/ps/exchange.py) on their
whole flat parameter buffer: the same arithmetic everywhere, so a sync PS run, an all-reduce
run and a single-process torch loop agree step for step.

The update is `torch.optim.sgd.sgd`, the function `torch.optim.SGD.step` calls (momentum, weight
decay), called directly on the one tensor: the same arithmetic as the class. Not the class
itself, because constructing any `torch.optim.Optimizer` imports torch._dynamo (its
`add_param_group` is wrapped to disable the compiler), which costs about 0.9 s of CPU in every
shard and replica process at start-up (measured with `python -X importtime`), on 2 cores shared
by all of a run's processes.

Warmup (Goyal et al. 2017, sec. 2.2): update number n + 1 (n = 0, 1, ...) uses
lr x min(1, (n + 1) / warmup), i.e. from lr / warmup up to lr over `warmup` updates, then lr
(the rate `torch.optim.lr_scheduler.LambdaLR` would set with `warmup_factor`).

    opt = SGD(flat.params, OptimConfig(lr=0.1, momentum=0.9, warmup=100))
    flat.params.grad = flat.grads; ...backward...; opt.step()
"""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd

from psgd.core.config import OptimConfig

FUSED_DEVICES = ("cpu", "cuda")  # where this torch has a fused SGD kernel for float tensors


def warmup_factor(warmup: int):
    """The multiplier of the base lr for update number n + 1 (see the module docstring)."""
    return lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0


class SGD:
    """SGD over one tensor (its .grad), with the warmup schedule; for one thread.

    `fused=True` takes torch's fused kernel where it has one (one pass over the memory: 14 vs
    22 ms for 16M elements on this machine), the same update up to float rounding.
    """

    def __init__(self, param: torch.Tensor, cfg: OptimConfig, fused: bool = False) -> None:
        self.param, self.cfg = param, cfg
        self.fused = fused and param.device.type in FUSED_DEVICES and param.dtype.is_floating_point
        self._factor = warmup_factor(cfg.warmup)
        self.updates = 0                                  # steps taken: the warmup's n
        self.momentum_buffer: torch.Tensor | None = None  # created by the first step (momentum > 0)

    @property
    def lr(self) -> float:
        """The rate the next step will use."""
        return self.cfg.lr * self._factor(self.updates)  # the factor is 1.0 from update `warmup` on

    def step(self) -> None:
        """One update with the gradient in the parameter's .grad; then the schedule advances."""
        buffers = [self.momentum_buffer]
        kw = dict(weight_decay=self.cfg.weight_decay, momentum=self.cfg.momentum, lr=self.lr,
                  dampening=0.0, nesterov=False, maximize=False)
        with torch.no_grad():
            if self.fused:
                try:
                    sgd([self.param], [self.param.grad], buffers, fused=True, **kw)
                except (RuntimeError, TypeError):
                    # No fused kernel in this torch (older ones) for this tensor: its arguments are
                    # checked before any arithmetic, so take the plain update, now and from now on.
                    self.fused = False
            if not self.fused:
                sgd([self.param], [self.param.grad], buffers, **kw)
        self.momentum_buffer = buffers[0] if self.cfg.momentum != 0 else None
        self.updates += 1

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the momentum buffer (a copy) and the updates taken."""
        buf = None if self.momentum_buffer is None else self.momentum_buffer.detach().clone()
        return {"momentum_buffer": buf, "updates": self.updates}

    @staticmethod
    def check_state(state: dict) -> None:
        """ValueError unless `state` is one this class wrote (`state_dict`)."""
        if not isinstance(state, dict) or set(state) != {"momentum_buffer", "updates"}:
            raise ValueError("the checkpoint's optimizer state is not psgd's current format (written by an "
                             "older psgd, whose shards stepped torch.optim.SGD): it cannot be restored")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        buf = state["momentum_buffer"]
        self.momentum_buffer = None if buf is None else buf.to(self.param.device).clone()
        self.updates = int(state["updates"])
