"""Local SGD (--local-steps H): sync PS and all-reduce both equal N plain torch replicas that step
on their own batches and are averaged every H steps; the budget counts local steps."""

import pytest
import torch
import torch.nn.functional as F

from psgd.allreduce.ring import ring_bytes
from psgd.core import localsgd
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig
from psgd.train import data, models
from psgd.train.metrics import samples_per_update
from tests.helpers import events, processes_mentioning, psgd_main, summary, train_in_threads
from tests.test_equivalence import run_plain_torch

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

DATA = DataConfig(dataset="synthetic", num_samples=2000)
MODEL = ModelConfig(model="mlp", width=32)
OPTIM = OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3, warmup=3)
WORKERS, BATCH, H, STEPS = 3, 8, 4, 14  # 14 local steps round down to 3 rounds of 4
ROUNDS = 3


def reference(workers: int, batch: int, local_steps: int, rounds: int) -> torch.Tensor:
    """Plain torch: N model copies, each with its own SGD (momentum kept), averaged every H steps."""
    ds = data.load(DATA)
    plan = data.BatchPlan(ds.y_train, workers, batch, seed=3)
    replicas = [models.build(MODEL, ds.input_dim, ds.num_classes, seed=3) for _ in range(workers)]
    opts = [torch.optim.SGD(m.parameters(), lr=OPTIM.lr, momentum=OPTIM.momentum, weight_decay=OPTIM.weight_decay)
            for m in replicas]
    for t in range(rounds * local_steps):
        for r, (m, opt) in enumerate(zip(replicas, opts, strict=True)):
            for group in opt.param_groups:
                group["lr"] = OPTIM.lr * min(1.0, (t + 1) / OPTIM.warmup)
            idx = plan.indices(r, t)
            opt.zero_grad()
            F.cross_entropy(m(ds.x_train[idx]), ds.y_train[idx]).backward()
            opt.step()
        if (t + 1) % local_steps == 0:
            with torch.no_grad():
                for copies in zip(*(m.parameters() for m in replicas), strict=True):
                    mean = torch.stack(copies).mean(0)
                    for p in copies:
                        p.copy_(mean)
    return torch.nn.utils.parameters_to_vector(replicas[0].parameters()).detach()


def sync_ps(shards, **kw) -> tuple[torch.Tensor, list]:
    cfg = RunConfig(mode="sync", workers=WORKERS, servers=2, batch_size=BATCH, steps=STEPS, local_steps=H, seed=3,
                    optim=OPTIM, data=DATA, model=MODEL, device="cpu", **kw)
    addresses, cores = shards(cfg)
    return train_in_threads(cfg, addresses, cores), cores


def test_rounds_round_the_budget_down_to_a_multiple_of_h():
    assert localsgd.rounds(14, 4) == 3 and localsgd.rounds(16, 4) == 4 and localsgd.rounds(3, 4) == 1
    assert localsgd.rounds(7, 1) == 7
    sync = RunConfig(mode="sync", workers=4, batch_size=8, local_steps=5)
    assert samples_per_update(sync) == 4 * 8 * 5  # one update = one averaging round
    assert samples_per_update(RunConfig(mode="allreduce", workers=4, batch_size=8)) == 32


def test_sync_ps_local_sgd_equals_averaged_torch_replicas(shards):
    ps, cores = sync_ps(shards)
    expected = reference(WORKERS, BATCH, H, ROUNDS)
    assert (ps - expected).abs().max() < 1e-5
    assert (ps - run_plain_torch(WORKERS * BATCH)).abs().max() > 1e-3  # not plain synchronous SGD
    for s in cores:  # one push per worker per round: steps / H, not steps
        assert s.policy.clocks == [ROUNDS] * WORKERS and s.policy.accepted == ROUNDS * WORKERS
        assert s.stats()["staleness_hist"] == {"0": ROUNDS * WORKERS}


def test_sync_ps_local_sgd_pushes_deltas_in_the_wire_dtype(shards):
    bf16, _ = sync_ps(shards, wire_dtype="bf16")
    expected = reference(WORKERS, BATCH, H, ROUNDS)
    assert 0 < (bf16 - expected).abs().max() < 1e-2


@pytest.mark.parametrize("impl", ["library", "ring"])
def test_allreduce_local_sgd_equals_sync_ps_and_the_reference(tmp_path, shards, impl):
    out = tmp_path / "ar"
    r = psgd_main("run", "--mode", "allreduce", "--allreduce-impl", impl, "--workers", str(WORKERS), "--batch-size",
                  str(BATCH), "--local-steps", str(H), "--steps", str(STEPS), "--eval-every", "2", "--check-every", "1",
                  "--dataset", "synthetic", "--num-samples", "2000", "--model", "mlp", "--width", "32", "--seed", "3",
                  "--lr", str(OPTIM.lr), "--momentum", str(OPTIM.momentum), "--weight-decay", str(OPTIM.weight_decay),
                  "--warmup", str(OPTIM.warmup), "--device", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    allreduce = torch.load(out / "final_params.pt")
    ps, _ = sync_ps(shards)
    assert (allreduce - ps).abs().max() < 1e-5
    assert (allreduce - reference(WORKERS, BATCH, H, ROUNDS)).abs().max() < 1e-5
    s = summary(out)
    assert s["global_updates"] == ROUNDS and s["per_worker_steps"] == {str(k): ROUNDS * H for k in range(WORKERS)}
    assert s["replicas_consistent"] is True and s["consistency_checks"] == ROUNDS  # --check-every counts rounds
    if impl == "library":  # one all-reduce of the parameters per round
        assert s["bytes_sent"] == {str(k): ROUNDS * ring_bytes(s["params"], WORKERS, 4) for k in range(WORKERS)}
    evals = [e for e in events(out) if e["event"] == "eval"]
    assert [e["version"] for e in evals] == [0, 2, 3]
    assert [e["samples"] for e in evals] == [v * WORKERS * BATCH * H for v in (0, 2, 3)]
    assert processes_mentioning(str(out)) == []
