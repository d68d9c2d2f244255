"""09 - your own model with psgd.fit: 08's file with its loop replaced by one call (real processes, sync).

What it shows: the high level. `psgd.fit` runs the job `psgd run` runs, on 08's model and data: 2
worker processes and 2 parameter-shard processes, sync (each update the mean of the 2 workers'
gradients over 16 samples each: 08's batch of 32), AdamW at 08's rate (the shards step it), 5
epochs. Every process of the job builds its own model and data, so fit takes them by name:
`f"{__file__}:make_model"` is this file's path and the function. (Passing `make_model` itself
would be refused: a function of `__main__` cannot be imported by another process; the message
gives the spec to use.) The other processes load this file as a module, so the script's own work
stays under `if __name__ == "__main__":`. Each builds the model under seed 0 (`--seed`), the
model whose test loss is printed first. A bad spec is a ValueError of one line before any process
starts. fit returns summary.json's figures and the trained model; the script checks that the
model holds what the workers trained (its test loss is the run's) and that it learned as 08's did.
The run's folder is results/runs/sync-<time> (`out=` to choose), as for `psgd run`.

    python examples/09_your_model_psgd_fit.py
    diff examples/08_your_model.py examples/09_your_model_psgd_fit.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import psgd

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


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


if __name__ == "__main__":
    (x, y), (x_test, y_test) = make_data()
    torch.manual_seed(0)  # the model's initial parameters
    model = make_model()
    loss0, acc0 = evaluate(model, x_test, y_test)
    result = psgd.fit(model=f"{__file__}:make_model", data=f"{__file__}:make_data", mode="sync", workers=2, servers=2,
                      epochs=EPOCHS, batch_size=BATCH // 2, optimizer=psgd.AdamW(lr=LR))
    model, s = result.model, result.summary
    loss, acc = evaluate(model, x_test, y_test)
    print(f"psgd.fit: {s['global_updates']} sync updates of 2 workers x {BATCH // 2}, {s['wall_time_s']:.2f} s "
          f"after {s['startup_s']:.2f} s of start-up, {result.out}")
    print(f"test loss {loss0:.4f} -> {loss:.4f}, test accuracy {acc0:.3f} -> {acc:.3f}")
    assert abs(loss - s["final_test_loss"]) < 1e-5, "result.model holds the parameters the workers trained"
    assert loss < loss0 / 2 and acc > 0.8, "the model should learn the task (3 classes: chance is about 1/3)"
