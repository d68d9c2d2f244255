"""Backup workers (`--mode sync --backup-workers b`, psgd/core/consistency.py `Sync`).

Policy-level tests drive `Sync` with a fixed arrival order (a deterministic straggler), so the
dropped gradients and the applied means are known exactly; one in-process run per exchange path
(PushPull, --separate-pull, --overlap) checks the shard's budget and stats end to end.
"""

import pytest
import torch

from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig, validate
from psgd.core.consistency import PolicyError, PullTimeout, Sync, make_policy
from tests.helpers import psgd_main, train_in_threads

pytestmark = pytest.mark.usefixtures("warm_runs")  # its runs fork from the tests' warm parent


class Param:
    """A stand-in shard: records every applied update."""

    def __init__(self):
        self.applied: list[torch.Tensor] = []

    def apply(self, g):
        self.applied.append(g.clone())


def grad(seed: int) -> torch.Tensor:
    return torch.randn(5, generator=torch.Generator().manual_seed(seed))


def step(pol: Sync, order: list[int], clocks: list[int], seed: int) -> list:
    """Each worker in `order` pulls (served: it must not be held) and pushes its gradient."""
    outs = []
    for w in order:
        pulled = pol.pull(w, clocks[w], lambda: None, timeout=1.0)
        outs.append(pol.push(w, clocks[w], pulled.version, grad(seed * 10 + w)))
        clocks[w] += 1
    return outs


def test_b0_equals_plain_sync_bit_for_bit():
    """b = 0 takes BSP's path: the same updates, bit for bit, as the policy without the option,
    and each is ((g_0 + g_1) + g_2) / 3, summed in worker order whatever order they arrived in."""
    plain, backup0 = Param(), Param()
    pols = [Sync(3, plain.apply), make_policy("sync", 3, backup0.apply, backup=0)]
    for pol in pols:
        clocks = [0, 0, 0]
        for s, order in enumerate([[0, 1, 2], [2, 0, 1], [1, 2, 0]]):
            step(pol, order, clocks, s)
    assert len(plain.applied) == len(backup0.applied) == 3
    for s, (a, b, order) in enumerate(zip(plain.applied, backup0.applied, [[0, 1, 2], [2, 0, 1], [1, 2, 0]],
                                          strict=True)):
        g = [grad(s * 10 + w) for w in sorted(order)]
        assert torch.equal(a, b) and torch.equal(a, ((g[0] + g[1]) + g[2]) / 3)
    assert pols[1].stats.dropped == {} and pols[1].version == 3


def test_b1_applies_the_mean_of_the_first_and_drops_exactly_the_late(threads):
    p = Param()
    pol = Sync(3, p.apply, backup=1)
    clocks = [0, 0, 1]
    pol.pull(2, 0, lambda: None, timeout=1.0)      # the straggler starts step 0 with the others ...
    first = step(pol, [1, 0], clocks, 0)           # ... workers 1, 0 push in time: step 0 is applied
    assert [o.applied for o in first] == [False, True] and pol.version == 1
    assert torch.equal(p.applied[0], (grad(1) + grad(0)) / 2)
    late = pol.push(2, 0, 0, grad(2))              # the straggler's gradient of step 0
    assert late.dropped and not late.applied and pol.version == 1 and len(p.applied) == 1
    assert pol.stats.dropped == {2: 1} and pol.accepted == 2 and sum(pol.stats.staleness.values()) == 2
    # An in-time worker waits for its step's update, as in BSP; the late one is served at once.
    pol.push(0, 1, 1, grad(100))
    clocks[0] += 1
    with pytest.raises(PullTimeout):
        pol.pull(0, 2, lambda: None, timeout=0.05)
    served = pol.pull(2, 1, lambda: "newest", timeout=1.0)
    assert served.value == "newest" and served.version == 1
    held = threads.start(pol.pull, 0, 2, lambda: None, timeout=5.0, name="pull w0 c2")
    assert pol.push(2, 1, 1, grad(102)).applied    # the straggler caught up: it completes step 1
    threads.join()
    assert held.result.version == 2
    assert torch.equal(p.applied[1], (grad(100) + grad(102)) / 2)


def test_a_worker_two_steps_behind_catches_up_and_a_second_push_for_a_step_is_refused():
    p = Param()
    pol = Sync(3, p.apply, backup=1)
    clocks = [0, 0, 0]
    pol.pull(2, 0, lambda: None, timeout=1.0)      # the straggler computes on version 0 ...
    for s in range(3):
        step(pol, [0, 1], clocks, s)               # ... while the others make three updates
    assert pol.version == 3
    out = pol.push(2, 0, 0, grad(7))               # 3 steps late
    assert out.dropped and out.staleness == 3
    pulled = pol.pull(2, 1, lambda: None, timeout=1.0)
    assert pulled.version == 3                      # the newest parameters, at once
    assert not pol.push(2, 1, 3, grad(8)).dropped  # its gradient counts for the current step
    with pytest.raises(PolicyError, match="pushed for step 3 after"):
        pol.push(2, 2, 3, grad(9))                 # no second gradient for one step
    assert pol.push(0, 3, 3, grad(10)).applied
    assert torch.equal(p.applied[-1], (grad(8) + grad(10)) / 2)
    assert pol.stats.dropped == {2: 1} and pol.clocks == [4, 3, 2]


def test_the_run_ends_at_exactly_steps_updates():
    steps, n, b = 4, 3, 2
    pol = Sync(n, Param().apply, budget=steps * (n - b), backup=b)
    clocks = [0, 0, 0]
    for s in range(steps):
        step(pol, [s % n], clocks, s)              # one gradient per update, the others come late
        if s < steps - 1:
            assert not pol.done
    assert pol.version == steps and pol.done
    late = pol.push(1, clocks[1], 0, grad(99))
    assert late.refused and late.done and pol.version == steps
    assert pol.pull(1, clocks[1], lambda: None, timeout=1.0).done


@pytest.mark.parametrize("mode,extra", [("sync", {"backup_workers": 2}), ("async", {"backup_workers": 1}),
                                        ("allreduce", {"backup_workers": 1}), ("sync", {"backup_workers": -1})])
def test_bad_backup_workers_are_refused(mode, extra):
    with pytest.raises(ValueError, match="--backup-workers"):
        validate(RunConfig(mode=mode, workers=2, **extra))


def test_bad_backup_workers_exit_2_with_one_line():
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--backup-workers", "2")
    assert r.returncode == 2 and "--backup-workers must be in 0..N-1 = 0..1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("exchange", [dict(transport="tcp"), dict(transport="grpc", separate_pull=True),
                                      dict(transport="tcp", overlap=True)])
def test_run_with_backup_workers_makes_exactly_steps_updates(shards, exchange):
    """Every exchange path: each shard makes exactly `steps` updates, each from N-b gradients; the
    rest were dropped (late) or refused (after the budget), none applied."""
    cfg = RunConfig(mode="sync", workers=3, backup_workers=1, servers=2, batch_size=8, steps=8, seed=1,
                    optim=OptimConfig(lr=0.1), data=DataConfig(dataset="synthetic", num_samples=400),
                    model=ModelConfig(model="mlp", width=16), device="cpu", **exchange)
    addresses, cores = shards(cfg)
    params = train_in_threads(cfg, addresses, cores)  # checks version == steps on every shard
    assert torch.isfinite(params).all()
    for core in cores:
        st = core.stats()
        assert st["accepted"] == cfg.steps * 2 and sum(st["staleness_hist"].values()) == cfg.steps * 2
        assert st["dropped_gradients"] == sum(st["dropped_per_worker"].values())


def test_summary_sums_the_dropped_gradients_of_every_shard(tmp_path):
    from psgd.train.metrics import Metrics, summarize

    cfg = RunConfig(mode="sync", workers=3, backup_workers=1, servers=2)
    m = Metrics(tmp_path / "metrics.jsonl")
    for rank in range(3):
        m.write(event="worker_end", rank=rank, steps=5, train_start=0.0, train_end=1.0, process_start=0.0,
                bytes_pushed=0, bytes_pulled=0, compute_s=0.0, push_s=0.0, pull_s=0.0, wait_s=0.0)
    m.close()
    shard = {"version": 4, "staleness_hist": {"0": 8}, "max_clock_gap": 1}
    s = summarize(tmp_path, cfg, [], 10, "", [dict(shard, dropped_gradients=3, dropped_per_worker={"2": 3}),
                                            dict(shard, dropped_gradients=4, dropped_per_worker={"0": 1, "2": 3})])
    assert s["dropped_gradients"] == 7 and s["dropped_per_worker"] == {"0": 1, "2": 6}
    assert s["backup_workers"] == 1 and s["global_updates"] == 4
