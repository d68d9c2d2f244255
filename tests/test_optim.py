"""The optimizers as objects (psgd/core/optim.py `build`, psgd/core/adamw.py) against torch.optim."""

from __future__ import annotations

import pytest
import torch

from psgd.core import optim
from psgd.core.adamw import AdamW
from psgd.core.config import OptimConfig


def run(opt_cfg: OptimConfig, torch_cls, torch_kw: dict, fused: bool, steps: int = 15, warmup_sched: bool = False):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(203, generator=g)  # not a multiple of a vector width: the kernels' tails count too
    ours, theirs = start.clone(), start.clone().requires_grad_(True)
    mine = optim.build(ours, opt_cfg, fused=fused)
    ref = torch_cls([theirs], **torch_kw)
    sched = torch.optim.lr_scheduler.LambdaLR(ref, optim.warmup_factor(opt_cfg.warmup)) if warmup_sched else None
    for _ in range(steps):
        grad = torch.randn(203, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        ref.step()
        if sched is not None:
            sched.step()
    return ours, theirs.detach(), mine


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("warmup", [0, 4])
def test_adamw_is_torch_adamw_bit_for_bit_and_to_1e6_fused(weight_decay, warmup):
    cfg = OptimConfig(optimizer="adamw", lr=3e-3, beta1=0.85, beta2=0.98, eps=1e-7, weight_decay=weight_decay,
                      warmup=warmup)
    kw = dict(lr=3e-3, betas=(0.85, 0.98), eps=1e-7, weight_decay=weight_decay)
    ours, theirs, mine = run(cfg, torch.optim.AdamW, kw, fused=False, warmup_sched=True)
    assert torch.equal(ours, theirs)
    assert isinstance(mine, AdamW) and mine.updates == 15
    fused, theirs, _ = run(cfg, torch.optim.AdamW, kw, fused=True, warmup_sched=True)
    assert (fused - theirs).abs().max() < 1e-6
    assert (fused - torch.randn(203, generator=torch.Generator().manual_seed(0))).abs().max() > 1e-2


def test_build_picks_sgd_by_default_and_its_state_round_trips():
    p = torch.zeros(4)
    assert isinstance(optim.build(p, OptimConfig()), optim.SGD)
    cfg = OptimConfig(optimizer="adamw", lr=1e-2)
    a, b = torch.ones(50), torch.ones(50)
    first = optim.build(a, cfg)
    for _ in range(3):
        a.grad = torch.linspace(-1, 1, 50)
        first.step()
    state = first.state_dict()
    b.copy_(a)
    second = optim.build(b, cfg)
    optim.check_state(cfg, state)
    second.load_state_dict(state)
    for opt, t in ((first, a), (second, b)):
        t.grad = torch.linspace(1, -1, 50)
        opt.step()
    assert torch.equal(a, b), "a restored AdamW continues exactly where it was saved"
    with pytest.raises(ValueError, match="not an AdamW state"):
        optim.check_state(cfg, optim.build(torch.zeros(2), OptimConfig()).state_dict())
    with pytest.raises(ValueError, match="not psgd's current format"):
        optim.check_state(OptimConfig(), state)


def test_the_registry_names_what_the_flag_offers_and_refuses_an_unknown_name():
    from psgd.core.config import OPTIMIZERS, leaves  # the --optimizer choices (stdlib only)

    assert optim.OPTIMIZERS is OPTIMIZERS  # one registry: the flag's choices are the registry itself
    assert next(leaf for leaf in leaves(OptimConfig) if leaf.name == "optimizer").flag.choices is OPTIMIZERS
    assert [optim.optimizer_class(n).__name__ for n in OPTIMIZERS] == ["SGD", "AdamW"]
    with pytest.raises(ValueError, match="unknown optimizer 'nope'; choose sgd or adamw"):
        optim.build(torch.zeros(2), OptimConfig(optimizer="nope"))
    with pytest.raises(ValueError, match="unknown optimizer 'nope'"):
        optim.check_state(OptimConfig(optimizer="nope"), {})


def test_importing_optim_does_not_import_adamw():
    import subprocess
    import sys

    code = "import sys, psgd.core.optim; print('psgd.core.adamw' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_an_optimizer_plugs_in_as_one_class_and_its_registration(monkeypatch):
    """The plug-in test for an optimizer: touch count 2 (its class, in a file of its own, and its one
    line in `OPTIMIZERS`). A toy from this file alone, sign-SGD (p <- p - lr * sign(g)), registered
    at run time: the --optimizer flag and validate take it, and the production shard
    (psgd/train/assemble.py, its policy, its pull and push) builds it and steps it with the mean of
    each sync step's gradients."""
    import argparse

    from psgd.core import config
    from psgd.train import assemble
    from tests.helpers import open_start_barrier

    class SignSGD:
        def __init__(self, param: torch.Tensor, cfg: OptimConfig, fused: bool = False) -> None:
            self.param, self.cfg, self.updates = param, cfg, 0
            self.seen: list[torch.Tensor] = []

        @property
        def lr(self) -> float:
            return self.cfg.lr

        def step(self) -> None:
            self.seen.append(self.param.grad.clone())
            with torch.no_grad():  # self.param each time: the shard may have moved its parameters
                self.param.sub_(self.lr * torch.sign(self.param.grad))
            self.updates += 1

        def state_dict(self) -> dict:
            return {"sign_updates": self.updates}

        @staticmethod
        def check_state(state: dict) -> None:
            if set(state) != {"sign_updates"}:
                raise ValueError("not a sign-SGD state")

        def load_state_dict(self, state: dict) -> None:
            self.check_state(state)
            self.updates = state["sign_updates"]

    monkeypatch.setitem(optim.OPTIMIZERS, "toy", SignSGD)  # the registration: nothing else is edited
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    args = parser.parse_args(["--mode", "sync", "--workers", "2", "--steps", "3", "--device", "cpu", "--optimizer",
                              "toy", "--lr", "0.125"])
    cfg = config.validate(config.from_namespace(args))
    assert cfg.optim.optimizer == "toy" and cfg.optim.lr == 0.125
    shard = assemble.shard(cfg, 0)
    start = torch.linspace(-1, 1, 37)
    shard.init(start.clone())
    assert isinstance(shard.opt, SignSGD)
    open_start_barrier(shard, cfg.members)
    g = torch.Generator().manual_seed(0)
    expected = start.clone()
    for clock in range(cfg.steps):
        grads = [torch.randn(37, generator=g) for _ in range(cfg.workers)]
        for w in range(cfg.workers):
            with shard.pull(w, 0, clock, "fp32", timeout=30) as p:
                assert torch.equal(p.values, expected) and p.version == clock
                version = p.version
        for w in range(cfg.workers):
            shard.push(w, clock, version, grads[w].clone(), "fp32")
        mean = (grads[0] + grads[1]) / 2
        assert torch.allclose(shard.opt.seen[-1], mean)  # the step's mean gradient, up to its sum's order
        expected -= 0.125 * torch.sign(mean)  # the toy's rule, from this test's own mean
        assert torch.equal(shard.param, expected), clock
    assert shard.opt.updates == shard.policy.version == cfg.steps and shard.policy.done
    state = shard.opt.state_dict()
    optim.check_state(cfg.optim, state)  # the registry's class answers for its own checkpoints
    with pytest.raises(ValueError, match="not a sign-SGD state"):
        optim.check_state(cfg.optim, optim.build(torch.zeros(2), OptimConfig()).state_dict())


@pytest.mark.parametrize("momentum,weight_decay,nesterov", [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.01, True)])
def test_fused_sgd_is_torch_fused_sgd_bit_for_bit(momentum, weight_decay, nesterov):
    # psgd's SGD calls torch's fused kernel itself (not through torch.optim.sgd.sgd's grouping):
    # the same update, momentum buffer made on the first step included.
    cfg = OptimConfig(lr=0.05, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, warmup=3)
    kw = dict(lr=0.05, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, fused=True)
    ours, theirs, mine = run(cfg, torch.optim.SGD, kw, fused=True, warmup_sched=True)
    assert mine.fused, "the fused kernel was taken, not the fallback"
    assert torch.equal(ours, theirs)
    assert (mine.momentum_buffer is None) == (momentum == 0)
    plain, theirs, _ = run(cfg, torch.optim.SGD, dict(kw, fused=False), fused=False, warmup_sched=True)
    assert torch.equal(plain, theirs)
