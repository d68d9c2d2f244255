"""Reference tests, micrograd style: the policies checked by an independent observer, and a real
`psgd run` checked step for step against a plain torch loop.

The observer never uses a policy's own rule (`clock - min(clocks) <= s`). It looks only at what
each read returned: every gradient is a distinct one-hot vector naming its (worker, clock), the
apply callback adds it into a parameter vector, so a read shows exactly which gradients it
includes. SSP(s)'s promise, stated on the reads (Ho et al. 2013, "bounded staleness"): a worker
reading at clock c sees every gradient of clocks <= c - s - 1 from every worker, and its own.
Sync (BSP) promises exactly the gradients of clocks < c; Async promises only the worker's own.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig
from psgd.core.consistency import SSP, Async, PullTimeout, Sync
from psgd.train import evaluate, launch
from tests.test_equivalence import run_plain_torch_steps

WORKERS, CLOCKS = 3, 10


def one_hot(worker: int, clock: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.zeros(WORKERS * CLOCKS)
    g[worker * CLOCKS + clock] = scale
    return g


class Observer:
    """The parameter vector and every read of it: (worker, clock, the gradients the read included)."""

    def __init__(self) -> None:
        self.param = torch.zeros(WORKERS * CLOCKS)
        self.reads: list[tuple[int, int, frozenset[tuple[int, int]]]] = []

    def apply(self, grad: torch.Tensor) -> None:      # called by the policy under its lock
        self.param += grad

    def read(self, worker: int, clock: int):
        def copy() -> None:                              # called by the policy under its lock
            seen = (self.param > 0.5).nonzero().flatten().tolist()
            self.reads.append((worker, clock, frozenset(divmod(i, CLOCKS) for i in seen)))
        return copy

    def missing(self, must: callable) -> list[tuple[int, int, list]]:
        """Reads that lack a gradient they must include: must(reader, clock, w, c) -> bool."""
        bad = []
        for reader, clock, seen in self.reads:
            lacking = [(w, c) for w in range(WORKERS) for c in range(CLOCKS)
                       if must(reader, clock, w, c) and (w, c) not in seen]
            if lacking:
                bad.append((reader, clock, lacking))
        return bad


def ssp_must(s: int):
    """SSP(s) on reads: every worker's gradients of clocks <= c - s - 1, and the reader's own."""
    return lambda reader, clock, w, c: c <= clock - s - 1 or (w == reader and c < clock)


def own_must(reader, clock, w, c):
    return w == reader and c < clock


def check_complete(obs: Observer, pol) -> None:
    """Every worker read at every clock, and every gradient was applied exactly once."""
    assert sorted((w, c) for w, c, _ in obs.reads) == [(w, c) for w in range(WORKERS) for c in range(CLOCKS)]
    assert torch.equal(obs.param, torch.ones(WORKERS * CLOCKS)) and pol.clocks == [CLOCKS] * WORKERS


# -- worker threads at different speeds ---------------------------------------------------------

def threaded_run(pol, obs: Observer, threads, seed: int, scale: float = 1.0) -> None:
    """WORKERS threads pull, "compute", push for CLOCKS clocks. Worker w's compute is a seeded
    random amount of busy work times (1 + 3w): worker 2 is the slow one. No sleeps: the scheduler
    interleaves them (a short switch interval makes it do so often)."""
    def work(w: int) -> None:
        rng = random.Random(seed * 100 + w)
        for c in range(CLOCKS):
            out = pol.pull(w, c, obs.read(w, c))
            sum(range(rng.randrange(1, 2000) * (1 + 3 * w)))
            pol.push(w, c, out.version, one_hot(w, c, scale))

    for w in range(WORKERS):
        threads.start(work, w, name=f"worker {w}")
    threads.join()


@pytest.fixture
def short_switches():
    """Let the interpreter switch threads often, so the workers interleave finely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("s", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_ssp_reads_include_every_gradient_older_than_the_bound_threads(s, seed, threads, short_switches):
    obs = Observer()
    pol = SSP(WORKERS, obs.apply, staleness=s)
    threaded_run(pol, obs, threads, seed)
    assert obs.missing(ssp_must(s)) == []
    check_complete(obs, pol)


@pytest.mark.parametrize("seed", [0, 1])
def test_sync_reads_include_exactly_the_earlier_clocks_threads(seed, threads, short_switches):
    obs = Observer()
    pol = Sync(WORKERS, obs.apply)
    threaded_run(pol, obs, threads, seed, scale=WORKERS)   # Sync applies the mean: N x one-hot / N
    assert obs.missing(ssp_must(0)) == []
    assert all(seen == {(w, c) for w in range(WORKERS) for c in range(clock)} for _, clock, seen in obs.reads)
    check_complete(obs, pol)


# -- seeded schedules, one step at a time ---------------------------------------------------------

def scheduled_run(pol, obs: Observer, seed: int, speeds=(4, 2, 1)) -> int:
    """Drive the workers one action at a time in a seeded random order, worker w picked with weight
    speeds[w]. A pull is tried without waiting (timeout 0): held, the worker is not picked again
    until some push changed the state. Returns how many pulls the policy held; fails on a deadlock
    (every unfinished worker held)."""
    rng = random.Random(seed)
    clock, pulled = [0] * WORKERS, [None] * WORKERS
    held: set[int] = set()
    holds = 0
    while True:
        ready = [w for w in range(WORKERS) if clock[w] < CLOCKS and w not in held]
        if not ready:
            assert all(c == CLOCKS for c in clock), f"deadlock: every unfinished worker held at clocks {clock}"
            return holds
        w = rng.choices(ready, weights=[speeds[r] for r in ready])[0]
        if pulled[w] is None:
            try:
                pulled[w] = pol.pull(w, clock[w], obs.read(w, clock[w]), timeout=0).version
            except PullTimeout:
                held.add(w)
                holds += 1
        else:
            pol.push(w, clock[w], pulled[w], one_hot(w, clock[w]))
            clock[w], pulled[w] = clock[w] + 1, None
            held.clear()


@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_reads_include_every_gradient_older_than_the_bound_scheduled(s):
    holds = 0
    for seed in range(20):
        obs = Observer()
        pol = SSP(WORKERS, obs.apply, staleness=s)
        holds += scheduled_run(pol, obs, seed)
        assert obs.missing(ssp_must(s)) == [], f"seed {seed}"
        check_complete(obs, pol)
    assert holds > 0   # the schedules did run into the bound (the check was not vacuous)


def test_async_reads_may_miss_old_gradients():
    """Unbounded: worker 0 runs 4 clocks ahead while worker 1 has pushed nothing."""
    obs = Observer()
    pol = Async(WORKERS, obs.apply)
    for c in range(4):
        pol.push(0, c, pol.pull(0, c, obs.read(0, c)).version, one_hot(0, c))
    pol.pull(0, 4, obs.read(0, 4))
    # Read at clock 4 without worker 1's or 2's clock 0: what SSP(s) forbids for any s <= 3...
    assert obs.missing(ssp_must(3)) == [(0, 4, [(1, 0), (2, 0)])]
    assert obs.missing(own_must) == []   # ...while a worker always sees its own gradients
    # and seeded schedules at different speeds violate small bounds too, and never deadlock.
    violated = 0
    for seed in range(5):
        obs = Observer()
        pol = Async(WORKERS, obs.apply)
        assert scheduled_run(pol, obs, seed) == 0   # never held
        violated += bool(obs.missing(ssp_must(1)))
        assert obs.missing(own_must) == []
        check_complete(obs, pol)
    assert violated


# -- async with one worker is plain SGD, step for step ---------------------------------------------

STEPS = 8
OPTIM = OptimConfig(lr=0.1, momentum=0.9)


@pytest.mark.usefixtures("warm_runs")  # the run forks from the tests' warm parent
def test_async_one_worker_equals_torch_sgd_step_for_step(tmp_path):
    """`psgd run --mode async --workers 1 --servers 2 --eval-every 1` (real processes): the shards'
    snapshot after every update equals torch.optim.SGD's parameters after the same number of steps."""
    data, model = DataConfig(dataset="synthetic", num_samples=400), ModelConfig(model="mlp", width=16)
    cfg = RunConfig(mode="async", workers=1, servers=2, batch_size=16, steps=STEPS, seed=5, eval_every=1,
                    optim=OPTIM, data=data, model=model, device="cpu", out=str(tmp_path / "async1"))
    launch.run(cfg)
    snaps = evaluate.load_shard_snapshots(tmp_path / "async1", 2)
    assert [v for v, _, _ in snaps] == list(range(STEPS + 1))
    reference = run_plain_torch_steps(data, model, OPTIM, batch=16, steps=STEPS, seed=5)
    assert len(reference) == STEPS + 1
    for (version, _, params), expected in zip(snaps, reference, strict=True):
        assert (params - expected).abs().max() < 1e-5, f"update {version}"
    assert (reference[-1] - reference[0]).abs().max() > 1e-2   # it did train
