"""08 - your own model, plain torch: one process, no psgd at all. 09 and 10 are this file with psgd.

What it shows: the starting point of the next two steps, the loop you already have. A small
nn.Module defined here (two layers with LayerNorm between), your data from `make_data()` (a
seeded generator: 640 training and 160 test samples, 8 features, 3 classes), torch.optim.AdamW,
`train()`: 5 epochs of batch 32, then the test loss and accuracy before and after. The model
holds parameters only, which is what psgd synchronises: it refuses a model with BatchNorm's
running statistics (use LayerNorm or GroupNorm, or BatchNorm(track_running_stats=False)).

The next two steps are this file with a few lines changed (`diff` shows them all):
- 09 hands `make_model` and `make_data` to `psgd.fit`: 2 worker processes, 2 shard processes, sync;
- 10 keeps `train()`, with `w.pull()` for `opt.zero_grad()` and `w.push()` for `opt.step()`, in 2
  worker threads against 2 shards started in this process.
`psgd run --model examples/08_your_model.py:make_model --dataset examples/08_your_model.py:make_data`
trains it from the command line (README.md, "Train your own model").

    python examples/08_your_model.py
    diff examples/08_your_model.py examples/09_your_model_psgd_fit.py
    diff examples/08_your_model.py examples/10_your_loop_psgd.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS, BATCH, LR = 5, 32, 1e-2


class Net(nn.Module):
    """8 features -> 64 -> LayerNorm -> ReLU -> 3 classes: parameters only, no buffers."""

    def __init__(self, features: int = 8, width: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.hidden, self.norm, self.out = nn.Linear(features, width), nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.norm(self.hidden(x))))


def make_model() -> nn.Module:
    return Net()


def make_data():
    """((x_train, y_train), (x_test, y_test)): 800 samples of 8 features from a seeded generator;
    the class is the sign of x0 * x1 (not linearly separable) plus whether x2 > 0.5."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(800, 8, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return (x[:640], y[:640]), (x[640:], y[640:])


def train(model: nn.Module, loader: DataLoader, opt: torch.optim.Optimizer) -> None:
    for _epoch in range(EPOCHS):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


if __name__ == "__main__":
    (x, y), (x_test, y_test) = make_data()
    torch.manual_seed(0)  # the model's initial parameters
    model = make_model()
    loss0, acc0 = evaluate(model, x_test, y_test)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    train(model, loader, torch.optim.AdamW(model.parameters(), lr=LR))
    loss, acc = evaluate(model, x_test, y_test)
    print(f"one process, {EPOCHS} epochs of batch {BATCH}, AdamW lr {LR}")
    print(f"test loss {loss0:.4f} -> {loss:.4f}, test accuracy {acc0:.3f} -> {acc:.3f}")
    assert loss < loss0 / 2 and acc > 0.8, "the model should learn the task (3 classes: chance is about 1/3)"
