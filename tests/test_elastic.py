"""Elastic membership: schedules (psgd/core/elastic.py), the policies' admit / depart at step
boundaries (psgd/core/consistency.py), the shard's Join (psgd/ps/shard.py) and its checkpoints."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from psgd.core import elastic
from psgd.core.config import DataConfig, RunConfig, validate
from psgd.core.consistency import SSP, Async, PolicyError, Sync
from psgd.core.errors import ExchangeError, ShardError
from psgd.ps.shard import Shard, ShardOptions


def test_schedule_plan_grows_with_new_slots_and_shrinks_the_newest():
    slots = elastic.plan(elastic.parse("0:2,100:4,200:3"))
    assert [(s.rank, s.join, s.leave) for s in slots] == [(0, 0, None), (1, 0, None), (2, 100, None), (3, 100, 200)]
    back = elastic.plan(elastic.parse("0:4, 100:2, 200:4"))
    assert len(back) == 6 and [s.leave for s in back[:4]] == [None, None, 100, 100]
    assert [(s.join, s.leave) for s in back[4:]] == [(200, None), (200, None)]
    assert elastic.members_at(back, 150) == [0, 1] and elastic.members_at(back, 200) == [0, 1, 4, 5]


@pytest.mark.parametrize("spec, words", [("1:2", "start at update 0"), ("0:2,50:3,50:4", "increase"),
                                         ("0:2,10:0", "at least one"), ("0:2,x", "UPDATE:WORKERS")])
def test_bad_schedules_say_what_is_wrong(spec, words):
    with pytest.raises(ValueError, match=words):
        elastic.parse(spec)


def test_config_takes_the_slots_from_the_schedule_and_refuses_what_does_not_compose():
    cfg = validate(RunConfig(mode="sync", elastic="0:2,100:4,200:3"))
    assert (cfg.workers, cfg.members, cfg.slots) == (4, 2, 4)
    with pytest.raises(ValueError, match="all-reduce group is fixed"):
        validate(RunConfig(mode="allreduce", elastic="0:2,10:3"))
    with pytest.raises(ValueError, match="backup-workers"):
        validate(RunConfig(mode="sync", elastic="0:2,10:3", backup_workers=1))
    with pytest.raises(ValueError, match="start at update 0"):
        validate(RunConfig(mode="sync", elastic="5:2"))
    assert validate(RunConfig(mode="sync", elastic="0:2,10:3", restart_workers=1)).restart_workers == 1


class Applied:
    """The policy's apply callback: records each update's mean gradient."""

    def __init__(self) -> None:
        self.updates: list[torch.Tensor] = []

    def __call__(self, g: torch.Tensor) -> None:
        self.updates.append(g.clone())


def step(p, workers, clock, value_of=lambda w: float(w + 1)):
    for w in workers:
        p.push(w, clock, clock, torch.full((2,), value_of(w)))


def test_sync_grows_and_shrinks_at_step_boundaries_and_logs_them():
    applied = Applied()
    p = Sync(4, applied, budget=3 * 2, members=2)   # 3 steps of 2 workers to start with
    assert p.admit(2, 1) == (2, 1)                 # worker 2's first step is step 1
    with pytest.raises(PolicyError, match="in the run already"):
        p.admit(2, 1)
    step(p, [0, 1], 0)
    assert p.version == 1 and applied.updates[0].tolist() == [1.5, 1.5]
    step(p, [0, 1], 1)
    assert p.version == 1, "step 1 waits for the joiner's gradient"
    step(p, [2], 1)
    assert p.version == 2 and applied.updates[1].tolist() == [2.0, 2.0]  # (1 + 2 + 3) / 3
    p.depart(2)                                   # leaves before step 2: the quorum is 2 again
    step(p, [0, 1], 2)
    assert p.version == 3 and p.done and applied.updates[2].tolist() == [1.5, 1.5]
    assert [(e["update"], e["worker"], e["event"]) for e in p.stats.membership] == [(1, 2, "joined"), (2, 2, "left")]


def test_sync_refuses_a_join_at_a_step_already_applied_and_a_full_or_finished_run():
    p = Sync(2, Applied(), budget=2, members=1)
    step(p, [0], 0)
    with pytest.raises(PolicyError, match="applied already"):
        p.admit(1, 0)
    assert p.roster.absent == {1}, "a refused join changes nothing"
    assert p.admit(None, 1) == (1, 1)             # the lowest free slot, picked and taken at once
    with pytest.raises(PolicyError, match="full"):
        p.admit(None, None)
    step(p, [0, 1], 1)
    assert p.done
    with pytest.raises(PolicyError, match="finished"):
        Sync(1, Applied(), budget=0).admit(0, 0)


def test_a_cancelled_join_frees_its_slot_and_budget_and_a_begun_one_cannot_be_cancelled():
    p = Sync(3, Applied(), budget=10 * 2, members=2)
    assert p.admit(None, None) == (2, 2)          # dynamic: two steps on
    assert p.budget == 20 + 8
    p.cancel(2)
    assert p.roster.absent == {2} and p.budget == 20 and p._future == {}
    assert p.admit(None, 0) == (2, 0)             # the current step: in its quorum at once
    with pytest.raises(PolicyError, match="has begun"):
        p.cancel(2)
    a = Async(2, Applied(), budget=10, members=1)
    a.admit(1, 5)
    a.cancel(1)
    assert a.roster.absent == {1} and a.roster.pending == {}


def test_a_joiner_that_dies_before_its_first_pull_is_lost_not_kept_for_ever():
    p = Async(2, Applied(), budget=10, members=1)
    p.pull(0, 0, lambda: None)                    # the run has started
    p.admit(1, 0)
    t = p.roster.last_seen[1]
    assert p.expire(5.0, now=t + 1.0) == []       # its lease counts from the admission
    p.roster.last_seen[0] = t + 5.5                      # worker 0 was heard from just now (a test's clock)
    assert p.expire(5.0, now=t + 6.0) == [(1, 0)] and 1 in p.stats.lost and p.roster.pending == {}


def test_ssp_joiner_starts_at_the_slowest_clock_and_stalls_nobody():
    p = SSP(3, Applied(), staleness=1, budget=100, members=2)
    for c in range(5):
        for w in (0, 1):
            p.pull(w, c, lambda: None)
            p.push(w, c, p.version, torch.ones(2))
    assert p.admit(2, 0) == (2, 0)
    out = p.pull(2, 0, lambda: "w")              # served at once: its clock counts from the slowest (5)
    assert out.value == "w" and out.clock_gap == 0 and p.roster.offset[2] == 5
    # Workers 0 and 1 at clock 5 are not held back by the newcomer (which is at 5 too).
    assert p.pull(0, 5, lambda: 1).value == 1
    p.push(0, 5, p.version, torch.ones(2))
    p.push(2, 0, p.version, torch.ones(2))
    assert p.pull(0, 6, lambda: 2).value == 2, "0 is 1 ahead of the slowest (1 and 2 at 5 / 6): allowed"
    assert p.stats.membership[-1]["event"] == "joined" and p.stats.membership[-1]["clock"] == 5


def test_async_joiner_scheduled_later_is_held_until_that_update():
    p = Async(2, Applied(), budget=100, members=1)
    p.admit(1, 3)                                # scheduled: from update 3
    got: list = []
    t = threading.Thread(target=lambda: got.append(p.pull(1, 0, lambda: "v", timeout=30)))
    t.start()
    for c in range(3):
        p.pull(0, c, lambda: None)
        with p.cond:
            assert not got, "held until the shard reaches update 3"
        p.push(0, c, p.version, torch.ones(2))
    t.join(30)
    assert got and got[0].value == "v" and got[0].version == 3


def test_a_policy_says_which_update_an_admitted_joiner_waits_for_until_it_is_served():
    p = Async(2, Applied(), budget=100, members=1)
    assert p.admission(1) is None                # absent, not admitted
    p.admit(1, 2)
    assert p.admission(1) == 2 and p.admission(0) is None
    for c in range(2):
        p.pull(0, c, lambda: None)
        p.push(0, c, p.version, torch.ones(2))
    p.pull(1, 0, lambda: None, timeout=30)       # served: in the run
    assert p.admission(1) is None
    q = Sync(3, Applied(), budget=100, members=2)
    q.admit(2, 1)
    assert q.admission(2) == 1
    step(q, [0, 1], 0)                           # update 1 applied: its step begins
    assert q.admission(2) is None


def test_a_shard_holds_a_joiners_first_pull_half_the_deadline_then_says_ask_again():
    # A scheduled joiner may wait for its admission far longer than any deadline: each hold ends
    # before the worker's own deadline, with a status it asks again on (PSClient.wait_admitted).
    s = shard_of(Async(2, Applied(), budget=100, members=1))
    s.policy.admit(1, 5)
    asked_again = "worker 1 is admitted from update 5 and async is at version 0: ask again"
    with pytest.raises(ShardError, match=asked_again) as e:
        with s.pull(1, 0, 0, "fp32", timeout=0.2):
            pass
    assert e.value.code.name == "DEADLINE_EXCEEDED"
    assert s.policy.admission(1) == 5            # the state as it was: still waiting for update 5
    other = shard_of(Sync(2, Applied(), budget=100, members=2))
    with other.pull(0, 0, 0, "fp32", timeout=0.2):
        pass
    other.push(0, 0, 0, torch.ones(4), "fp32")
    with pytest.raises(ShardError, match="worker 0 at clock 1 held .* by sync") as e:  # waits for worker 1's push:
        with other.pull(0, 0, 1, "fp32", timeout=0.2):                                 # the usual refusal
            pass
    assert "ask again" not in str(e.value)


def shard_of(policy, n=4):
    s = Shard(0, policy, lambda param: _Sgd(param), ShardOptions(mode=policy.name))
    s.init(torch.zeros(n))
    return s


class _Sgd:
    def __init__(self, param):
        self.param = param

    def step(self):
        self.param.data.sub_(self.param.grad)

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


def test_shard_join_picks_a_slot_and_a_safe_step_and_refuses_bad_joins():
    s = shard_of(Sync(3, Applied(), budget=10 * 2, members=2))
    assert s.join(None, None, 4) == (2, 2, 0)    # two steps past version 0: no shard can have reached it
    with pytest.raises(ShardError, match="full"):
        s.join(None, None, 4)
    other = shard_of(Sync(3, Applied(), budget=4, members=2))
    with pytest.raises(ShardError, match="another model"):
        other.join(None, None, 5)
    assert other.policy.roster.absent == {2}


def test_membership_survives_a_checkpoint():
    p = Sync(3, Applied(), budget=4 * 2, members=2)
    p.admit(2, 2)
    s = shard_of(p)
    for w in (0, 1):
        s.push(w, 0, 0, torch.ones(4), "fp32")
    state = s.state()
    back = shard_of(Sync(3, Applied(), budget=4 * 2, members=2))
    back.restore(state)
    q = back.policy
    assert (q.quorum, q._future, sorted(q.roster.absent)) == (2, {2: 2}, [])
    assert q.budget == p.budget == 4 * 2 + 2


def _threads(jobs):
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(fn,)) for fn in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors


def test_psgd_worker_join_takes_a_slot_two_steps_on_and_bad_joins_are_refused(shards):
    """A sync job of 2 workers with a third slot: a worker that joins (the CLI's own --join path)
    before the first step trains from step 2, and the shards log it; then a full job, another
    model, another mode and a finished job each refuse with one line and change nothing."""
    from psgd import cli
    from psgd.core.errors import UsageError
    from psgd.ps.client import make_client
    from psgd.train import assemble, models

    cfg = RunConfig(mode="sync", workers=2, max_workers=3, servers=2, steps=6, batch_size=8, transport="grpc",
                    data=DataConfig(dataset="synthetic", num_samples=600))
    addresses, cores = shards(cfg)
    model = assemble.worker_parts(cfg, 0, "cpu").model
    flat = models.FlatParams(model).params
    client = make_client("grpc", addresses, 0, flat.numel())
    client.init(flat)  # the first Init (every worker offers the same seeded values)
    client.transport.close()
    where = ",".join(addresses)
    joined, _, rank = cli._join(dataclasses.replace(cfg, workers=1, max_workers=0), where)
    assert rank == 2 and joined.workers == 3 and [c.policy.clocks[2] for c in cores] == [2, 2]
    with pytest.raises(UsageError, match="full: all 3 worker slots"):
        cli._join(cfg, where)
    with pytest.raises(UsageError, match="another model"):
        cli._join(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, width=7)), where)
    with pytest.raises(UsageError, match="is --mode sync, this worker says --mode async"):
        cli._join(dataclasses.replace(cfg, mode="async"), where)
    _threads([lambda r=r: assemble.train_worker(cfg, r, assemble.ps_exchange(cfg, addresses), None)
              for r in (0, 1)] + [lambda: assemble.train_worker(joined, 2, assemble.ps_exchange(joined, addresses))])
    for c in cores:
        assert c.policy.version == 6 and c.policy.clocks == [6, 6, 6]
        assert [(e["update"], e["worker"], e["event"]) for e in c.policy.stats.membership] == [(2, 2, "joined")]
    with pytest.raises(UsageError, match="finished"):
        cli._join(cfg, where)


def test_api_connect_join_adds_a_worker_to_running_shards_before_any_init():
    """psgd.start_shards with a spare slot; one worker connects, one joins (before any Init: the
    joiner's own Init is the first); both train in their own loops and the job ends."""
    import torch.nn.functional as F  # noqa: N812

    import psgd

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)

    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with psgd.start_shards(servers=2, workers=1, max_workers=2, mode="async", steps=5,
                           optimizer=psgd.SGD(lr=0.1), transport="grpc") as shards:
        joined = psgd.connect(model(), shards.addresses, join=True, transport="grpc")
        first = psgd.connect(model(), shards.addresses, rank=0, workers=2, transport="grpc")
        assert joined.rank == 1

        def loop(w):
            with w:
                while w.pull():
                    F.cross_entropy(w.model(x), y).backward()
                    w.push()
        _threads([lambda: loop(joined), lambda: loop(first)])
        assert shards.wait(30)
        log = shards.stats()[0]["membership"]
        assert [(e["worker"], e["event"]) for e in log] == [(1, "joined")]


def test_quorum_lr_scales_a_step_with_its_quorum():
    applied = Applied()
    p = Sync(3, applied, budget=2 * 2, members=2)
    p.quorum_lr = True
    p.admit(2, 1)
    step(p, [0, 1], 0)
    step(p, [0, 1, 2], 1)
    assert [u.tolist() for u in applied.updates] == [[1.5, 1.5], [3.0, 3.0]]  # (1+2)/2, (1+2+3)/2


@pytest.mark.usefixtures("warm_runs")
def test_psgd_run_elastic_grows_and_shrinks_and_records_who_trained_what(tmp_path):
    from tests.helpers import psgd_main, summary

    out = tmp_path / "elastic"
    r = psgd_main("run", "--mode", "sync", "--elastic", "0:2,20:4,40:3", "--servers", "2", "--model", "mlp",
                  "--dataset", "synthetic", "--num-samples", "800", "--batch-size", "8", "--steps", "60",
                  "--eval-every", "0", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["per_worker_steps"] == {"0": 60, "1": 60, "2": 40, "3": 20}
    assert s["samples_per_worker"]["3"] == 20 * 8
    m = s["membership"]
    assert (m["slots"], m["at_start"]) == (4, 2)
    assert [(c["update"], c["worker"], c["event"]) for c in m["changes"]] == [
        (20, 2, "joined"), (20, 3, "joined"), (40, 3, "left")]
    assert [seg["workers"] for seg in m["segments"]] == [2, 4, 3]
    assert all(j["first_step_s"] is not None and j["first_step_s"] >= 0 for j in m["joiners"])
    # Issue 54, item 20: a scheduled joiner killed at its first step (update 20: its --fail-at 3=5
    # comes before it joined, which fired never before) is restarted (--restart-workers), rejoins at
    # its clock, leaves on schedule, and the run ends with the same parameters and steps.
    again = tmp_path / "restarted"
    r = psgd_main("run", "--mode", "sync", "--elastic", "0:2,20:4,40:3", "--servers", "2", "--model", "mlp",
                  "--dataset", "synthetic", "--num-samples", "800", "--batch-size", "8", "--steps", "60",
                  "--eval-every", "0", "--fail-at", "3=5", "--restart-workers", "1", "--out", str(again), "--quiet")
    assert r.returncode == 0, r.stderr
    t = summary(again)
    assert t["restarted_workers"] == [{"worker": 3, "how": "signal SIGKILL"}]
    assert t["params_sha256"] == s["params_sha256"] and t["per_worker_steps"] == s["per_worker_steps"]


@pytest.mark.usefixtures("warm_runs")
def test_a_scheduled_join_later_than_the_rpc_deadline_waits_for_it(tmp_path):
    """Worker 2 joins at update 150; worker 0 sleeps 10 ms a step (an emulated slow device), so the
    join comes at least 1.5 s into the run, past the 0.5 s deadline of every request: the joiner
    asks again on every hold (before, its first pull failed with DEADLINE_EXCEEDED and so did the run)."""
    from tests.helpers import psgd_main, summary

    out = tmp_path / "late"
    r = psgd_main("run", "--mode", "sync", "--elastic", "0:2,150:3", "--rpc-timeout", "0.5", "--straggler", "0=10",
                  "--model", "mlp", "--dataset", "synthetic", "--num-samples", "800", "--batch-size", "8",
                  "--steps", "200", "--eval-every", "0", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["per_worker_steps"] == {"0": 200, "1": 200, "2": 50}
    assert [(c["update"], c["worker"], c["event"]) for c in s["membership"]["changes"]] == [(150, 2, "joined")]


class _Refusing:
    """A transport whose shard refuses one pull for each of `versions` with `code` (DEADLINE_EXCEEDED:
    an admission still to come), its Info saying that version meanwhile, then serves one."""

    addresses = ["127.0.0.1:1"]

    def __init__(self, versions: list[int], code: str = "DEADLINE_EXCEEDED") -> None:
        self.versions, self.code, self.asked = list(versions), code, 0

    def pull(self, shards, request, out_of, events):
        self.asked += 1
        if self.asked <= len(self.versions):
            raise ExchangeError(f"pull from shard 0: {self.code}: ask again", self.code)
        return [(SimpleNamespace(done=False, version=self.versions[-1] + 1, wait_s=0.0, clock_gap=0), 0)]

    def info(self, shards):
        return [SimpleNamespace(version=self.versions[min(self.asked, len(self.versions)) - 1])]


def test_a_joiner_asks_again_while_the_run_moves_and_fails_once_it_stalls():
    from psgd.ps.client import PSClient

    moving = _Refusing([3, 7, 9])
    client = PSClient(moving, 0, 4)
    assert client.wait_admitted(0, torch.zeros(4)).versions == [10] and moving.asked == 4
    stalled = _Refusing([3, 3, 3])
    with pytest.raises(ExchangeError, match="no shard's version moved while it waited: the run is stalled"):
        PSClient(stalled, 0, 4).wait_admitted(0, torch.zeros(4))
    assert stalled.asked == 2
    dead = _Refusing([3], code="UNAVAILABLE")   # anything but a hold's end fails at once
    with pytest.raises(ExchangeError, match="UNAVAILABLE"):
        PSClient(dead, 0, 4).wait_admitted(0, torch.zeros(4))
    assert dead.asked == 1
