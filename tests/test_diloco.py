"""DiLoCo (--local-steps H --outer nesterov, psgd/core/localsgd.py): sync PS and all-reduce both equal
N torch replicas with their own AdamW, whose mean parameter change every H steps is the "outer
gradient" of torch.optim.SGD(nesterov=True) on the global parameters (Douillard et al. 2023, Alg. 1);
plain local SGD is the outer SGD at lr 1 without momentum, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from psgd.core import localsgd
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig, validate
from psgd.train import data, models
from tests.helpers import psgd_main, summary, train_in_threads

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

DATA = DataConfig(dataset="synthetic", num_samples=2000)
MODEL = ModelConfig(model="mlp", width=32)
INNER = dict(optimizer="adamw", lr=3e-3, beta1=0.9, beta2=0.95, weight_decay=0.1)
WORKERS, BATCH, H, ROUNDS = 3, 8, 4, 3


def reference(outer_lr: float, outer_momentum: float, workers: int = WORKERS) -> torch.Tensor:
    ds = data.load(DATA)
    plan = data.BatchPlan(ds.y_train, workers, BATCH, seed=3)
    global_model = models.build(MODEL, ds.input_dim, ds.num_classes, seed=3)
    outer = torch.optim.SGD(global_model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=True)
    replicas = [models.build(MODEL, ds.input_dim, ds.num_classes, seed=3) for _ in range(workers)]
    inner = [torch.optim.AdamW(m.parameters(), lr=INNER["lr"], betas=(0.9, 0.95), weight_decay=0.1) for m in replicas]
    t = 0
    for _ in range(ROUNDS):
        for _ in range(H):
            for r, (m, opt) in enumerate(zip(replicas, inner, strict=True)):
                idx = plan.indices(r, t)
                opt.zero_grad()
                F.cross_entropy(m(ds.x_train[idx]), ds.y_train[idx]).backward()
                opt.step()
            t += 1
        with torch.no_grad():
            for g, *copies in zip(global_model.parameters(), *(m.parameters() for m in replicas), strict=True):
                g.grad = torch.stack([g - c for c in copies]).mean(0)   # the outer gradient: mean change
        outer.step()
        with torch.no_grad():
            for m in replicas:
                for p, g in zip(m.parameters(), global_model.parameters(), strict=True):
                    p.copy_(g)
    return torch.nn.utils.parameters_to_vector(global_model.parameters()).detach()


def ps_run(shards, mode: str = "sync", workers: int = WORKERS, **optim) -> torch.Tensor:
    cfg = validate(RunConfig(mode=mode, workers=workers, servers=2, batch_size=BATCH, steps=ROUNDS * H, local_steps=H,
                             seed=3, data=DATA, model=MODEL, device="cpu", optim=OptimConfig(**INNER, **optim)))
    addresses, cores = shards(cfg)
    return train_in_threads(cfg, addresses, cores)


def test_outer_defaults_are_plain_averaging_and_diloco():
    assert localsgd.outer_config(OptimConfig()) == OptimConfig(lr=1.0, momentum=0.0)
    d = localsgd.outer_config(OptimConfig(outer="nesterov"))
    assert (d.lr, d.momentum, d.nesterov) == (0.7, 0.9, True) and localsgd.plain_average(OptimConfig())
    assert not localsgd.plain_average(OptimConfig(outer="nesterov"))


def test_sync_ps_diloco_equals_adamw_replicas_with_an_outer_nesterov_step(shards):
    got = ps_run(shards, outer="nesterov")
    want = reference(0.7, 0.9)
    assert (got - want).abs().max() < 1e-5
    plain = ps_run(shards)  # outer SGD at lr 1: the replicas' average, another trajectory
    assert (got - plain).abs().max() > 1e-3


def test_plain_local_sgd_is_the_outer_sgd_at_lr_1_bit_for_bit(shards):
    assert torch.equal(ps_run(shards), ps_run(shards, outer="sgd", outer_lr=1.0))


def test_allreduce_diloco_equals_the_ps(tmp_path, shards):
    out = tmp_path / "ar"
    r = psgd_main("run", "--mode", "allreduce", "--workers", str(WORKERS), "--batch-size", str(BATCH),
                  "--local-steps", str(H), "--steps", str(ROUNDS * H), "--dataset", "synthetic", "--num-samples",
                  "2000", "--model", "mlp", "--width", "32", "--seed", "3", "--optimizer", "adamw", "--lr", "3e-3",
                  "--beta2", "0.95", "--weight-decay", "0.1", "--outer", "nesterov", "--outer-momentum", "0.8",
                  "--device", "cpu", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    allreduce = torch.load(out / "final_params.pt")
    assert (allreduce - ps_run(shards, outer="nesterov", outer_momentum=0.8)).abs().max() < 1e-5
    assert (allreduce - reference(0.7, 0.8)).abs().max() < 1e-5
    assert summary(out)["global_updates"] == ROUNDS


@pytest.mark.parametrize("nesterov, momentum", [(True, 0.9), (False, 0.8), (False, 0.0)])
def test_delayed_nesterov_moves_a_round_of_n_changes_as_one_outer_step_on_their_mean(nesterov, momentum):
    from psgd.core.delayed_nesterov import DelayedNesterov

    torch.manual_seed(0)
    cfg = OptimConfig(lr=0.7, momentum=momentum, nesterov=nesterov)
    mine, ref = torch.zeros(5), torch.zeros(5, requires_grad=True)
    dn, sgd = DelayedNesterov(mine, cfg, workers=3), torch.optim.SGD([ref], lr=0.7, momentum=momentum,
                                                                      nesterov=nesterov)
    for _ in range(3):  # rounds
        deltas = torch.randn(3, 5)
        for d in deltas:
            mine.grad = d
            dn.step()
        ref.grad = deltas.mean(0)
        sgd.step()
        assert torch.allclose(mine, ref.detach(), atol=1e-6)
    state = dn.state_dict()
    back = DelayedNesterov(torch.zeros(5), cfg, workers=3)
    back.load_state_dict(state)
    assert back.arrivals == 9 and torch.equal(back.momentum_buffer, dn.momentum_buffer)


def test_async_diloco_with_one_worker_is_diloco(shards):
    """Async rounds of one worker: every arrival is a whole round, so the shard's delayed Nesterov
    is DiLoCo's outer step (to float rounding: psgd's arithmetic, not torch's kernel)."""
    got = ps_run(shards, mode="async", workers=1, outer="nesterov")
    assert (got - reference(0.7, 0.9, workers=1)).abs().max() < 1e-5


def test_outer_flags_without_local_steps_are_refused():
    r = psgd_main("run", "--outer", "nesterov", "--steps", "2")
    assert r.returncode == 2 and "give --local-steps H > 1" in r.stderr
    assert psgd_main("run", "--nesterov", "--momentum", "0").returncode == 2


def test_bytes_per_step_fall_as_one_over_h(tmp_path):
    common = ["--mode", "sync", "--workers", "2", "--batch-size", "8", "--steps", "24", "--dataset", "synthetic",
              "--num-samples", "600", "--quiet"]
    per_step = {}
    for h in (1, 4):
        out = tmp_path / f"h{h}"
        diloco = ["--local-steps", str(h), "--outer", "nesterov", "--optimizer", "adamw", "--lr", "1e-3"]
        extra = diloco if h > 1 else []
        assert psgd_main("run", *common, *extra, "--out", str(out)).returncode == 0
        per_step[h] = summary(out)["bytes_per_step"]
    # A step pushes and pulls once (PushPull; the last push's reply brings nothing): H = 4 does it
    # once per round, 6 rounds in 24 steps.
    assert per_step[4] / per_step[1] == pytest.approx((6 + 6 + 0) / (24 + 24), abs=0.03)
