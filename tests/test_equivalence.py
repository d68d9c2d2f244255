"""Sync PS with N workers x batch b equals 1 worker x batch N*b equals a plain torch loop."""


import threading

import pytest
import torch
import torch.nn.functional as F

from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig
from psgd.train import data, models
from tests.helpers import train_in_threads

STEPS = 25
OPTIM = OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3)
DATA = DataConfig(dataset="synthetic", num_samples=2000)


def run_ps(shards, workers: int, batch: int, servers: int, **kw) -> torch.Tensor:
    cfg = RunConfig(mode="sync", workers=workers, servers=servers, batch_size=batch, steps=STEPS, seed=3,
                    optim=OPTIM, data=DATA, model=ModelConfig(model="mlp", width=32), device="cpu", **kw)
    addresses, cores = shards(cfg)
    return train_in_threads(cfg, addresses, cores)


def run_plain_torch_steps(data_cfg: DataConfig, model_cfg: ModelConfig, optim: OptimConfig, batch: int, steps: int,
                          seed: int) -> list[torch.Tensor]:
    """The reference: one process, torch.optim.SGD, the batch plan's batches of one worker.
    Returns the flat parameters before the first step and after each of `steps` steps."""
    ds = data.load(data_cfg)
    model = models.build(model_cfg, ds.input_dim, ds.num_classes, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    plan = data.BatchPlan(ds.y_train, 1, batch, seed=seed)
    flat = [torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()]
    for step in range(steps):
        idx = plan.indices(0, step)
        opt.zero_grad()
        F.cross_entropy(model(ds.x_train[idx]), ds.y_train[idx]).backward()
        opt.step()
        flat.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
    return flat


def run_plain_torch(batch: int) -> torch.Tensor:
    return run_plain_torch_steps(DATA, ModelConfig(model="mlp", width=32), OPTIM, batch, STEPS, seed=3)[-1]


def test_sync_4x8_equals_1x32_equals_torch(shards):
    four = run_ps(shards, workers=4, batch=8, servers=2)
    one = run_ps(shards, workers=1, batch=32, servers=1)
    plain = run_plain_torch(32)
    assert (four - one).abs().max() < 1e-5
    assert (four - plain).abs().max() < 1e-5
    assert (four - models.FlatParams(models.build(ModelConfig("mlp", 32), 32, 10, 3)).params).abs().max() > 1e-2


def test_accumulation_equals_a_bigger_batch(shards):
    accumulated = run_ps(shards, workers=2, batch=8, servers=2, accumulate=2)
    plain = run_plain_torch(32)
    assert (accumulated - plain).abs().max() < 1e-5


def test_sync_over_tcp_equals_torch(shards):
    over_tcp = run_ps(shards, workers=4, batch=8, servers=2, transport="tcp")
    assert (over_tcp - run_plain_torch(32)).abs().max() < 1e-5


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_push_pull_in_one_round_trip_equals_push_then_pull_bit_for_bit(shards, transport):
    """The combined exchange (the default) sends the same requests to the same policy as a push and
    then a pull, so the parameters are identical: bit for bit with one worker, whose sums have one
    order (with several, the shard sums in arrival order, which differs from run to run)."""
    combined = run_ps(shards, workers=1, batch=32, servers=2, transport=transport)
    separate = run_ps(shards, workers=1, batch=32, servers=2, transport=transport, separate_pull=True)
    assert torch.equal(combined, separate)
    assert (run_ps(shards, workers=4, batch=8, servers=2, transport=transport) - combined).abs().max() < 1e-5


@pytest.mark.parametrize("separate_pull,expected", [(False, {"pull": 1, "push_pull": STEPS}),
                                                    (True, {"pull": STEPS, "push": STEPS})])
def test_one_round_trip_per_step_by_default(shards, monkeypatch, separate_pull, expected):
    """Clock 0 pulls on its own, then every step is one PushPull, where --separate-pull takes a
    push and a pull (the last push's reply says the run is done: no pull follows it)."""
    from psgd.ps import transport as transport_mod

    calls: dict[str, int] = {}
    for name in ("pull", "push", "push_pull"):
        original = getattr(transport_mod.GrpcTransport, name)

        def counted(self, *args, _name=name, _original=original, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *args, **kw)
        monkeypatch.setattr(transport_mod.GrpcTransport, name, counted)
    from psgd.train import models as models_mod

    zeroed_in: list[str] = []  # the exchange zeroes the gradient while it waits for the reply
    original_zero = models_mod.FlatParams.zero_grad
    monkeypatch.setattr(models_mod.FlatParams, "zero_grad",
                        lambda self: (zeroed_in.append(threading.current_thread().name), original_zero(self))[-1])
    run_ps(shards, workers=1, batch=32, servers=2, separate_pull=separate_pull, transport="grpc")
    assert calls == expected
    by_exchange = sum(1 for name in zeroed_in if not name.endswith("(work)"))  # not the worker's own thread
    assert by_exchange == (0 if separate_pull else STEPS)
