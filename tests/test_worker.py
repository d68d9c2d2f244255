"""The worker loop's start: the warm-up changes nothing, and the shards' start barrier keeps every
worker from training (and every gradient from being applied) until the last worker has arrived; a
failing loop still closes its exchange; its deferred metrics lines keep their order."""

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from psgd.core.config import DataConfig, ModelConfig, RunConfig
from psgd.core.step import StepReport
from psgd.train import assemble, data, models, worker
from psgd.train.metrics import Metrics, read_events

DATA = DataConfig(dataset="synthetic", num_samples=1000)
MODEL = ModelConfig(model="mlp", width=16)


def test_warm_up_leaves_parameters_gradients_and_rng_as_they_were():
    ds = data.load(DATA)
    model = models.build(MODEL, ds.input_dim, ds.num_classes, seed=1)
    flat = models.FlatParams(model)
    before, rng = flat.params.clone(), torch.get_rng_state()
    worker.warm_up(model, flat, ds.x_train[:8], ds.y_train[:8])
    assert torch.equal(flat.params, before)
    assert not flat.grads.any()
    assert torch.equal(torch.get_rng_state(), rng)
    F.cross_entropy(model(ds.x_train[:8]), ds.y_train[:8]).backward()
    assert flat.grads.any()  # gradients still land in the flat buffer


def test_no_gradient_is_applied_before_the_last_worker_reaches_the_start_barrier(shards):
    """Async (which never holds a pull by itself): two workers start, the third much later."""
    cfg = RunConfig(mode="async", workers=3, servers=2, steps=8, batch_size=8, seed=1, data=DATA, model=MODEL,
                    device="cpu")
    addresses, cores = shards(cfg)
    arrivals_at_apply: list[int] = []
    for s in cores:
        def observed(grad, policy=s.policy, apply=s.policy._apply):
            arrivals_at_apply.append(len(policy.roster.at_start))  # runs under the policy's lock
            apply(grad)
        s.policy._apply = observed

    ends, errors = {}, []

    def work(rank: int) -> None:
        try:
            ends[rank] = assemble.train_worker(cfg, rank, assemble.ps_exchange(cfg, addresses), None)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    early = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    for t in early:
        t.start()
    for s in cores:  # both early workers are held in their first pull, on every shard
        with s.policy.cond:
            assert s.policy.cond.wait_for(lambda p=s.policy: len(p.roster.at_start) == 2, timeout=60)
            assert s.policy.accepted == 0 and s.policy.version == 0 and not s.policy.roster.started
    assert not ends and not errors
    late = threading.Thread(target=work, args=(2,))
    late.start()
    for t in [*early, late]:
        t.join(120)
    assert not errors, errors
    assert all(s.policy.version == cfg.steps * cfg.workers for s in cores)
    assert arrivals_at_apply == [3] * (cfg.steps * cfg.workers * cfg.servers)
    # A worker counts a step when every shard took its gradient. In async mode the shards spend
    # their budgets independently, so the last pushes of a run may be taken by one shard and
    # refused by the other (counted by neither worker): never more than the budget, at most one
    # short per worker.
    counted = sum(e["steps"] for e in ends.values())
    assert cfg.steps * cfg.workers - cfg.workers <= counted <= cfg.steps * cfg.workers
    assert all(e["train_start"] <= e["train_end"] for e in ends.values())


def test_a_failing_loop_closes_the_exchange_quickly_and_reports_its_own_error():
    class Broken:
        closed: list[bool] = []

        def setup(self, flat, rank):
            pass

        def before_compute(self, clock, flat):
            return StepReport()

        def after_compute(self, clock, flat):
            raise RuntimeError("the network is gone")

        def close(self, failed=False):
            self.closed.append(failed)
            raise OSError("and so is the socket")

    ex = Broken()
    cfg = RunConfig(mode="sync", workers=1, steps=3, data=DataConfig(dataset="synthetic", num_samples=200),
                    device="cpu")
    with pytest.raises(RuntimeError, match="the network is gone") as err:
        assemble.train_worker(cfg, 0, ex, None)
    assert ex.closed == [True]  # once, told it failed (no waiting for peers)
    assert any("and so is the socket" in note for note in err.value.__notes__)

    class FullDisk(Metrics):
        def flush(self):
            raise OSError("no space left on device")

    ex.closed.clear()
    with pytest.raises(RuntimeError, match="the network is gone") as err:
        assemble.train_worker(cfg, 0, ex, FullDisk(Path("unused.jsonl")))
    assert ex.closed == [True], "a metrics line that cannot be written must not skip the close"
    assert any("no space left on device" in note for note in err.value.__notes__)


def test_jitter_draws_have_the_mean_asked_and_pareto_has_the_heavy_tail():
    import random

    from psgd.train.worker import jitter_draw

    assert jitter_draw(random.Random(0), 0.0, "pareto") == 0.0
    # The exponential draw is the one every run before --jitter-tail made (its runs keep their delays).
    assert jitter_draw(random.Random(3), 5.0) == random.Random(3).expovariate(1 / 5.0)
    r_exp, r_par = random.Random(1), random.Random(1)
    exp = [jitter_draw(r_exp, 5.0, "exp") for _ in range(20_000)]
    par = [jitter_draw(r_par, 5.0, "pareto") for _ in range(20_000)]
    assert min(par) >= 5.0 / 3  # Pareto's scale: a third of the mean at shape 1.5
    assert abs(sum(par) / len(par) - 5.0) < 0.5 and abs(sum(exp) / len(exp) - 5.0) < 0.25
    # The tail: the largest of 20,000 draws is about 20000^(2/3) / 3 = 245 means for Pareto 1.5 and
    # about ln(20000) = 10 means for the exponential.
    assert max(par) > 50 * 5.0 and max(exp) < 20 * 5.0


def test_a_deferred_metrics_line_is_written_in_order_by_whatever_comes_next(tmp_path):
    # The worker defers its step line and its exchange flushes it while the shards answer the
    # next push: nothing is lost or reordered, and the line keeps the time it was deferred at.
    m = Metrics(tmp_path / "metrics.jsonl")
    m.defer(event="step", clock=0, time=1.0)
    assert not (tmp_path / "metrics.jsonl").exists(), "deferred: not written yet"
    m.flush()
    m.flush()  # nothing pending: writes nothing
    m.defer(event="step", clock=1)
    m.defer(event="step", clock=2)  # writes clock 1 first
    m.write(event="worker_end")  # writes clock 2 first
    m.defer(event="step", clock=3)
    m.close()  # writes clock 3
    events = read_events(tmp_path / "metrics.jsonl")
    assert [(e["event"], e.get("clock")) for e in events] == [
        ("step", 0), ("step", 1), ("step", 2), ("worker_end", None), ("step", 3)]
    assert events[0]["time"] == 1.0 and all("time" in e for e in events)


def test_a_worker_stopped_by_sigterm_writes_its_deferred_line_and_dies_of_the_signal(tmp_path):
    # The launcher stops a run's workers with SIGTERM when a shard dies; the step a worker finished
    # must be on record (a restart's `reached` counts it), and the exit must still read as SIGTERM.
    script = (
        "import os, signal, sys\n"
        "from psgd.train.metrics import Metrics\n"
        "from psgd.train import work\n"
        "m = Metrics(sys.argv[1])\n"
        "m.defer(event='step', clock=5)\n"
        "signal.signal(signal.SIGTERM, lambda *_: work._die_written(m))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.exit(7)  # not reached: the handler dies of the signal\n")
    path = tmp_path / "metrics.jsonl"
    r = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM, r.stderr
    assert [(e["event"], e["clock"]) for e in read_events(path)] == [("step", 5)]


def test_the_next_batch_fetched_ahead_is_the_batch_that_step_would_gather():
    x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
    batches = worker.Batches(x, y, data.BatchPlan(y, 2, 4, seed=1), rank=1)
    ahead = worker.Ahead(batches, accumulate=2)
    alone = [(a.clone(), b.clone()) for a, b in batches.micro(5, 2)]
    ahead.next = 5
    ahead.fetch()  # while the shards answer step 4's push
    got = ahead.take(5)
    assert len(got) == 2
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, alone, strict=True))
    ahead.next = 6
    ahead.fetch()
    assert all(torch.equal(a, c) for (a, _), (c, _) in zip(ahead.take(7), batches.micro(7, 2), strict=True))
    assert all(torch.equal(a, c) for (a, _), (c, _) in zip(ahead.take(6), batches.micro(6, 2), strict=True))
