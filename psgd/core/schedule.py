"""What every optimizer in psgd shares (psgd/core/optim.py's SGD, psgd/core/adamw.py): the warmup
schedule and where torch has fused kernels.

Warmup (Goyal et al. 2017, sec. 2.2): update number n + 1 (n = 0, 1, ...) uses
lr x min(1, (n + 1) / warmup), i.e. from lr / warmup up to lr over `warmup` updates, then lr
(the rate `torch.optim.lr_scheduler.LambdaLR` would set with `warmup_factor`).
"""

from __future__ import annotations

from collections.abc import Callable

FUSED_DEVICES = ("cpu", "cuda")  # where this torch has fused SGD / Adam kernels for float tensors


def warmup_factor(warmup: int) -> Callable[[int], float]:
    """The multiplier of the base lr for update number n + 1 (see the module docstring)."""
    return lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0
