"""The transport-free shard core (psgd/ps/shard.py), driven directly: no gRPC, no sockets."""

from __future__ import annotations

import threading

import pytest
import torch

from psgd.core import optim
from psgd.core.config import OptimConfig, RunConfig
from psgd.core.errors import Code, ShardError
from psgd.ps.shard import Shard
from psgd.train import assemble
from tests.helpers import open_start_barrier


def ready_shard(**kw) -> Shard:
    cfg = RunConfig(**{"mode": "async", "workers": 2, "servers": 1, "steps": 100, **kw})
    s = assemble.shard(cfg, 0)
    s.init(torch.arange(4, dtype=torch.float32))
    open_start_barrier(s)
    return s


def refused(fn, code: Code, match: str) -> None:
    with pytest.raises(ShardError, match=match) as err:
        fn()
    assert err.value.code is code


def test_init_push_pull_without_any_transport():
    s = ready_shard()
    assert s.init(torch.zeros(4)) == (0, False)  # the second init changes nothing
    s.check_push(0, 0, 4)
    out = s.push(0, 0, 0, torch.ones(4), "fp32")
    assert out.applied and out.version == 1
    with s.pull(0, 0, 1, "fp16", timeout=5) as p:
        assert p.version == 1 and not p.done and p.values.dtype == torch.float16
        assert torch.equal(p.values.float(), (torch.arange(4) - 0.05).half().float())
    stats = s.stats()
    assert stats["bytes_in"] == 16 and stats["bytes_out"] == 4 * 2  # one push in fp32, one pull in fp16


def test_pulls_of_one_version_share_one_copy_that_no_update_changes():
    s = ready_shard()
    with s.pull(0, 0, 0, "fp32", timeout=5) as a, s.pull(1, 0, 0, "fp32", timeout=5) as b:
        assert a.values is b.values  # one copy of version 0, lent to both pulls
        s.push(0, 0, 0, torch.ones(4), "fp32")  # version 1 while version 0 is still being sent
        with s.pull(0, 0, 1, "fp32", timeout=5) as c:
            assert c.version == 1 and c.values is not a.values
            assert torch.equal(c.values, torch.arange(4) - 0.05)
        assert torch.equal(a.values, torch.arange(4, dtype=torch.float32))  # untouched by the update
    with s.pull(1, 0, 0, "fp32", timeout=5) as d:  # async: the newest version
        assert d.version == 1 and torch.equal(d.values, torch.arange(4) - 0.05)
    assert s.stats()["bytes_out"] == 4 * 4 * 4  # counted per pull, shared or not


def test_a_one_worker_shard_keeps_its_parameters_in_memory_given_and_leaves_it_intact():
    """snapshots.py `home` (the shm room's reply region): updates land there, nothing is copied to
    reply, the region is never pooled, and `leave_home` moves the parameters out before it goes."""
    s = ready_shard(workers=1)
    region = torch.full((4,), float("nan"))
    with s.pull(0, 0, 0, "fp32", timeout=5) as p:
        assert not s.home(region, p.values)  # the region does not hold them yet: refused below
        region.copy_(p.values)  # the reply's copy
        assert s.home(region, p.values) and s.param.data_ptr() == region.data_ptr()
    s.push(0, 0, 0, torch.ones(4), "fp32")
    assert torch.equal(region, torch.arange(4) - 0.05)  # the update landed in the region
    with s.pull(0, 0, 1, "fp32", timeout=5) as p:
        assert p.values.data_ptr() == region.data_ptr()  # lent as it is: a reply there copies nothing
    s.leave_home(region)
    region.fill_(float("nan"))  # the region's memory goes (unmapped, or reused by its owner)
    assert torch.equal(s.param, torch.arange(4) - 0.05) and s.stats()["params_homed"]
    s.push(0, 1, 1, torch.ones(4), "fp32")
    with s.pull(0, 0, 2, "fp32", timeout=5):  # a newer version: the region's snapshot is let go
        pass
    pooled = []
    for pool in s._pools.values():  # noqa: SLF001 - what the shard would hand out again
        while not pool.empty():
            pooled.append(pool.get_nowait().data_ptr())
    assert region.data_ptr() not in pooled
    two = ready_shard(workers=2)
    with two.pull(0, 0, 0, "fp32", timeout=5) as p:
        assert not two.home(p.values.clone(), p.values)  # another worker may read them: never


def test_refusals_carry_a_code_and_change_nothing():
    s = assemble.shard(RunConfig(mode="sync", workers=2, servers=1), 0)
    refused(lambda: s.check_push(0, 0, 4), Code.FAILED_PRECONDITION, "not initialised")
    s.init(torch.zeros(4))
    refused(lambda: s.init(torch.zeros(5)), Code.INVALID_ARGUMENT, "holds 4 elements")
    refused(lambda: s.check_push(0, 1, 4), Code.INVALID_ARGUMENT, "for shard 1")
    refused(lambda: s.check_push(5, 0, 4), Code.INVALID_ARGUMENT, "worker id 5")
    refused(lambda: s.check_push(0, 0, 3), Code.INVALID_ARGUMENT, "has 4 elements")
    refused(lambda: s.push(0, 1, 0, torch.ones(4), "fp32"), Code.INVALID_ARGUMENT, "clock 1")
    refused(lambda: s.push(0, 0, 0, torch.tensor([0.0, float("nan"), 0, 0]), "fp32"), Code.INVALID_ARGUMENT,
            "non-finite")
    assert s.policy.clocks == [0, 0] and s.policy.version == 0 and s.stats()["bytes_in"] == 0


def test_a_pull_with_a_wrong_clock_is_refused_not_let_through():
    # SSP s=0: worker 0 has pushed once; worker 1 not at all. A pull at clock 1 must wait; a
    # forged clock 0 would pass the gate unheld, so the shard refuses it.
    s = ready_shard(mode="ssp", staleness=0)
    s.push(0, 0, 0, torch.ones(4), "fp32")
    refused(lambda: s.pull(0, 0, 0, "fp32", timeout=5).__enter__(), Code.INVALID_ARGUMENT, "next push is clock 1")
    refused(lambda: s.pull(0, 0, 1, "fp32", timeout=0.01).__enter__(), Code.DEADLINE_EXCEEDED, "held")


def test_counters_are_exact_under_concurrent_pushes():
    n, steps = 8, 50
    s = assemble.shard(RunConfig(mode="async", workers=n, servers=1, steps=10_000), 0)
    s.init(torch.zeros(1000))
    errors = []

    def push(w):
        try:
            for c in range(steps):
                s.push(w, c, 0, torch.full((1000,), 1e-6), "fp16")
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=push, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert s.stats()["bytes_in"] == n * steps * 1000 * 2 and s.policy.version == n * steps


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_warmup_schedule_is_linear_then_flat(warmup):
    p = torch.zeros(1)
    opt = optim.SGD(p, OptimConfig(lr=0.2, momentum=0.0, warmup=warmup))
    rates = []
    for _ in range(8):
        rates.append(opt.lr)
        p.grad = torch.ones(1)
        opt.step()
    expected = [0.2 * min(1.0, (n + 1) / warmup) if warmup else 0.2 for n in range(8)]
    assert rates == pytest.approx(expected)
    assert p.item() == pytest.approx(-sum(expected))  # each step used the rate it announced


def test_shard_and_replica_take_the_same_warmed_up_steps():
    cfg = RunConfig(mode="sync", workers=1, servers=1, optim=OptimConfig(lr=0.1, momentum=0.9, warmup=3))
    s = assemble.shard(cfg, 0)
    s.init(torch.ones(5))
    replica = torch.ones(5)
    opt = optim.SGD(replica, cfg.optim)
    for clock in range(6):
        g = torch.linspace(-1, 1, 5) * (clock + 1)
        s.push(0, clock, clock, g.clone(), "fp32")
        replica.grad = g
        opt.step()
    assert torch.allclose(s.param, replica, atol=1e-6)


def test_init_header_is_checked_like_a_push():
    s = assemble.shard(RunConfig(mode="sync", workers=2, servers=2), 0)
    refused(lambda: s.check_init(0, 1, 4), Code.INVALID_ARGUMENT, "for shard 1")
    refused(lambda: s.check_init(2, 0, 4), Code.INVALID_ARGUMENT, "worker id 2")
    refused(lambda: s.check_init(1, 0, 2**62), Code.INVALID_ARGUMENT, "2..")  # never sizes memory by it
    s.check_init(1, 0, 4)
    # With the model's size from the server's own config (11 parameters, 2 shards: 6 + 5), the
    # header must say exactly this shard's length, before a byte of data is read.
    s = assemble.shard(RunConfig(mode="sync", workers=2, servers=2), 1, num_params=11)
    refused(lambda: s.check_init(0, 1, 6), Code.INVALID_ARGUMENT, "has 5 elements; Init header says 6")
    s.check_init(0, 1, 5)
    assert s.max_payload == 5 * 8  # at most every element as a sparse (index, fp32 value) pair


def test_a_failed_update_is_not_counted():
    from psgd.core.consistency import Async

    def apply(grad):
        raise RuntimeError("the optimizer failed")

    policy = Async(1, apply)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        policy.push(0, 0, 0, torch.ones(2))
    assert policy.version == 0  # the version still names the parameters' state


def test_the_wait_for_the_chiefs_init_is_start_up_not_pull_time():
    """A worker whose first pull arrives before the chief's Init waits for it: that hold is reported
    as wait_s (start-up, which the worker keeps out of its times), never as transfer time."""
    import time

    s = assemble.shard(RunConfig(mode="async", workers=1, servers=1, steps=10), 0)

    class InitArrivesDuringTheWait(threading.Event):
        def wait(self, timeout=None):
            # The chief's Init lands while this pull waits; the hold lasts at least `held`.
            start, held = time.perf_counter(), 0.05
            while time.perf_counter() - start < held:
                pass
            s.init(torch.zeros(4))
            return super().wait(timeout)

    s.ready = InitArrivesDuringTheWait()
    with s.pull(0, 0, 0, "fp32", timeout=5) as p:
        assert p.version == 0 and not p.done
        assert p.wait_s >= 0.05


def test_sync_keeps_a_received_buffer_as_its_sum_and_lends_the_parameters_uncopied():
    def step(s: Shard, keep: bool) -> torch.Tensor:
        for w, g in enumerate((torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 0.25, -1.0, 3.0]))):
            with s.receive_buffer() as buf:
                buf.copy_(g)
                out = s.push(w, 0, 0, buf if keep else g.clone(), "fp32")
            assert out.kept == (keep and w == 0)  # the step's first gradient becomes its sum
        with s.pull(0, 0, 1, "fp32", timeout=5) as p:
            assert p.version == 1
            assert p.values.data_ptr() == s.param.data_ptr()  # fp32 pulls get the parameters themselves
            return p.values.clone()

    kept, copied = ready_shard(mode="sync"), ready_shard(mode="sync")
    assert torch.equal(step(kept, keep=True), step(copied, keep=False))  # bit for bit the same update
    assert kept.stats()["copies_on_write"] == 0  # nothing was lent when the update came
    with ready_shard(mode="sync").pull(0, 0, 0, "fp16", timeout=5) as p:
        assert p.values.dtype == torch.float16  # other wire dtypes: one converted copy per version


def test_an_update_leaves_the_parameters_a_pull_still_sends_as_they_were():
    s = ready_shard(optim=OptimConfig(lr=0.05, momentum=0.0))  # async: an update during another pull
    with s.pull(0, 0, 0, "fp32", timeout=5) as p:
        lent, before = p.values, p.values.clone()
        s.push(1, 0, 0, torch.ones(4), "fp32")
        assert torch.equal(p.values, before) and p.values is lent  # copy on write: the pull's are untouched
        assert s.param.data_ptr() != lent.data_ptr() and torch.equal(s.param, before - 0.05)
        with s.pull(1, 0, 1, "fp32", timeout=5) as q:  # the next version is lent as it is
            assert q.version == 1 and q.values.data_ptr() == s.param.data_ptr()
    assert s.stats()["copies_on_write"] == 1
    s.push(0, 0, 0, torch.ones(4), "fp32")  # nothing lent now: updated in place, no copy
    assert s.stats()["copies_on_write"] == 1 and torch.equal(s.param, before - 0.05 - 0.05)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("momentum,weight_decay,warmup", [(0.0, 0.0, 0), (0.9, 1e-3, 3)])
def test_sgd_is_torch_optim_sgd_bit_for_bit(fused, momentum, weight_decay, warmup):
    ours, theirs = torch.linspace(-1, 1, 64), torch.linspace(-1, 1, 64)
    opt = optim.SGD(ours, OptimConfig(lr=0.1, momentum=momentum, weight_decay=weight_decay, warmup=warmup), fused)
    reference = torch.optim.SGD([theirs], lr=0.1, momentum=momentum, weight_decay=weight_decay, fused=fused or None)
    schedule = torch.optim.lr_scheduler.LambdaLR(reference, optim.warmup_factor(warmup))
    for step in range(6):
        g = torch.sin(torch.arange(64.0) * (step + 1))
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
        schedule.step()
    assert torch.equal(ours, theirs)


def test_receive_buffers_go_back_to_the_pool_once_whatever_the_push_did():
    s = ready_shard(mode="sync")
    for clock in range(3):  # each step: worker 0's buffer is kept as the sum, worker 1's completes it
        for w in range(2):
            with s.receive_buffer() as buf:
                buf.fill_(1.0)
                assert s.push(w, clock, clock, buf, "fp32").kept == (w == 0)
    with pytest.raises(ShardError), s.receive_buffer() as buf:  # a refused push gives its buffer back too
        s.push(0, 99, 3, buf, "fp32")
    pooled = []
    while not s._pools[torch.float32].empty():
        pooled.append(s._pools[torch.float32].get_nowait().data_ptr())
    assert len(pooled) == len(set(pooled)) and s._receiving == {}
    assert not {t.data_ptr() for t in s.policy.step.spares} & set(pooled), "a buffer both pooled and the policy's"
    quorum_of_one = ready_shard(mode="sync", backup_workers=1)
    with quorum_of_one.receive_buffer() as buf:  # the push that completes a step is never kept
        buf.fill_(1.0)
        out = quorum_of_one.push(0, 0, 0, buf, "fp32")
    assert out.applied and not out.kept


def test_a_checkpoint_from_an_older_optimizer_format_is_refused_before_anything_changes():
    s = assemble.shard(RunConfig(mode="sync", workers=2, servers=1, steps=10), 0)
    state = {"shard": 0, "mode": "sync", "workers": 2, "param": torch.zeros(4),
             "opt": {"state": {}, "param_groups": []}, "schedule": None}
    with pytest.raises(ValueError, match="older psgd"):
        s.restore(state)
    assert s.param is None
