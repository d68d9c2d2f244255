"""AdamW on one flat tensor: torch.optim.AdamW's update (Loshchilov & Hutter 2019), with psgd's warmup.

Contract: the same interface as `psgd.core.optim.SGD` (`step()` with the gradient in
`param.grad`, `lr`, `updates`, `state_dict` / `check_state` / `load_state_dict`), so a shard, an
all-reduce replica or a local worker takes either through `optim.build(param, cfg)`.

The update is `torch.optim.adam.adam(..., decoupled_weight_decay=True)`, the function
`torch.optim.AdamW.step` calls, on the one tensor: bit for bit the class's update
(tests/test_optim.py), without constructing a `torch.optim.Optimizer` (that imports
torch._dynamo at every process's start-up, see psgd/core/optim.py). Decoupled weight decay:
p <- p - lr x weight_decay x p, then the Adam step with bias-corrected moments; the warmup
multiplies lr as it does for SGD (Goyal et al. 2017's linear ramp).

State: the two moment buffers (exp_avg, exp_avg_sq; 8 bytes per element on top of the
parameters: a shard of n elements holds 12n bytes) and the step count, a float tensor as torch
keeps it (the bias correction reads it).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from psgd.core.config import OptimConfig
from psgd.core.schedule import FUSED_DEVICES, warmup_factor


class AdamW:
    """AdamW over one tensor (its .grad), with the warmup schedule; for one thread."""

    STATE_KEYS = frozenset({"exp_avg", "exp_avg_sq", "step", "updates"})

    def __init__(self, param: torch.Tensor, cfg: OptimConfig, fused: bool = False) -> None:
        self.param, self.cfg = param, cfg
        self.fused = fused and param.device.type in FUSED_DEVICES and param.dtype.is_floating_point
        self._factor = warmup_factor(cfg.warmup)
        self.updates = 0
        self.exp_avg = torch.zeros_like(param, memory_format=torch.preserve_format)
        self.exp_avg_sq = torch.zeros_like(param, memory_format=torch.preserve_format)
        self.step_t = torch.tensor(0.0, dtype=torch.float32)  # torch.optim.AdamW's `step` state, on the CPU

    @property
    def lr(self) -> float:
        return self.cfg.lr * self._factor(self.updates)

    def step(self) -> None:
        kw = dict(amsgrad=False, beta1=self.cfg.beta1, beta2=self.cfg.beta2, lr=self.lr,
                  weight_decay=self.cfg.weight_decay, eps=self.cfg.eps, maximize=False,
                  decoupled_weight_decay=True)
        args = ([self.param], [self.param.grad], [self.exp_avg], [self.exp_avg_sq], [], [self.step_t])
        with torch.no_grad():
            if self.fused:
                try:
                    # The fused kernel wants its step count on the parameter's device; a copy, since
                    # torch counts the step before it calls the kernel, which may then be missing.
                    step = self.step_t.to(self.param.device, copy=True)
                    adam(*args[:5], [step], fused=True, **kw)
                    self.step_t = step.cpu()
                except (RuntimeError, TypeError):
                    self.fused = False  # no fused kernel here: the plain update below, with the count untouched
            if not self.fused:
                adam(*args, foreach=False, **kw)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"exp_avg": self.exp_avg.detach().clone(), "exp_avg_sq": self.exp_avg_sq.detach().clone(),
                "step": float(self.step_t), "updates": self.updates}

    @classmethod
    def check_state(cls, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != cls.STATE_KEYS:
            raise ValueError("the checkpoint's optimizer state is not an AdamW state of this psgd (another "
                             "--optimizer, or an older psgd): it cannot be restored")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.exp_avg = state["exp_avg"].to(self.param.device).clone()
        self.exp_avg_sq = state["exp_avg_sq"].to(self.param.device).clone()
        self.step_t = torch.tensor(float(state["step"]), dtype=torch.float32)
        self.updates = int(state["updates"])
