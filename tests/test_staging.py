"""Host staging (psgd/ps/staging.py) on the CPU: no copy for a CPU model; forced on, one allocation reused by
every pull and push, and the same weights as without it (plain and --overlap). Pinning and streams: test_gpu.py."""

from __future__ import annotations

import torch

from psgd.core.config import RunConfig
from psgd.ps.client import PSClient
from psgd.ps.exchange import PSExchange
from psgd.ps.staging import HostStaging
from psgd.train import assemble
from tests.test_overlap import DATA, MODEL, OPTIM

STEPS = 6


def test_a_cpu_model_is_not_staged():
    params, grads = torch.randn(10), torch.randn(10)
    s = HostStaging(params, grads)
    assert not s.staged and not s.pinned and s.params is params and s.grads is grads
    assert s.host_params() is params and s.host_copy(grads) is grads
    s.to_device().wait()
    s.to_host(2, 5).wait()
    assert torch.equal(s.params, params)


def test_forced_staging_copies_the_asked_ranges_through_its_own_buffers():
    params, grads = torch.zeros(10), torch.arange(10.0)
    s = HostStaging(params, grads, stage=True)
    assert s.staged and not s.pinned  # pinned only on a CUDA model
    buffers = (s.params.data_ptr(), s.grads.data_ptr())
    assert s.params.data_ptr() != params.data_ptr() and s.grads.data_ptr() != grads.data_ptr()
    s.host_params()[:] = torch.arange(10.0) + 100
    s.to_device(2, 5).wait()
    assert params.tolist() == [0, 0, 102, 103, 104, 0, 0, 0, 0, 0]  # that range only
    s.to_host(7, 9).wait()
    assert s.grads[7:9].tolist() == [7, 8]
    delta = torch.full((10,), -1.0)
    assert s.host_copy(delta) is s.grads and s.grads.tolist() == [-1.0] * 10
    assert (s.params.data_ptr(), s.grads.data_ptr()) == buffers


def _train_one(shards, stage: bool | None, overlap: bool, monkeypatch) -> tuple[torch.Tensor, set, PSExchange]:
    """One sync worker over 3 in-process shards (one worker: the shards' sums have one order, so runs
    compare bit for bit); returns the shards' parameters, the storages pulls and pushes used, the exchange."""
    cfg = RunConfig(mode="sync", workers=1, servers=3, batch_size=16, steps=STEPS, seed=3, optim=OPTIM, data=DATA,
                    model=MODEL, device="cpu", overlap=overlap)
    addresses, cores = shards(cfg)
    seen: set[tuple[str, int]] = set()

    def spy(name: str, tensor_arg: int):
        original = getattr(PSClient, name)

        def call(self, *args, **kw):
            seen.add((name, args[tensor_arg].data_ptr()))
            return original(self, *args, **kw)
        monkeypatch.setattr(PSClient, name, call)

    spy("pull", 1)              # pull(clock, out)
    spy("start_pull", 1)        # start_pull(clock, out): --overlap
    spy("push_pull", 1)         # push_pull(clock, grad, out): the grad
    spy("start_push", 2)        # start_push(k, clock, grad): --overlap
    exchange = PSExchange(addresses, stage=stage, overlap=overlap)
    assemble.train_worker(cfg, 0, exchange, None)
    monkeypatch.undo()
    assert all(c.policy.version == STEPS for c in cores)
    return torch.cat([c.param.detach().clone() for c in cores]), seen, exchange


def test_staged_training_reuses_one_allocation_and_equals_unstaged(shards, monkeypatch):
    plain, seen_plain, _ = _train_one(shards, None, False, monkeypatch)
    staged, seen, ex = _train_one(shards, True, False, monkeypatch)
    assert torch.equal(staged, plain)
    # Every pull landed in, every push left from, the one staging buffer allocated at setup.
    assert seen == {("pull", ex.staging.params.data_ptr()), ("push_pull", ex.staging.grads.data_ptr())}
    # Unstaged (a CPU model), the wire reads and writes the model's own flat buffers: no other storage.
    assert {name for name, _ in seen_plain} == {"pull", "push_pull"} and len(seen_plain) == 2


def test_staged_overlap_pushes_each_shard_after_its_copy_and_equals_unstaged(shards, monkeypatch):
    plain, _, _ = _train_one(shards, None, False, monkeypatch)
    overlapped, seen, ex = _train_one(shards, True, True, monkeypatch)
    assert torch.equal(overlapped, plain)
    assert seen == {("start_pull", ex.staging.params.data_ptr()), ("start_push", ex.staging.grads.data_ptr())}
