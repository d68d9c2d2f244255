"""A user's own model, data and losses, as a test imports them by path (`tests.user_workload:make_model`).

Not a test module: the callables psgd's tests name in --model / --dataset / --loss specs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class TinyNet(nn.Module):
    """Two layers with LayerNorm between (parameters only, no buffers): a model psgd can take."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(6, width), nn.LayerNorm(width), nn.Linear(width, 3)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)  # a constant: allowed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))) * self.scale * 2)


def make_model() -> nn.Module:
    return TinyNet()


def _xy(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def make_data():
    return _xy(512, 0), _xy(128, 1)


class Pairs(Dataset):
    """A map-style Dataset of (x, y) items: psgd reads it into tensors once."""

    def __init__(self, n: int, seed: int) -> None:
        self.x, self.y = _xy(n, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_dataset_objects():
    return Pairs(512, 0), Pairs(128, 1)


def make_regression():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(400, 6, generator=g)
    return (x[:320], x[:320, :3] * 2.0), (x[320:], x[320:, :3] * 2.0)


def half_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean() / 2


# -- bad specs, each refused in one line ---------------------------------------------------------
def needs_width(width):
    return TinyNet(width)


def with_batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))


def not_a_module():
    return "a string"


def mismatched_lengths():
    x, y = _xy(100, 0)
    return (x, y[:90]), (x, y)


def three_things():
    return 1, 2, 3


def wrong_width() -> nn.Module:
    return nn.Linear(5, 3)  # the data has 6 features


def not_scalar(output, target):
    return (output - 0).sum(dim=1)


NOT_CALLABLE = 3
