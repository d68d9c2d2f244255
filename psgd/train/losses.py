"""The training loss: a built-in name or your own `(output, target) -> scalar` by import path.

Contract: `get(name)` returns the callable; `cross_entropy` (the default) flattens an output of
shape (..., C) against targets of shape (...), so a language model's (batch, time, vocabulary)
logits need no reshaping, and equals `F.cross_entropy` on (batch, C); `mse` is `F.mse_loss`. A
spec (`--loss pkg.mod:fn`, psgd/train/userspec.py) must accept (output, target) and return a
scalar tensor: psgd/train/workload.py checks it on one batch before any process starts.
Accuracy is reported only with `cross_entropy` (`classifies`): for another loss psgd cannot know
what a correct answer is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from psgd.core.config import is_spec
from psgd.train import userspec

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if output.dim() > 2:  # (..., C) logits, (...) targets: a token-level loss
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction=reduction)
    return F.cross_entropy(output, target, reduction=reduction)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.shape != target.shape:  # F.mse_loss would broadcast them, with a warning, to a wrong loss
        raise ValueError(f"mse: the output's shape {tuple(output.shape)} is not the target's {tuple(target.shape)}")
    return F.mse_loss(output, target)


BUILT_IN: dict[str, Loss] = {"cross_entropy": cross_entropy, "mse": mse}


def get(name: str) -> Loss:
    if is_spec(name):
        return userspec.resolve(name, "--loss", args=("output", "target"))
    return BUILT_IN[name]


def classifies(name: str) -> bool:
    """Whether accuracy means something for this loss (argmax of the output against the target)."""
    return name == "cross_entropy"
