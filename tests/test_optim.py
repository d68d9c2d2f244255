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
