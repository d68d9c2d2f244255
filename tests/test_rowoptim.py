"""psgd/core/rowoptim.py against torch's own optimizers on the same rows.

Bit for bit: RowSGD and RowAdagrad against torch.optim.SGD / Adagrad given the same rows as a
coalesced sparse gradient (their sparse paths), and RowSGD against dense torch SGD on a gradient
that is zero off the rows. Tolerance: dense torch Adagrad (its addcdiv_ fuses the division into the
update, which may round differently): 1e-6 relative, 1e-6 absolute, over 30 steps; the rows it
did not touch agree exactly.
"""

import pytest
import torch

from psgd.core import rows
from psgd.core.rowoptim import RowAdagrad, RowSGD

V, D = 60, 5


def _steps(seed: int, count: int = 30):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        ids = torch.randint(0, V // 2, (40,), generator=g)  # the upper half of the table is never touched
        yield rows.sum_rows(ids, torch.randn(40, D, generator=g))


def _pair(kind: str, table: torch.Tensor, **kw):
    if kind == "sgd":
        return RowSGD(table, **kw), lambda p: torch.optim.SGD([p], **kw)
    return RowAdagrad(table, **kw), lambda p: torch.optim.Adagrad([p], **kw)


SETTINGS = [("sgd", {"lr": 0.3}), ("adagrad", {"lr": 0.3}),
            ("adagrad", {"lr": 0.1, "eps": 1e-6, "initial_accumulator_value": 0.1, "lr_decay": 0.01})]


@pytest.mark.parametrize(("kind", "kw"), SETTINGS)
def test_bit_for_bit_with_torch_on_the_same_sparse_rows(kind, kw):
    w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(9))
    ours, ref = w0.clone(), torch.nn.Parameter(w0.clone())
    opt, make = _pair(kind, ours, **kw)
    torch_opt = make(ref)
    for ids, grads in _steps(1):
        opt.step(ids, grads)
        ref.grad = torch.sparse_coo_tensor(ids[None], grads, (V, D), check_invariants=True).coalesce()
        torch_opt.step()
    assert torch.equal(ours, ref.detach())
    assert torch.equal(ours[V // 2:], w0[V // 2:])  # rows no push named: untouched
    if kind == "adagrad":
        assert torch.equal(opt.sum, torch_opt.state[ref]["sum"])


@pytest.mark.parametrize(("kind", "kw"), SETTINGS)
def test_against_dense_torch_on_a_gradient_zero_off_the_rows(kind, kw):
    w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(9))
    ours, ref = w0.clone(), torch.nn.Parameter(w0.clone())
    opt, make = _pair(kind, ours, **kw)
    torch_opt = make(ref)
    for ids, grads in _steps(2):
        opt.step(ids, grads)
        full = torch.zeros(V, D)
        full[ids] = grads
        ref.grad = full
        torch_opt.step()
    if kind == "sgd":
        assert torch.equal(ours, ref.detach())
    else:
        assert torch.allclose(ours, ref.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(ours[V // 2:], ref.detach()[V // 2:])


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_one_push_per_step_of_an_embedding_trained_by_torch_with_sparse_gradients(kind):
    """The whole path: a batch's lookups, their gradients summed per row (what a worker pushes),
    the row update (what the shard applies), against nn.Embedding(sparse=True) and torch's optimizer.
    Equal to 1e-6, not bit for bit: torch's SGD adds an uncoalesced sparse gradient's duplicate
    rows to the weight one by one (w - lr g1 - lr g2, rounded twice), the shard their sum once."""
    torch.manual_seed(3)
    ref = torch.nn.Embedding(V, D, sparse=True)
    table = ref.weight.detach().clone()
    opt, make = _pair(kind, table, lr=0.2)
    torch_opt = make(ref.weight)
    target = torch.randn(16, D)
    for _ in range(10):
        ids = torch.randint(0, 8, (16,))  # few rows: many duplicates
        torch_opt.zero_grad()
        ref(ids).sub(target).pow(2).sum().backward()
        # The worker's side: the gradient per lookup, then one summed row per distinct id.
        e = table[ids].clone().requires_grad_(True)
        e.sub(target).pow(2).sum().backward()
        opt.step(*rows.sum_rows(ids, e.grad))
        torch_opt.step()
        assert torch.allclose(table, ref.weight.detach(), rtol=1e-6, atol=1e-6)


def test_bad_pushes_leave_the_table_and_state_unchanged():
    table = torch.randn(V, D)
    before = table.clone()
    opt = RowAdagrad(table, lr=0.1)
    sums = opt.sum.clone()
    bad = [
        (torch.tensor([1, 1]), torch.ones(2, D), "appears twice"),
        (torch.tensor([1, V]), torch.ones(2, D), "out of range"),
        (torch.tensor([-1]), torch.ones(1, D), "out of range"),
        (torch.tensor([1, 2]), torch.ones(3, D), r"need gradients of shape \(2, 5\)"),
        (torch.tensor([1, 2]), torch.ones(2, D + 1), "need gradients"),
        (torch.tensor([1.0]), torch.ones(1, D), "int64"),
    ]
    for ids, grads, message in bad:
        with pytest.raises(ValueError, match=message):
            opt.step(ids, grads)
    assert torch.equal(table, before) and torch.equal(opt.sum, sums) and opt.steps == 0


def test_settings_torch_refuses_with_sparse_gradients_are_not_offered():
    with pytest.raises(ValueError, match="lr must be > 0"):
        RowSGD(torch.zeros(2, 2), lr=0)
    with pytest.raises(ValueError, match="Adagrad needs"):
        RowAdagrad(torch.zeros(2, 2), lr=0.1, eps=0)
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2))
    with pytest.raises(RuntimeError, match="weight_decay"):
        torch.optim.Adagrad([p], weight_decay=0.1).step()


def test_state_round_trips_through_a_checkpoint():
    a = RowAdagrad(torch.zeros(V, D), lr=0.1, lr_decay=0.1)
    for ids, grads in _steps(4, 5):
        a.step(ids, grads)
    b = RowAdagrad(a.table.clone(), lr=0.1, lr_decay=0.1)
    b.load_state_dict(a.state_dict())
    for ids, grads in _steps(5, 5):
        a.step(ids, grads)
        b.step(ids, grads)
    assert torch.equal(a.table, b.table) and b.steps == 10
    with pytest.raises(ValueError, match="does not fit"):
        RowAdagrad(torch.zeros(3, D)).load_state_dict(a.state_dict())
