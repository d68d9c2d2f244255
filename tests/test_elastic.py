"""Elastic membership: schedules (psgd/core/elastic.py), the policies' admit / depart at step
boundaries (psgd/core/consistency.py), the shard's Join (psgd/ps/shard.py) and its checkpoints."""

from __future__ import annotations

import threading

import pytest
import torch

from psgd.core import elastic
from psgd.core.config import RunConfig, validate
from psgd.core.consistency import SSP, Async, PolicyError, Sync
from psgd.core.errors import ShardError
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
    assert p.admit(2, 1) == 1                      # worker 2's first step is step 1
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
    assert p.absent == {1}, "a refused join changes nothing"
    p.admit(1, 1)
    with pytest.raises(PolicyError, match="full"):
        p.free_slot()
    step(p, [0, 1], 1)
    assert p.done
    with pytest.raises(PolicyError, match="finished"):
        Sync(1, Applied(), budget=0).admit(0, 0)


def test_ssp_joiner_starts_at_the_slowest_clock_and_stalls_nobody():
    p = SSP(3, Applied(), staleness=1, budget=100, members=2)
    for c in range(5):
        for w in (0, 1):
            p.pull(w, c, lambda: None)
            p.push(w, c, p.version, torch.ones(2))
    assert p.admit(2, 0) == 0
    out = p.pull(2, 0, lambda: "w")              # served at once: its clock counts from the slowest (5)
    assert out.value == "w" and out.clock_gap == 0 and p.offset[2] == 5
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
    assert other.policy.absent == {2}


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
    assert (q.quorum, q._future, sorted(q.absent)) == (2, {2: 2}, [])
    assert q.budget == p.budget == 4 * 2 + 2
