"""The optimizers every update in psgd takes: torch's SGD update (here) or AdamW's (adamw.py), with a linear warmup.

`build(param, cfg, fused)` makes the one `--optimizer` names, looked up in `OPTIMIZERS`
(psgd/core/sections.py: name -> the class, or "module:Class" imported only by a run that takes it,
so that AdamW's module is imported by AdamW runs alone); `check_state(cfg, state)` asks the same
class. A ValueError names the choices for an unknown name.

The interface, all a shard, a replica, a local worker or the textbook calls: `Class(param, cfg, fused)`
over one tensor; `step()` with the gradient in `param.grad`; `lr` (the next step's rate) and `updates` (steps
taken); `state_dict()`, a static `check_state(state)` (ValueError unless this class wrote it) and
`load_state_dict(state)` for checkpoints; and a `param` attribute the shard may reassign (it moves
its parameters to a fresh buffer while a pull still holds the old one: psgd/ps/snapshots.py), so
`step` reads `self.param` each time.

A new optimizer is its class and one line in `OPTIMIZERS`, the one list of them: the --optimizer
choices, `config.validate` and every run built from a `RunConfig` (psgd.fit, psgd/train/assemble.py)
read it; its settings, if new, go in OptimConfig. tests/test_optim.py plugs in a sign-SGD from the
test file alone and counts what it touched.

A shard server (psgd/ps/shard.py) steps it on its slice of the parameters, an all-reduce
replica (psgd/allreduce/collective.py), a local-SGD worker (psgd/ps/exchange.py) and the
textbook (psgd/core/textbook.py) on their whole flat parameter buffer: the same arithmetic
everywhere, so a sync PS run, an all-reduce run and a single-process torch loop agree step for step.

The update is `torch.optim.sgd.sgd`, the function `torch.optim.SGD.step` calls (momentum, weight
decay), called directly on the one tensor: the same arithmetic as the class (with `fused=True`,
the fused kernel that function calls, called as it calls it). Not the class
itself, because constructing any `torch.optim.Optimizer` imports torch._dynamo (its
`add_param_group` is wrapped to disable the compiler), a cost every shard and replica process
would pay at start-up, on the cores all of a run's processes share (docs/measure.md has the figure).

Warmup: psgd/core/schedule.py (Goyal et al. 2017's linear ramp), shared with AdamW.

    opt = SGD(flat.params, OptimConfig(lr=0.1, momentum=0.9, warmup=100))
    flat.params.grad = flat.grads; ...backward...; opt.step()
"""

from __future__ import annotations

import importlib

import torch
from torch.optim.sgd import sgd

from psgd.core.config import OptimConfig
from psgd.core.schedule import FUSED_DEVICES, warmup_factor
from psgd.core.sections import OPTIMIZERS

__all__ = ["FUSED_DEVICES", "OPTIMIZERS", "SGD", "build", "check_state", "optimizer_class", "warmup_factor"]


def optimizer_class(name: str) -> type:
    """The class registered as `name` (imported now if registered by its path); ValueError, with the
    choices, for a name not registered."""
    try:
        entry = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose {' or '.join(OPTIMIZERS)}") from None
    if isinstance(entry, str):  # "module:Class": imported by the run that takes it and by no other
        module, _, attr = entry.partition(":")
        return getattr(importlib.import_module(module), attr)
    return entry


def build(param: torch.Tensor, cfg: OptimConfig, fused: bool = False):
    """The optimizer `cfg.optimizer` names over `param` (its .grad): SGD, AdamW or a registered one."""
    return optimizer_class(cfg.optimizer)(param, cfg, fused)


def check_state(cfg: OptimConfig, state: dict) -> None:
    """ValueError unless `state` is what `build(..., cfg).state_dict()` writes."""
    optimizer_class(cfg.optimizer).check_state(state)


class SGD:
    """SGD over one tensor (its .grad), with the warmup schedule; for one thread.

    `fused=True` takes torch's fused kernel where it has one (one pass over the memory instead of
    several: docs/architecture.md has the time), the same update up to float rounding.
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
        with torch.no_grad():
            if self.fused:
                try:
                    self._fused_step(self.param.grad)
                except (RuntimeError, TypeError, AttributeError):
                    # No fused kernel in this torch (older ones) for this tensor: its arguments are
                    # checked before any arithmetic, so take the plain update, now and from now on.
                    self.fused = False
            if not self.fused:
                c = self.cfg
                buffers = [self.momentum_buffer]
                sgd([self.param], [self.param.grad], buffers, weight_decay=c.weight_decay, momentum=c.momentum,
                    lr=self.lr, dampening=0.0, nesterov=c.nesterov, maximize=False)
                self.momentum_buffer = buffers[0] if c.momentum != 0 else None
        self.updates += 1

    def _fused_step(self, grad: torch.Tensor) -> None:
        """torch's fused kernel on the one tensor, called as `sgd(..., fused=True)` calls it: the
        same update, bit for bit, without that function's grouping by device and dtype, which has
        nothing to group here and cost a small shard more than the kernel itself (docs/architecture.md).
        The first step with momentum makes the buffer (is_first_step)."""
        c = self.cfg
        first = c.momentum != 0 and self.momentum_buffer is None
        buffers = [] if c.momentum == 0 else [torch.empty_like(grad) if first else self.momentum_buffer]
        torch._fused_sgd_([self.param], [grad], buffers, weight_decay=c.weight_decay, momentum=c.momentum,
                          lr=self.lr, dampening=0.0, nesterov=c.nesterov, maximize=False, is_first_step=first)
        if first:
            self.momentum_buffer = buffers[0]

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
