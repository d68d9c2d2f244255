"""The production parameter server against the textbook one (psgd/core/textbook.py), in micrograd's
spirit: the small engine a student reads first, and the real one tested against it.

The same worker loop (`textbook.train`) drives both: the `TextbookShard`, and the production path
through an adapter with the textbook's pull/push, either the shard core in process (psgd/ps/shard.py:
policy, fused SGD, snapshots, copy on write) or a real shard server on 127.0.0.1 reached by psgd's
worker client over gRPC (psgd/ps/server.py, psgd/ps/client.py). What must agree:

- sync, 3 workers: the same parameters bit for bit (both sum a step's gradients in worker order,
  psgd/core/rules.py `step_sum`, whatever order they arrive in), in a fixed order and with the
  workers pushing in reverse;
- async with one worker, momentum 0.9: the same parameters bit for bit;
- SSP(1), 3 threads, one a straggler held back by an event schedule (no sleeps): on both, no pull
  is served more than s clocks ahead of the slowest and no gradient is staler than (N-1)(2s+1).

The model has 64 parameters (a multiple of every CPU vector width): the shard's fused SGD kernel
takes its vector loop for every element, which rounds exactly like torch.optim.SGD; its scalar
loop for a tail of n mod (vector width) elements may round the momentum update differently (FMA).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from psgd.core import textbook
from psgd.core.config import OptimConfig, RunConfig
from psgd.ps.client import make_client
from psgd.train import assemble
from tests.helpers import open_start_barrier

LR, MOMENTUM = 0.1, 0.9
loss_fn = torch.nn.functional.mse_loss


def model_and_batches(workers: int, steps: int, seed: int = 0):
    """A linear model 15 -> 4 (64 parameters) and fixed seeded batches of 8 per worker per step."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(15, 4)
    target = torch.randn(4, 15)
    xs = torch.randn(workers, steps, 8, 15)
    return model, [[(x, x @ target.T) for x in xs[w]] for w in range(workers)]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def config(mode: str, workers: int, steps: int, staleness: int = 0) -> RunConfig:
    return RunConfig(mode=mode, workers=workers, servers=1, steps=steps, staleness=staleness, device="cpu",
                     optim=OptimConfig(lr=LR, momentum=MOMENTUM))


class InProcess:
    """The production shard core (`Shard`) behind the textbook's pull/push."""

    def __init__(self, cfg: RunConfig, params: torch.Tensor) -> None:
        self.shard = assemble.shard(cfg, 0)
        self.shard.init(params.clone())
        self.policy = self.shard.policy

    def pull(self, worker: int, clock: int) -> tuple[int, torch.Tensor]:
        with self.shard.pull(worker, 0, clock, "fp32", timeout=30) as p:
            assert not p.done
            return p.version, p.values.clone()  # the values are lent: copy inside the `with`

    def push(self, worker: int, clock: int, base_version: int, grad: torch.Tensor) -> None:
        assert not self.shard.push(worker, clock, base_version, grad, "fp32").refused

    def open_barrier(self) -> None:
        open_start_barrier(self.shard)

    @property
    def params(self) -> torch.Tensor:
        return self.shard.param


class OverGrpc(InProcess):
    """A real shard server on 127.0.0.1 (a free port), each worker its own psgd client over gRPC."""

    def __init__(self, cfg: RunConfig, params: torch.Tensor, shard_servers) -> None:
        (self.server,) = shard_servers(cfg)   # the fixture stops it
        self.shard, self.policy = self.server.shard, self.server.shard.policy
        self.clients = [make_client("grpc", [f"127.0.0.1:{self.server.port}"], w, params.numel(), rpc_timeout=30)
                        for w in range(cfg.workers)]
        self.clients[0].wait_ready()
        self.clients[0].init(params.clone())  # the chief's Init, as in a run

    def pull(self, worker: int, clock: int) -> tuple[int, torch.Tensor]:
        out = torch.empty(self.shard.num_elements)
        r = self.clients[worker].pull(clock, out)
        assert not r.done
        return r.versions[0], out

    def push(self, worker: int, clock: int, base_version: int, grad: torch.Tensor) -> None:
        client = self.clients[worker]
        assert base_version == client.versions[0]  # the client tags a push with the version it pulled
        _, refused, _ = client.push(clock, grad)
        assert not refused

    def open_barrier(self) -> None:
        with ThreadPoolExecutor(len(self.clients)) as pool:  # every worker's clock-0 pull at once
            list(pool.map(lambda w: self.pull(w, 0), range(len(self.clients))))

    def close(self) -> None:
        for c in self.clients:
            c.close()


@pytest.fixture
def production(shard_servers):
    """Factory: ('in-process' | 'grpc', cfg, params) -> the production path; clients closed after."""
    made: list[OverGrpc] = []

    def make(kind: str, cfg: RunConfig, params: torch.Tensor) -> InProcess:
        if kind == "in-process":
            return InProcess(cfg, params)
        made.append(OverGrpc(cfg, params, shard_servers))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_the_textbook_update_is_torch_optim_sgd_bit_for_bit():
    torch.manual_seed(1)
    start, grads = torch.randn(37), [torch.randn(37) for _ in range(6)]  # 37: any length
    for momentum in (0.0, MOMENTUM):
        shard = textbook.TextbookShard(start, 1, "async", lr=LR, momentum=momentum)
        trusted = start.clone().requires_grad_(True)
        opt = torch.optim.SGD([trusted], lr=LR, momentum=momentum)
        for clock, g in enumerate(grads):
            shard.push(0, clock, clock, g)
            trusted.grad = g.clone()
            opt.step()
            assert torch.equal(shard.params, trusted.detach()), (momentum, clock)
        assert not torch.equal(shard.params, start) and shard.version == len(grads)


@pytest.mark.parametrize("kind", ["in-process", "grpc"])
def test_sync_three_workers_in_order_give_the_same_parameters_bit_for_bit(kind, production):
    n, steps = 3, 5
    model, batches = model_and_batches(n, steps)
    start = flat(model)
    book = textbook.train(textbook.TextbookShard(start, n, "sync", lr=LR, momentum=MOMENTUM), model, loss_fn,
                          batches, lockstep=True)
    prod = production(kind, config("sync", n, steps), start)
    prod.open_barrier()   # the production shard holds the clock-0 pulls until all N asked
    textbook.train(prod, model, loss_fn, batches, lockstep=True)
    assert book.version == prod.policy.version == steps  # one update per step, each the mean of 3
    assert torch.equal(book.params, prod.params)
    assert (book.params - start).abs().max() > 1e-2  # training moved them: the equality means something
    assert book.staleness == prod.policy.stats.staleness == {0: n * steps}


@pytest.mark.parametrize("kind", ["in-process", "grpc"])
def test_async_one_worker_gives_the_same_parameters_bit_for_bit(kind, production):
    steps = 8
    model, batches = model_and_batches(1, steps, seed=2)
    start = flat(model)
    book = textbook.train(textbook.TextbookShard(start, 1, "async", lr=LR, momentum=MOMENTUM), model, loss_fn,
                          batches)
    prod = textbook.train(production(kind, config("async", 1, steps), start), model, loss_fn, batches)
    assert book.version == prod.policy.version == steps
    assert torch.equal(book.params, prod.params)
    assert (book.params - start).abs().max() > 1e-2
    assert book.staleness == prod.policy.stats.staleness == {0: steps}  # alone: never stale


def straggler(shard, steps: int, lead: int):
    """Worker 0's schedule: before its push of clock c it waits, on the shard's own condition (every
    push notifies it), until every other worker has pushed clock min(c + lead, steps) - 1. With
    lead = s + 1 under SSP(s) the others get exactly s clocks ahead (their pull of c + s is allowed
    while worker 0 is at c, the next one is not): the bound is reached on every step, never passed."""
    def wait(worker: int, clock: int) -> None:
        if worker == 0:
            want = min(clock + lead, steps)
            with shard.cond:
                assert shard.cond.wait_for(lambda: min(shard.clocks[1:]) >= want, timeout=30), "schedule stuck"
    return wait


class Production(InProcess):
    """The in-process production shard, with the policy's condition and clocks, as the schedule needs."""

    @property
    def cond(self):
        return self.policy.cond

    @property
    def clocks(self) -> list[int]:
        return self.policy.clocks


def test_ssp_bounds_hold_on_the_textbook_and_the_production_shard():
    n, s, steps = 3, 1, 12
    model, batches = model_and_batches(n, steps, seed=3)
    start = flat(model)
    book = textbook.TextbookShard(start, n, "ssp", staleness=s, lr=LR, momentum=MOMENTUM)
    prod = Production(config("ssp", n, steps, staleness=s), start)
    for shard in (book, prod):
        textbook.train(shard, model, loss_fn, batches, straggle=straggler(shard, steps, lead=s + 1))
    stats = prod.policy.stats
    for name, gaps, stale, version in (("textbook", book.gaps, book.staleness, book.version),
                                       ("production", stats.gaps, stats.staleness, prod.policy.version)):
        assert version == n * steps and sum(stale.values()) == n * steps, name   # every gradient applied
        assert max(gaps) == s, f"{name}: clock gaps {dict(gaps)}"  # reached (the schedule), never passed
        assert max(stale) <= (n - 1) * (2 * s + 1), f"{name}: staleness {dict(stale)}"
        assert max(stale) > 0, name  # the straggler's gradients met the others' pushes
    assert stats.max_clock_gap == s


def test_without_the_bound_the_same_straggler_runs_the_others_ahead():
    # The checks above can fail: under async the same kind of schedule (one clock more of lead)
    # puts the fast workers s + 1 ahead, which SSP(s) would never serve.
    n, s, steps = 3, 1, 12
    model, batches = model_and_batches(n, steps, seed=3)
    book = textbook.TextbookShard(flat(model), n, "async", lr=LR, momentum=MOMENTUM)
    textbook.train(book, model, loss_fn, batches, straggle=straggler(book, steps, lead=s + 2))
    assert max(book.gaps) > s and book.version == n * steps


def test_textbook_refuses_a_wrong_clock_and_its_demo_runs(capsys):
    shard = textbook.TextbookShard(torch.zeros(4), 2, "sync")
    with pytest.raises(ValueError, match="clock 1"):
        shard.push(0, 1, 0, torch.ones(4))
    with pytest.raises(ValueError, match="next push is 0"):
        shard.pull(0, 3)
    with pytest.raises(ValueError, match="mode"):
        textbook.TextbookShard(torch.zeros(4), 2, "bogus")
    textbook.main()
    out = capsys.readouterr().out
    assert "sync: " in out and "async: " in out and "ssp(1): " in out and "max clock gap 0" in out


def test_sync_sums_in_worker_order_whatever_order_the_gradients_arrive_in():
    n, steps = 3, 4
    torch.manual_seed(4)
    start = torch.randn(64)
    grads = [[torch.randn(64) for _ in range(n)] for _ in range(steps)]
    ends = []
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        book = textbook.TextbookShard(start, n, "sync", lr=LR, momentum=MOMENTUM)
        prod = InProcess(config("sync", n, steps), start)
        prod.open_barrier()
        for shard in (book, prod):
            for clock in range(steps):
                for w in order:
                    version, _ = shard.pull(w, clock)
                    shard.push(w, clock, version, grads[clock][w])
        assert torch.equal(book.params, prod.params), order
        ends.append(book.params)
    assert all(torch.equal(ends[0], e) for e in ends)  # three arrival orders, one result
    assert not torch.equal(ends[0], start)


# A new mode with a parameter, as it would be written in psgd/core/rules.py: its class, registered by
# its own name. Nothing else is edited: that is the whole touch (1 file, 1 class).
PLUGGED_MODE = """
import dataclasses, typing
from psgd.core import rules

@rules.register
@dataclasses.dataclass(frozen=True)
class Strict:
    staleness: int = 1  # the run's --staleness, by name: SSP's bound counted with the reader itself
    name: typing.ClassVar[str] = "strict"
    on_arrival: typing.ClassVar[bool] = True
    help: typing.ClassVar[str] = ("SSP's bound with the reader counted: a worker --staleness steps ahead\\n"
                                  "of the slowest waits.")

    def may_read(self, version, clock, slowest):
        return clock - slowest < self.staleness
"""

# Everything that names modes, reached after the registration alone: -h's modes, the flags and
# validate, the run's budget, assemble's shard with its policy, and the textbook.
PLUGGED_MODE_CHECK = """
import argparse, sys
import torch
from psgd.core import config, textbook
from psgd.core.errors import ShardError
from psgd.train import assemble
from psgd.train.roles import MODES_HELP
from tests.helpers import open_start_barrier

assert "  strict     SSP's bound with the reader counted" in MODES_HELP and "             of the slowest" in MODES_HELP
parser = argparse.ArgumentParser()
config.add_flags(parser)
args = parser.parse_args(["--mode", "strict", "--staleness", "1", "--workers", "2", "--steps", "3", "--device", "cpu",
                          "--lr", "1", "--momentum", "0"])
cfg = config.validate(config.from_namespace(args))
assert cfg.mode in config.PS_MODES and config.updates(cfg) == 6, "on arrival: the budget counts gradients"
shard = assemble.shard(cfg, 0)
assert shard.policy.rule == Strict(staleness=1), shard.policy.rule
shard.init(torch.zeros(4))
open_start_barrier(shard)

def production(w, clock, push=None):
    if push is not None:
        return shard.push(w, clock, push, torch.ones(4), "fp32").applied
    try:
        with shard.pull(w, 0, clock, "fp32", timeout=0) as p:
            return p.version
    except ShardError as e:
        return "held" if "held" in str(e) else e

book = textbook.TextbookShard(torch.zeros(4), 2, "strict", staleness=1, lr=1.0, timeout=0)

def textbook_(w, clock, push=None):
    if push is not None:
        book.push(w, clock, push, torch.ones(4))
        return True
    try:
        return book.pull(w, clock)[0]
    except TimeoutError:
        return "held"

for side in (production, textbook_):
    seen = [side(0, 0), side(0, 0, push=0), side(0, 1), side(1, 0), side(1, 0, push=0), side(0, 1)]
    # worker 0 a clock ahead of the slowest is held (SSP(1) would serve it), served once worker 1 pushed
    assert seen == [0, True, "held", 1, True, 2], (side.__name__, seen)
assert torch.equal(shard.param, book.params) and book.params.tolist() == [-2.0] * 4
print("ok")
"""


def test_a_mode_with_a_parameter_is_one_class_registered_in_rules():
    """The plug-in test for a mode: touch count 1 (a class in psgd/core/rules.py and its
    `@register`). Run in a fresh interpreter where the class is registered before anything reads
    the registry, as it is when it is written in rules.py: -h, the --mode flag, validate, the budget,
    the production shard's policy and the textbook all take it, and its parameter (--staleness)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", PLUGGED_MODE + PLUGGED_MODE_CHECK], cwd=root, capture_output=True,
                       text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_a_buffering_rule_runs_in_syncs_policy_and_an_unknown_mode_is_refused():
    from psgd.core import rules
    from psgd.core.consistency import Sync, make_policy

    assert [n for n, r in rules.RULES.items() if not r.on_arrival] == ["sync"]
    assert isinstance(make_policy("sync", 2, lambda g: None), Sync)
    with pytest.raises(ValueError, match="unknown parameter-server mode 'lag'; choose one of sync, async, ssp"):
        rules.make("lag")
    with pytest.raises(AssertionError, match="registered already"):
        rules.register(rules.SSP)
