"""psgd/train/rowtrain.py: DLRM trained through row stores equals a plain torch loop, moves only the
touched rows, and under async reports per-row staleness far below the global one."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psgd.core import rows
from psgd.core.config import DataConfig, ModelConfig
from psgd.core.rowoptim import RowSGD
from psgd.train import data, dlrm, models, rowtrain

LR = 0.1
SGD = functools.partial(RowSGD, lr=LR)


def _setup(width=4):
    ds = data.load(DataConfig(dataset="clicks", num_samples=2000))
    model = models.build(ModelConfig(model="dlrm", width=width), ds.input_dim, ds.num_classes, seed=0)
    return ds, model


@pytest.mark.parametrize("prefetch", [False, True])
def test_training_through_row_stores_equals_a_plain_torch_loop(prefetch):
    """One worker, 3 shards by hash, SGD on both parts, against torch.optim.SGD on the whole model
    (dense embedding gradients). Tolerance 1e-6: torch's dense embedding backward and the worker's
    per-row sum may add a row's lookups in different orders."""
    ds, model = _setup()
    ref = copy.deepcopy(model)
    shards, partitions = rowtrain.make_local(model, 3, "hash", SGD)
    sparse = rowtrain.SparseRows(model, shards, partitions, rank=0)
    dense = torch.optim.SGD(rowtrain.dense_parameters(model), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    with torch.no_grad():  # the worker's copy starts stale: only pulled rows may be read
        for _, m in dlrm.embedding_tables(model):
            m.weight.fill_(float("nan"))
    for step in range(30):
        x, y = ds.x_train[step * 32:(step + 1) * 32], ds.y_train[step * 32:(step + 1) * 32]
        if prefetch:
            sparse.prefetch({f: x[:, f] for f in range(x.shape[1])})
        for m, opt in ((model, dense), (ref, ref_opt)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
        sparse.push()
        dense.step()
        ref_opt.step()
    assert set(rowtrain.staleness_histogram(shards)) == {0}  # one worker: nobody moves a row in between
    for t, (_, m) in enumerate(dlrm.embedding_tables(ref)):
        assert torch.allclose(rowtrain.assemble(shards, t), m.weight.detach(), rtol=1e-6, atol=1e-6)
    for a, b in zip(rowtrain.dense_parameters(model), rowtrain.dense_parameters(ref), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_step_moves_the_touched_rows_and_their_ids_and_nothing_more():
    ds, model = _setup(width=16)
    shards, partitions = rowtrain.make_local(model, 2, "range", SGD)
    sparse = rowtrain.SparseRows(model, shards, partitions, rank=0)
    x, y = ds.x_train[:32], ds.y_train[:32]
    F.cross_entropy(model(x), y).backward()
    sparse.push()
    touched = sum(len(torch.unique(x[:, f])) for f in range(x.shape[1]))
    assert sparse.rows_pulled == touched
    assert sparse.bytes_pulled == sparse.bytes_pushed == rows.wire_bytes(touched, 16)
    assert sum(st.bytes_out for s in shards for st in s.stores) == sparse.bytes_pulled
    table_bytes = 4 * sum(m.weight.numel() for _, m in dlrm.embedding_tables(model))
    assert sparse.bytes_pulled < table_bytes / 4  # what the dense path moves for the tables, each way


def test_a_lookup_of_rows_not_pulled_is_refused():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 2)

        def forward(self, x):
            return self.e(x[:, 0]) + self.e(x[:, 1])

    model = Twice()
    shards, partitions = rowtrain.make_local(model, 2, "hash", SGD)
    sparse = rowtrain.SparseRows(model, shards, partitions, rank=0)
    with pytest.raises(RuntimeError, match="reads rows this step did not pull"):
        model(torch.tensor([[1, 2]]))
    sparse.pulled.clear()
    model(torch.tensor([[3, 3]]))  # the second lookup reads rows the first pulled: fine


def test_async_workers_see_per_row_staleness_well_below_the_global_one():
    """N workers in turn (async's steady state, as core/textbook.py runs it): each pulls, computes,
    and pushes after the N - 1 others pushed. Global staleness N - 1; per row much less."""
    ds, model = _setup()
    n = 4
    shards, partitions = rowtrain.make_local(model, 2, "hash", SGD)
    replicas = [copy.deepcopy(model) for _ in range(n)]
    workers = [rowtrain.SparseRows(r, shards, partitions, rank=w) for w, r in enumerate(replicas)]
    for step in range(40):
        w = step % n
        x, y = ds.x_train[step * 16:(step + 1) * 16], ds.y_train[step * 16:(step + 1) * 16]
        if step >= n:  # its previous pull's gradient, held while the others pushed
            workers[w].push()
        F.cross_entropy(replicas[w](x), y).backward()
    hist = rowtrain.staleness_histogram(shards)
    mean = sum(s * c for s, c in hist.items()) / sum(hist.values())
    assert max(hist) <= n - 1 and mean < 0.5 * (n - 1)


def _lockstep(ds, models_, workers, steps):
    """Each model a step on the same batch through its worker: prefetch, forward, backward, push."""
    for step in range(steps):
        x, y = ds.x_train[step * 32:(step + 1) * 32], ds.y_train[step * 32:(step + 1) * 32]
        for m, w in zip(models_, workers, strict=True):
            w.prefetch({f: x[:, f] for f in range(x.shape[1])})
            F.cross_entropy(m(x), y).backward()
            w.push()


def test_fused_tables_train_bit_for_bit_as_tables_apart_with_one_request_per_shard():
    """Every table in one id space (TorchRec's table batching): each row's arithmetic is unchanged."""
    ds, model = _setup()
    fused_model = copy.deepcopy(model)
    apart, parts = rowtrain.make_local(model, 2, "range", SGD)
    fused, fparts = rowtrain.make_local(fused_model, 2, "range", SGD, fused=True)
    assert len(fparts) == 1 and len(fused[0].stores) == 1
    workers = [rowtrain.SparseRows(model, apart, parts, 0), rowtrain.SparseRows(fused_model, fused, fparts, 0)]
    _lockstep(ds, (model, fused_model), workers, steps=10)
    whole = rowtrain.assemble(fused, 0)
    bases = fparts[0].bases
    for t in range(len(bases)):
        table = rowtrain.assemble(apart, t)
        assert torch.equal(whole[bases[t]:bases[t] + len(table)], table)
    assert workers[0].bytes_pulled == workers[1].bytes_pulled
    # Range partitioning fuses table by table: each table's hot head on shard 0, as apart.
    assert fparts[0].share() == [sum(p) for p in zip(*(rows.RowPartition(v, 2, "range").share()
                                                       for v in fparts[0].tables), strict=True)]
    with pytest.raises(RuntimeError, match="prefetch every table"):
        fused_model(ds.x_train[:2])


@pytest.mark.parametrize("fused", [False, True])
def test_a_push_that_reuses_its_prefetch_is_bit_for_bit_the_long_way(fused, monkeypatch):
    """A step whose lookups are exactly its prefetch pushes from the prefetch's dedup and cut (no
    second unique, no second owner cut); the rows come out bit for bit as `rows.sum_rows` makes them.
    A table read twice goes the long way, and is still right."""
    ds, model = _setup()
    long_model = copy.deepcopy(model)
    short, parts = rowtrain.make_local(model, 2, "hash", SGD, fused=fused)
    long_, lparts = rowtrain.make_local(long_model, 2, "hash", SGD, fused=fused)
    workers = [rowtrain.SparseRows(model, short, parts, 0), rowtrain.SparseRows(long_model, long_, lparts, 0)]
    monkeypatch.setattr(workers[1], "_reuse", lambda sp, group: None)
    summed = []
    real_sum_rows = rows.sum_rows
    monkeypatch.setattr(rows, "sum_rows", lambda *a: summed.append(1) or real_sum_rows(*a))
    _lockstep(ds, (model, long_model), workers, steps=10)
    spaces = 1 if fused else len(parts)
    assert len(summed) == 10 * spaces  # the long worker's only: the short one never summed again
    for t in range(spaces):
        assert torch.equal(rowtrain.assemble(short, t), rowtrain.assemble(long_, t))
    # A lookup the prefetch did not plan (table 0 read a second time, same ids): the long way, still exact.
    summed.clear()
    x = ds.x_train[:32]
    workers[0].prefetch({f: x[:, f] for f in range(x.shape[1])})
    model.tables[0](x[:, 0]).sum().backward(retain_graph=False)
    F.cross_entropy(model(x), ds.y_train[:32]).backward()
    workers[0].push()
    assert summed  # table 0's gradient has two lookups' rows: summed the long way
