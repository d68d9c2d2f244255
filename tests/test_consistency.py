"""The pure policies, driven by real threads (no gRPC).

Every thread is started through the `threads` fixture (tests/threads.py): a pull that the policy
never releases, or an exception inside a thread, fails the test instead of passing it silently.
"""

import time

import pytest
import torch

from psgd.core.consistency import SSP, Async, PolicyError, PullTimeout, Sync, make_policy


class Param:
    """A stand-in shard: apply adds the gradient, so the result shows what was applied."""

    def __init__(self, n=3):
        self.value = torch.zeros(n)
        self.applied = []

    def apply(self, g):
        self.value += g
        self.applied.append(g.clone())


def test_sync_applies_the_mean_once_and_blocks_next_step(threads):
    p = Param()
    pol = Sync(3, p.apply)
    assert pol.pull(0, 0, lambda: 1).value == 1
    for w in range(2):
        out = pol.push(w, 0, 0, torch.full((3,), float(w + 1)))
        assert not out.applied and out.version == 0
    # Step 1 may not start: two of three gradients arrived.
    with pytest.raises(PullTimeout):
        pol.pull(0, 1, lambda: None, timeout=0.05)
    released = threads.start(pol.pull, 1, 1, lambda: p.value.clone(), name="pull w1 c1")
    out = pol.push(2, 0, 0, torch.full((3,), 6.0))
    threads.join()
    assert out.applied and out.version == 1
    assert len(p.applied) == 1 and torch.equal(p.applied[0], torch.full((3,), 3.0))
    assert torch.equal(released.result.value, torch.full((3,), 3.0))
    assert pol.stats.max_clock_gap == 0


def test_sync_refuses_duplicate_and_wrong_step():
    pol = Sync(2, Param().apply)
    pol.push(0, 0, 0, torch.ones(3))
    with pytest.raises(PolicyError):
        pol.push(0, 0, 0, torch.ones(3))       # same worker twice in a step
    with pytest.raises(PolicyError):
        pol.push(1, 1, 0, torch.ones(3))       # clock ahead of the shard
    with pytest.raises(PolicyError):
        pol.push(5, 0, 0, torch.ones(3))       # no such worker
    assert pol.version == 0 and pol.clocks == [1, 0]


def test_async_never_blocks_and_staleness_is_n_minus_1_round_robin():
    n, p = 4, Param()
    pol = Async(n, p.apply)
    stale = []
    for step in range(5):
        bases = [pol.pull(w, step, lambda: None).version for w in range(n)]   # everyone pulls...
        for w in range(n):                                                    # ...then pushes in turn
            stale.append(pol.push(w, step, bases[w], torch.ones(3)).staleness)
    assert stale[:n] == [0, 1, 2, 3] and sum(stale) / len(stale) == pytest.approx(1.5)
    # Steady state of a real async run: each worker pulls right after its own push.
    pol2, last = Async(n, Param().apply), []
    bases = [0] * n
    for step in range(20):
        for w in range(n):
            last.append(pol2.push(w, step, bases[w], torch.ones(3)).staleness)
            bases[w] = pol2.pull(w, step + 1, lambda: None).version
    assert last[-n:] == [n - 1] * n


def test_ssp_blocks_only_beyond_the_bound(threads):
    s = 2
    pol = SSP(2, Param().apply, staleness=s)
    for c in range(s + 1):          # worker 0 runs ahead alone: clocks 0..s are allowed
        pol.pull(0, c, lambda: None, timeout=1)
        pol.push(0, c, pol.version, torch.ones(3))
    with pytest.raises(PullTimeout):
        pol.pull(0, s + 1, lambda: None, timeout=0.05)   # s+1 ahead of worker 1 (clock 0)
    held = threads.start(pol.pull, 0, s + 1, lambda: "ok", name="pull w0 ahead")
    pol.push(1, 0, 0, torch.ones(3))                       # the slowest advances
    threads.join()
    assert held.result.value == "ok" and held.result.clock_gap == s
    assert pol.stats.max_clock_gap == s


def test_a_silent_worker_is_lost_after_its_lease_and_ssp_goes_on_without_it(threads):
    import time

    pol = SSP(3, Param().apply, staleness=0)
    for w in (0, 1):
        pol.pull(w, 0, lambda: None, timeout=1)
        pol.push(w, 0, 0, torch.ones(3))
    with pytest.raises(PullTimeout):
        pol.pull(0, 1, lambda: None, timeout=0)   # s = 0: worker 2 (clock 0) holds everyone back
    # Worker 0 waits at clock 1 (held by the policy: not silent); worker 1 and 2 say nothing.
    held = threads.start(pol.pull, 0, 1, lambda: "ok", name="pull w0 held by the silent worker")
    later = time.monotonic() + 11  # `now` is passed in: no test waits out a real lease
    while 0 not in pol.roster.held:       # the pull is parked in the policy (no sleep: the threads fixture times out)
        with pol.cond:
            pol.cond.wait(0.01)
    assert pol.expire(10, now=time.monotonic()) == []         # nobody silent for 10 s yet
    assert pol.expire(10, now=later) == [(1, 1), (2, 0)]      # worker 0 is held, not silent
    threads.join()
    assert held.result.value == "ok" and pol.stats.lost == {1: 1, 2: 0}
    with pytest.raises(PolicyError, match="worker 2 was declared lost at clock 0"):
        pol.push(2, 0, 0, torch.ones(3))
    pol.push(0, 1, 2, torch.ones(3))
    assert pol.pull(0, 2, lambda: "alone", timeout=0).value == "alone"  # the bound counts live workers
    assert Sync(2, Param().apply).expire(0, now=time.monotonic() + 99) == []  # sync needs everyone
    # Before any worker was heard from, all are starting up (importing torch): nobody is lost.
    assert SSP(2, Param().apply, staleness=0).expire(0, now=time.monotonic() + 99) == []


def test_ssp_bound_holds_under_concurrency(threads):
    n, s, steps = 4, 1, 30
    pol = SSP(n, Param().apply, staleness=s)

    def worker(w):
        for c in range(steps * (w + 1) // n + steps // 2):
            out = pol.pull(w, c, lambda: None)   # a pull never released: the join below fails
            if out.done:
                return
            pol.push(w, c, out.version, torch.ones(3))
        pol.close()  # the first worker to finish ends the run, as a spent budget does

    for w in range(n):
        threads.start(worker, w, name=f"worker {w}")
    threads.join()
    assert pol.stats.max_clock_gap <= s and pol.closed


def test_budget_ends_the_run_and_releases_blocked_pulls():
    pol = Sync(2, Param().apply, budget=4)
    for step in range(2):
        for w in range(2):
            out = pol.push(w, step, step, torch.ones(3))
    assert out.done and pol.version == 2
    assert pol.pull(0, 2, lambda: None).done
    refused = pol.push(0, 2, 2, torch.ones(3))
    assert refused.refused and refused.done and pol.version == 2


def test_skipped_gradient_counts_as_arrival_but_not_in_the_mean():
    p = Param()
    pol = Sync(2, p.apply)
    pol.push(0, 0, 0, None)
    out = pol.push(1, 0, 0, torch.full((3,), 4.0))
    assert out.applied and torch.equal(p.value, torch.full((3,), 4.0))
    assert pol.stats.skipped_nonfinite == 1


def _wait_arrivals(pol, n: int) -> None:
    with pol.cond:
        assert pol.cond.wait_for(lambda: len(pol.roster.at_start) == n, timeout=30)


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_start_barrier_holds_first_pulls_until_every_worker_asked(mode, threads):
    pol = make_policy(mode, 3, Param().apply, staleness=1, start_barrier=True)
    with pytest.raises(PullTimeout, match="start barrier: 1 of 3 workers arrived"):
        pol.pull(0, 0, lambda: None, timeout=0.05)   # worker 0 alone: held (its arrival counts)
    held = threads.start(pol.pull, 1, 0, lambda: 1, name="pull w1 c0")
    _wait_arrivals(pol, 2)
    assert held.is_alive() and not pol.roster.started
    assert pol.pull(2, 0, lambda: "last").value == "last"   # the last arrival opens the barrier...
    threads.join()
    assert held.result.value == 1 and pol.roster.started
    assert pol.pull(0, 0, lambda: "again").value == "again"  # ...for good
    assert pol.stats.max_clock_gap == 0 and pol.version == 0


def test_closing_releases_the_start_barrier(threads):
    pol = Async(2, Param().apply, start_barrier=True)
    held = threads.start(pol.pull, 0, 0, lambda: 0, name="pull w0 c0")
    _wait_arrivals(pol, 1)
    pol.close()
    threads.join()
    assert held.result.done and held.result.value is None


def test_without_the_start_barrier_a_single_worker_pulls():
    assert Async(3, Param().apply).pull(0, 0, lambda: "go").value == "go"


def test_make_policy_runs_a_rule_by_its_on_arrival():
    from psgd.core import rules
    from psgd.core.policy import Policy

    ssp = make_policy("ssp", 2, Param().apply, staleness=1)  # applied on arrival: the shared state machine
    assert type(ssp) is Policy and ssp.rule == rules.SSP(staleness=1)
    sync = make_policy("sync", 2, Param().apply, backup=1)  # buffering: Sync's step and quorum
    assert type(sync) is Sync and sync.rule == rules.Sync() and sync.quorum == 1
    with pytest.raises(ValueError, match="backup workers are a rule of sync"):
        make_policy("async", 2, Param().apply, backup=1)
    with pytest.raises(ValueError):
        make_policy("bogus", 2, Param().apply)
    with pytest.raises(ValueError):
        SSP(2, Param().apply, staleness=-1)


# -- departures: a worker that leaves before the budget is spent (psgd.connect's loops) ----------------
def test_sync_goes_on_without_a_departed_worker_and_still_ends_at_its_steps():
    applied = []
    p = make_policy("sync", 3, lambda g: applied.append(g.clone()), budget=5 * 3)
    g = lambda v: torch.full((2,), float(v))  # noqa: E731
    for w in range(3):
        p.push(w, 0, 0, g(w))
    p.push(2, 1, 1, g(10))
    p.depart(2)                         # it pushed for step 1: that gradient stays in the step
    p.push(0, 1, 1, g(1))
    assert p.version == 1, "step 1 still waits for worker 1"
    p.push(1, 1, 1, g(2))
    assert p.version == 2 and torch.allclose(applied[-1], g(13 / 3))
    p.push(0, 2, 2, g(1))
    p.push(1, 2, 2, g(3))
    assert p.version == 3 and torch.equal(applied[-1], g(2)), "from step 2 on: the mean of the two left"
    p.push(0, 3, 3, g(7))
    p.depart(1)                         # worker 0 waited for it: the departure completes the step
    assert p.version == 4 and torch.equal(applied[-1], g(7))
    p.push(0, 4, 4, g(7))
    assert (p.version, p.done) == (5, True), "the budget lost the departed workers' steps: 5 updates"
    with pytest.raises(PolicyError, match="left the run"):
        p.push(1, 3, 3, g(0))


def test_ssp_and_the_start_barrier_do_not_wait_for_a_departed_worker():
    p = make_policy("ssp", 2, lambda g: None, staleness=0, start_barrier=True)
    p.depart(1)                         # gone before it ever pulled
    assert p.pull(0, 0, lambda: "v0", timeout=5).value == "v0"
    for c in range(3):
        p.push(0, c, c, torch.zeros(1))
        assert p.pull(0, c + 1, lambda: "ok", timeout=5).value == "ok", "SSP(0) would hold it for worker 1"
    done = make_policy("sync", 2, lambda g: None, budget=2)
    done.push(0, 0, 0, torch.zeros(1))
    done.push(1, 0, 0, torch.zeros(1))
    done.depart(0)                      # at the end of a run: changes nothing
    assert done.stats.departed == {} and done.done


def test_sync_sums_in_worker_order_so_arrival_order_changes_no_bit():
    """Floating-point addition is not associative: with 3+ workers, arrival order would change the
    mean's last bits and two identical runs would end apart (issue 26). The policy sums in worker
    order, so every order of arrival gives the same update, bit for bit, kept buffers or copied."""
    import itertools

    g = [torch.randn(1000, generator=torch.Generator().manual_seed(w)) * 10 ** w for w in range(4)]
    want = (((g[0] + g[1]) + g[2]) + g[3]) / 4
    assert not torch.equal(want, (((g[3] + g[2]) + g[1]) + g[0]) / 4), "the data must be order-sensitive"
    for order in itertools.permutations(range(4)):
        for keep in (False, True):
            applied: list[torch.Tensor] = []
            p = make_policy("sync", 4, applied.append, budget=8)
            for w in order:
                p.push(w, 0, 0, g[w].clone(), keep=keep)
            assert torch.equal(applied[0], want), (order, keep)  # applied before any buffer is reused


def test_a_lost_sync_worker_shrinks_the_quorum_and_cannot_rejoin():
    applied = []
    p = make_policy("sync", 3, lambda x: applied.append(x.clone()), budget=4 * 3)
    g = lambda v: torch.full((2,), float(v))  # noqa: E731
    for w in range(3):
        p.push(w, 0, 0, g(w))
    p.push(0, 1, 1, g(3))
    p.push(2, 1, 1, g(5))
    now = time.monotonic()
    assert p.expire(60.0, now) == []                      # nobody silent that long
    p.roster.last_seen[1] = now - 100                            # worker 1 went silent after step 0 (it died)
    assert p.expire(60.0, now) == [(1, 1)]
    assert p.version == 2, "worker 1's loss completes step 1 from workers 0 and 2"
    assert torch.equal(applied[-1], g(4))
    with pytest.raises(PolicyError, match="declared lost"):
        p.pull(1, 1, lambda: None, timeout=1)
