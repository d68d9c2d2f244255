"""The optimizers every update in psgd takes: torch's SGD update (here) or AdamW's (adamw.py), with a linear warmup.

`build(param, cfg)` picks the one `--optimizer` names; each has the same small interface (`step`,
`lr`, `updates`, `state_dict` / `check_state` / `load_state_dict`). A new optimizer is one file
beside adamw.py plus its name in `build` (and its settings in core/config.py's OptimConfig).

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

Warmup: psgd/core/schedule.py (Goyal et al. 2017's linear ramp), shared with AdamW.

    opt = SGD(flat.params, OptimConfig(lr=0.1, momentum=0.9, warmup=100))
    flat.params.grad = flat.grads; ...backward...; opt.step()
"""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd

from psgd.core.config import OptimConfig
from psgd.core.schedule import FUSED_DEVICES, warmup_factor

__all__ = ["FUSED_DEVICES", "SGD", "build", "check_state", "warmup_factor"]


def build(param: torch.Tensor, cfg: OptimConfig, fused: bool = False):
    """The optimizer `cfg.optimizer` names over `param` (its .grad): SGD or AdamW."""
    if cfg.optimizer == "adamw":
        from psgd.core.adamw import AdamW  # noqa: PLC0415 - only an AdamW run needs it

        return AdamW(param, cfg, fused)
    assert cfg.optimizer == "sgd", f"unknown optimizer {cfg.optimizer!r} (config.validate lists them)"
    return SGD(param, cfg, fused)


def check_state(cfg: OptimConfig, state: dict) -> None:
    """ValueError unless `state` is what `build(..., cfg).state_dict()` writes."""
    if cfg.optimizer == "adamw":
        from psgd.core.adamw import AdamW  # noqa: PLC0415

        AdamW.check_state(state)
    else:
        SGD.check_state(state)


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
                  dampening=0.0, nesterov=self.cfg.nesterov, maximize=False)
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
