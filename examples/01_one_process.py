"""01 - the baseline: one process, plain torch SGD, no psgd machinery at all.

What it shows: the loop every later step is measured against. Sync SGD with N workers x batch b
must end where this loop ends with batch N x b (04 checks it), so note the two numbers it prints
last: the final training loss and the norm of the final parameters.

    python examples/01_one_process.py
    python examples/01_one_process.py --steps 200 --batch 32

`train()` is also what examples/04 runs as its reference (it loads this file with runpy).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from psgd.core.config import DataConfig, ModelConfig
from psgd.train import data, models

DATA = DataConfig(dataset="synthetic", num_samples=4000)  # 32 features, 10 classes, made offline
MODEL = ModelConfig("mlp")                                   # 2 hidden layers of 128: 22,026 parameters
LR, MOMENTUM, SEED = 0.05, 0.9, 0                            # psgd's defaults (psgd/core/config.py)


def train(steps: int = 100, batch: int = 64, log_every: int = 0) -> tuple[torch.nn.Module, float]:
    """Plain torch SGD on the global-batch sequence; returns (model, loss of the last batch)."""
    ds = data.load(DATA)
    model = models.build(MODEL, ds.input_dim, ds.num_classes, seed=SEED)
    # fused=True: one kernel per step, the one psgd's shards use (psgd/core/optim.py). The
    # default foreach kernel rounds the momentum update differently in the last bit, and 04
    # wants the summation order to be the only difference left.
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, fused=True)
    # BatchPlan with one worker yields the same global batches a run with N workers cuts into N slices.
    plan = data.BatchPlan(ds.y_train, workers=1, per_worker=batch, seed=SEED)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        idx = plan.indices(0, step)
        opt.zero_grad()
        loss = F.cross_entropy(model(ds.x_train[idx]), ds.y_train[idx])
        loss.backward()
        opt.step()
        if log_every and step % log_every == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    return model, loss.item()


def flat(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one vector, in the model's order: the layout psgd shards."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="SGD steps (updates)")
    ap.add_argument("--batch", type=int, default=64, help="samples per step (the global batch)")
    args = ap.parse_args()

    model, last_loss = train(args.steps, args.batch, log_every=25)
    ds = data.load(DATA)
    with torch.no_grad():
        acc = (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()
    params = flat(model)
    print(f"after {args.steps} steps of batch {args.batch}: last batch loss {last_loss:.4f}, "
          f"test accuracy {acc:.3f}")
    print(f"final parameters: {params.numel()} numbers, norm {params.norm():.4f}")
    # The claim the later steps lean on: this loop learns (10 classes: chance is 0.1).
    assert acc > 0.5, f"the baseline should learn the synthetic task, got test accuracy {acc:.3f}"


if __name__ == "__main__":
    main()
