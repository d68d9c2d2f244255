"""01 - the reference: one process, plain torch, no psgd machinery.

Every other example (and psgd's equivalence tests) compares against this loop: sync PS with N
workers x batch b must end with the same parameters as this loop with batch N x b.

    python examples/01_one_process.py
"""

import torch
import torch.nn.functional as F

from psgd.core.config import DataConfig, ModelConfig
from psgd.train import data, models

ds = data.load(DataConfig(dataset="synthetic", num_samples=4000))
model = models.build(ModelConfig("mlp"), ds.input_dim, ds.num_classes, seed=0)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
plan = data.BatchPlan(ds.y_train, workers=1, per_worker=64, seed=0)  # the global-batch sequence

for step in range(100):
    idx = plan.indices(0, step)
    opt.zero_grad()
    loss = F.cross_entropy(model(ds.x_train[idx]), ds.y_train[idx])
    loss.backward()
    opt.step()
    if step % 50 == 0:
        print(f"step {step:3d}  loss {loss.item():.3f}")

with torch.no_grad():
    acc = (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()
print(f"test accuracy {acc:.3f}")
# The claim every other example leans on: this loop learns (10 classes: chance is 0.1).
assert acc > 0.5, f"the reference loop should learn the synthetic task, got test accuracy {acc:.3f}"
