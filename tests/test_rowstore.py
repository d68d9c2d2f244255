"""psgd/core/rowstore.py: a shard's rows of a table, pulled and pushed by key, bad requests refused
with the store unchanged."""

import functools

import pytest
import torch

from psgd.core import rows
from psgd.core.rowoptim import RowAdagrad, RowSGD
from psgd.core.rowstore import RowError, RowStore

V, D = 40, 3


def _stores(scheme="hash", k=2, opt=functools.partial(RowSGD, lr=0.5)):
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    p = rows.RowPartition(V, k, scheme)
    return table, p, [RowStore(p, s, table, opt) for s in range(k)]


def _state(store):
    ids, block = store.snapshot()
    return ids, block, store.clock.updates.clone(), dict(store.clock.histogram), store.bytes_in, store.bytes_out


def test_the_stores_tile_the_table_and_serve_their_own_rows():
    table, p, stores = _stores("range", 3)
    got = torch.empty_like(table)
    for s in stores:
        ids, block = s.snapshot()
        got[ids] = block
    assert torch.equal(got, table)
    ids = torch.tensor([14, 15, 20])  # shard 1 holds 14..26 of 40 under range
    assert torch.equal(stores[1].pull(0, ids), table[ids])
    assert stores[1].bytes_out == rows.wire_bytes(3, D)


def test_a_push_updates_its_rows_alone_and_reports_their_staleness():
    table, p, stores = _stores("range", 2)
    s = stores[0]
    ids = torch.tensor([1, 4, 7])
    s.pull(0, ids)
    s.pull(1, torch.tensor([4]))
    assert s.push(1, torch.tensor([4]), torch.ones(1, D), count=1).tolist() == [0]
    grads = torch.ones(3, D)
    assert s.push(0, ids, grads, count=3).tolist() == [0, 1, 0]
    _, block = s.snapshot()
    want = table[:20].clone()
    want[[1, 7]] -= 0.5
    want[4] -= 1.0
    assert torch.equal(block, want)
    assert s.bytes_in == rows.wire_bytes(4, D)


@pytest.mark.parametrize("opt", [functools.partial(RowSGD, lr=0.5), functools.partial(RowAdagrad, lr=0.5)])
def test_bad_requests_are_one_line_errors_and_change_nothing(opt):
    table, p, stores = _stores("hash", 2, opt)
    s = stores[0]
    mine = s.ids[:3]
    other = stores[1].ids[0]
    s.pull(0, mine)
    before = _state(s)
    bad = [
        (mine, torch.ones(2, D), 3, "announced 3 rows and carries 3 ids and gradients of shape \\(2, 3\\)"),
        (mine, torch.ones(3, D), 2, "announced 2 rows"),
        (mine, torch.ones(3, D + 1), 3, "width 3"),
        (mine.flip(0), torch.ones(3, D), 3, "distinct and sorted"),
        (mine[[0, 0, 1]], torch.ones(3, D), 3, "distinct and sorted"),
        (torch.tensor([mine[0], V]), torch.ones(2, D), 2, f"row id {V} out of range"),
        (torch.sort(torch.tensor([mine[0], other])).values, torch.ones(2, D), 2,
         f"row {int(other)} is held by shard 1"),
        (mine.float(), torch.ones(3, D), 3, "int64"),
    ]
    for ids, grads, count, message in bad:
        with pytest.raises(RowError, match=message):
            s.push(0, ids, grads, count)
    unpulled = s.ids[3:4]
    with pytest.raises(RowError, match=f"pushes row {int(unpulled[0])}, which its last pull"):
        s.push(0, unpulled, torch.ones(1, D), 1)
    with pytest.raises(RowError, match="never pulled"):
        s.push(5, mine, torch.ones(3, D), 3)
    with pytest.raises(RowError, match="held by shard 1"):
        s.pull(0, other[None])
    after = _state(s)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after, strict=True))
    if isinstance(s.optimizer, RowAdagrad):
        assert not s.optimizer.sum.any() and s.optimizer.steps == 0


def test_a_store_from_a_checkpoint_goes_on_as_the_store_it_was_taken_from():
    """state() then load() into a fresh store of the same shard: Adagrad's sums and the rows' update
    counts come along, so the next push gives both the same rows and the same staleness."""
    opt = functools.partial(RowAdagrad, lr=0.5)
    _, _, (a, _) = _stores("hash", 2, opt)
    ids = a.ids[:4]
    a.pull(0, ids)
    a.push(0, ids, torch.ones(4, D), count=4)
    _, _, (b, other) = _stores("hash", 2, opt)
    b.load(a.state())
    for s in (a, b):
        s.pull(1, ids)
        assert s.push(1, ids, torch.full((4, D), 0.5), count=4).tolist() == [0, 0, 0, 0]
    assert all(torch.equal(x, y) for x, y in zip(_state(a)[:3], _state(b)[:3], strict=True))  # ids, rows, counts
    assert b.initialised and b.init(b.ids, torch.zeros_like(b.block)) is False  # an INIT after it is ignored
    with pytest.raises(RowError, match="this store owns"):
        other.load(a.state())  # shard 0's rows into shard 1's store
