"""psgd/core/rowrounds.py: when a shard's row stores answer a pull and take a push (sync, async, SSP),
and a sync round equals the dense shard's step on the same gradients."""

import functools
import threading

import pytest
import torch

from psgd.core import rows
from psgd.core.rowoptim import RowSGD
from psgd.core.rowrounds import RowRounds
from psgd.core.rowstore import RowStore

V, D, LR = 12, 3, 0.5


def _rounds(mode, workers=2, staleness=0, initialised=True):
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    store = RowStore(rows.RowPartition(V, 1, "hash"), 0, table, functools.partial(RowSGD, lr=LR),
                     initialised=initialised)
    return table, store, RowRounds([store], mode, workers, staleness)


def _pull(r, store, worker, ids, timeout=0.0):
    return r.pull(worker, [(0, store.check_pull(worker, torch.tensor(ids)))], timeout)


def _push(r, store, worker, ids, grads):
    ids = torch.tensor(ids)
    r.push(worker, [(0, store.check_push(worker, ids, grads, len(ids)))])


def test_a_sync_round_is_one_update_of_the_mean_as_the_dense_shard_steps():
    table, store, r = _rounds("sync", workers=3)
    g = [torch.randn(V, D, generator=torch.Generator().manual_seed(10 + w)) for w in range(3)]
    touched = [[0, 2, 5], [2, 3], [5, 7, 11]]
    for w in range(3):
        assert _pull(r, store, w, touched[w]) is not None
    for w in (2, 0, 1):  # arrival order does not matter: the sum is in worker order
        _push(r, store, w, touched[w], g[w][touched[w]])
    assert r.version == 1
    # The dense shard: zeros where a worker did not touch a row, summed in worker order, / N, SGD.
    dense = [torch.zeros(V, D) for _ in range(3)]
    for w in range(3):
        dense[w][touched[w]] = g[w][touched[w]]
    expect = table.clone()
    expect.add_(((dense[0] + dense[1]) + dense[2]).div_(3), alpha=-LR)
    assert torch.equal(store.snapshot()[1], expect)
    assert store.clock.histogram == {0: 8}  # every row gradient of a sync round is fresh
    assert store.clock.updates[2] == 1  # one update, though two workers pushed row 2


def test_sync_holds_the_next_pull_until_the_round_is_applied_and_a_leaver_is_not_waited_for():
    _, store, r = _rounds("sync", workers=2)
    for w in range(2):
        _pull(r, store, w, [1])
    _push(r, store, 0, [1], torch.ones(1, D))
    assert _pull(r, store, 0, [1]) is None  # round 0 lacks worker 1: clock 1 may not read
    r.leave(1)  # gone before it pushed: round 0 is worker 0's alone
    assert r.version == 1 and _pull(r, store, 0, [1]) is not None


def test_ssp_lets_a_worker_run_s_clocks_ahead_and_no_further():
    _, store, r = _rounds("ssp", workers=2, staleness=1)
    for clock in range(2):
        assert _pull(r, store, 0, [clock]) is not None
        _push(r, store, 0, [clock], torch.ones(1, D))
    assert _pull(r, store, 0, [2]) is None  # clock 2, slowest 0: 2 ahead of a bound of 1
    _pull(r, store, 1, [4])
    _push(r, store, 1, [4], torch.ones(1, D))
    assert _pull(r, store, 0, [2]) is not None
    assert r.version == 3  # applied on arrival


def test_async_never_waits_and_counts_per_row_staleness_apart_from_the_global():
    _, store, r = _rounds("async", workers=2)
    _pull(r, store, 0, [0, 1])
    _pull(r, store, 1, [1, 2])
    _push(r, store, 1, [1, 2], torch.ones(2, D))
    _push(r, store, 0, [0, 1], torch.ones(2, D))  # one update since its pull, but only row 1 took it
    assert r.version == 2 and store.clock.histogram == {0: 3, 1: 1}


def test_a_pull_waits_for_the_stores_initial_rows_which_the_first_init_gives():
    table, store, r = _rounds("async", initialised=False)
    assert _pull(r, store, 0, [3]) is None
    got = []
    t = threading.Thread(target=lambda: got.append(_pull(r, store, 0, [3], timeout=30)))
    t.start()
    r.init([(0, store.ids, table)])
    t.join()
    assert torch.equal(got[0][0], table[[3]])
    r.init([(0, store.ids, torch.zeros(V, D))])  # a later offer is ignored
    assert torch.equal(store.snapshot()[1], table)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="row mode"):
        _rounds("allreduce")
