"""Remedies for stale gradients (psgd/core/staleness.py, applied by psgd/ps/shard.py): the arithmetic
against a hand computation on a 4-element shard, bit-for-bit equality with plain async where there
is nothing to correct, both transports, and the refusals at the edge."""

from __future__ import annotations

import threading

import pytest
import torch

from psgd.core import staleness
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig
from psgd.core.errors import Code, ShardError
from psgd.ps.shard import Shard
from psgd.train import assemble
from tests.helpers import psgd_main, workers_in_threads

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

LR, LAM = 0.5, 0.25
W0 = [0.1, 1.0, -2.0, 3.0]   # 0.1 is not an fp16 number: an fp16 pull's w_then differs from w0


def pull_first(s: Shard, workers: int, dtype: str) -> None:
    """Every worker pulls clock 0 through the shard (the start barrier waits for all of them)."""
    def one(w: int) -> None:
        with s.pull(w, 0, 0, dtype, timeout=30) as p:
            assert p.version == 0
    ts = [threading.Thread(target=one, args=(w,)) for w in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts)


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_dc_term_and_the_one_over_tau_scale_match_a_hand_computation(wire):
    """Three workers pull version 0, then push in turn: staleness 0, 1 and 2. Plain SGD (no momentum)
    makes each step w -= lr * applied gradient, so the expected parameters follow by hand."""
    cfg = RunConfig(mode="async", workers=3, servers=1, steps=10, staleness_lr=True, dc_lambda=LAM,
                    wire_dtype=wire, optim=OptimConfig(lr=LR, momentum=0.0))
    s = assemble.shard(cfg, 0)
    s.init(torch.tensor(W0))
    pull_first(s, 3, wire)
    g = {1: [1.0, -2.0, 0.5, 4.0], 2: [0.5, 1.0, -1.0, 2.0], 0: [2.0, 1.0, 3.0, -0.5]}
    then = [float(torch.tensor(x).half()) if wire == "fp16" else x for x in W0]  # what the workers received
    w = list(W0)
    for tau, worker in enumerate([1, 2, 0]):
        applied = [(gi + LAM * gi * gi * (wi - ti)) / max(1, tau)
                   for gi, wi, ti in zip(g[worker], w, then, strict=True)]
        w = [wi - LR * ai for wi, ai in zip(w, applied, strict=True)]
        out = s.push(worker, 0, 0, torch.tensor(g[worker]), wire)
        assert out.staleness == tau and out.applied
        assert torch.allclose(s.param, torch.tensor(w), rtol=0, atol=1e-5), (tau, s.param, w)
    r = s.stats()["remedy"]
    assert r["gradients"] == 3 and r["step_scale_sum"] == pytest.approx(1 + 1 + 0.5)
    assert r["dc_relative_sum"] > 0
    # All three held version 0's one copy at once: one snapshot, not three.
    assert r["dc_then_peak_bytes"] == 4 * (2 if wire == "fp16" else 4)


def test_step_scale_and_the_effective_momentum():
    assert [staleness.step_scale(t) for t in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]
    # Mitliagkas et al.: without explicit momentum, N workers (mean staleness N - 1) give 1 - 1/N.
    for n in (1, 4, 8):
        assert staleness.effective_momentum(0.0, n - 1) == pytest.approx(staleness.implicit_momentum(n))
    assert staleness.effective_momentum(0.9, 0.0) == pytest.approx(0.9)
    assert staleness.effective_momentum(0.9, 3.0) == pytest.approx(1 - 1 / 13)


def test_dc_refuses_a_push_whose_parameters_it_never_served():
    cfg = RunConfig(mode="async", workers=2, servers=1, steps=10, dc_lambda=LAM)
    s = assemble.shard(cfg, 0)
    s.init(torch.tensor(W0))
    pull_first(s, 2, "fp32")
    s.push(0, 0, 0, torch.ones(4), "fp32")
    before = s.param.clone()
    # Worker 0 claims version 1, which it never pulled: there is no w_then to compensate with.
    with pytest.raises(ShardError, match="last pulled nothing") as err:
        s.push(0, 1, 1, torch.ones(4), "fp32")
    assert err.value.code is Code.FAILED_PRECONDITION
    assert torch.equal(s.param, before) and s.policy.clocks == [1, 0]   # refused: nothing changed


@pytest.mark.parametrize("skip", [True, False])
def test_a_compensated_gradient_that_overflows_is_skipped_or_refused(skip):
    cfg = RunConfig(mode="async", workers=2, servers=1, steps=10, dc_lambda=LAM, skip_nonfinite=skip,
                    optim=OptimConfig(lr=LR, momentum=0.0))
    s = assemble.shard(cfg, 0)
    s.init(torch.tensor(W0))
    pull_first(s, 2, "fp32")
    s.push(1, 0, 0, torch.full((4,), 1e30), "fp32")   # finite, but w_now is now ~1e30 from w_then
    before = s.param.clone()
    if skip:   # lambda g g (w_now - w_then) ~ 1e70: not an fp32 number
        assert s.push(0, 0, 0, torch.full((4,), 1e20), "fp32").skipped
        assert s.policy.stats.skipped_nonfinite == 1 and s.stats()["remedy"]["gradients"] == 1
    else:
        with pytest.raises(ShardError, match="compensated gradient of worker 0 is not finite"):
            s.push(0, 0, 0, torch.full((4,), 1e20), "fp32")
        assert s.policy.clocks == [0, 1]
    assert torch.equal(s.param, before)


TINY = dict(mode="async", servers=1, batch_size=8, steps=12, seed=1, device="cpu",
            data=DataConfig(dataset="synthetic", num_samples=400), model=ModelConfig(model="mlp", width=16))


def train(shards, **kw):
    """Train cfg.workers async workers as threads against in-process shards; (parameters, shards)."""
    cfg = RunConfig(**{**TINY, **kw})
    addresses, cores = shards(cfg)
    workers_in_threads(cfg, addresses)
    assert all(c.policy.version == cfg.budget for c in cores)   # async: every gradient is an update
    return torch.cat([c.param.detach().clone() for c in cores]), cores


def test_with_nothing_stale_the_remedies_are_plain_async_bit_for_bit(shards):
    """One worker: every gradient has staleness 0 (the scale is 1) and w_now == w_then (the DC term
    is 0), so the remedies must leave every update exactly as plain async makes it."""
    plain, _ = train(shards, workers=1)
    remedied, (core,) = train(shards, workers=1, staleness_lr=True, dc_lambda=LAM)
    assert torch.equal(plain, remedied)
    r = core.stats()["remedy"]
    assert r["gradients"] == 12 and r["step_scale_sum"] == 12.0 and r["dc_relative_sum"] == 0.0


@pytest.mark.parametrize("transport,wire", [("tcp", "fp32"), ("grpc", "fp16")])
def test_remedies_run_on_both_transports(shards, transport, wire):
    params, (core,) = train(shards, workers=2, staleness_lr=True, dc_lambda=LAM, transport=transport,
                            wire_dtype=wire, separate_pull=transport == "grpc")
    assert torch.isfinite(params).all()
    r = core.stats()["remedy"]
    assert r["gradients"] == 24   # every gradient went through the remedies
    assert 0 < r["dc_then_peak_bytes"] <= 2 * core.num_elements * (2 if wire == "fp16" else 4)


@pytest.mark.parametrize("args,message", [
    (["--mode", "async", "--dc-lambda", "-0.1"], "--dc-lambda must be >= 0, got -0.1"),
    (["--mode", "async", "--dc-lambda", "nan"], "--dc-lambda must be >= 0"),
    (["--mode", "sync", "--staleness-lr"], "--mode sync has no stale gradients"),
    (["--mode", "allreduce", "--dc-lambda", "0.5"], "--mode allreduce has no stale gradients"),
    (["--mode", "async", "--local-steps", "4", "--staleness-lr"], "--local-steps"),
])
def test_bad_remedy_settings_are_one_line_exit_2(args, message):
    r = psgd_main("run", *args)
    assert r.returncode == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

