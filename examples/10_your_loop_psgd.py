"""10 - your own loop with psgd: 08's file with its train() kept, each step a pull and a push (2 threads).

What it shows: the low level, for a loop you keep. `psgd.start_shards` serves 2 parameter shards
in this process (sync, AdamW at 08's rate: the shards hold the optimizer now). Each of 2 worker
threads connects its own copy of the model (`psgd.connect(model, shards.addresses, rank=r,
workers=2)`) and runs 08's `train()` on its half of every epoch (torch's DistributedSampler,
batch 16: 08's batch of 32), its optimizer argument now the Worker `w`, each epoch setting the
sampler's epoch, and two lines swapped: `w.pull()` for `opt.zero_grad()` (the shards' parameters,
into the model; sync holds it until the step's update is applied) and `w.push()` for `opt.step()`
(the gradient backward wrote, to the shards, zeroed for the next batch). The models are built
before the threads start, all alike (copies of the first, as DDP broadcasts rank 0's): whichever
worker's Init reaches a shard first sets its start, so the start, and with it the run, is the same
every time; every pull then overwrites the models' parameters.
The push's reply carries the next parameters, so after the last push each model holds the final
ones; the script checks that they are the shards' and that the model learned as 08's did.

    python examples/10_your_loop_psgd.py
    diff examples/08_your_model.py examples/10_your_loop_psgd.py
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import psgd

EPOCHS, BATCH, LR, WORKERS = 5, 32, 1e-2, 2


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


def train(model: nn.Module, loader: DataLoader, w: psgd.Worker) -> None:
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)  # DistributedSampler: this worker's share of epoch `epoch`
        for xb, yb in loader:
            w.pull()  # the shards' parameters, into the model
            F.cross_entropy(model(xb), yb).backward()
            w.push()  # the gradient, to the shards; zeroed for the next batch


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


if __name__ == "__main__":
    (x, y), (x_test, y_test) = make_data()
    torch.manual_seed(0)  # the model's initial parameters
    model = make_model()
    models = [model, *(copy.deepcopy(model) for _ in range(WORKERS - 1))]  # one per worker, alike, before the threads
    loss0, acc0 = evaluate(model, x_test, y_test)

    def work(rank: int) -> None:
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=WORKERS, rank=rank, seed=0)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH // WORKERS, sampler=sampler)
        with psgd.connect(models[rank], shards.addresses, rank=rank, workers=WORKERS) as w:
            train(models[rank], loader, w)

    with psgd.start_shards(servers=2, workers=WORKERS, mode="sync", optimizer=psgd.AdamW(lr=LR)) as shards:
        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(work, range(WORKERS)))  # re-raises a worker's error here
        final = shards.params()
    loss, acc = evaluate(model, x_test, y_test)
    print(f"your loop: {WORKERS} worker threads x batch {BATCH // WORKERS}, 2 shards, {EPOCHS} epochs, AdamW lr {LR}")
    print(f"test loss {loss0:.4f} -> {loss:.4f}, test accuracy {acc0:.3f} -> {acc:.3f}")
    assert all(torch.equal(torch.nn.utils.parameters_to_vector(m.parameters()), final) for m in models), \
        "after the last push each worker's model holds the shards' final parameters"
    assert loss < loss0 / 2 and acc > 0.8, "the model should learn the task (3 classes: chance is about 1/3)"
