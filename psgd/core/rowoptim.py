"""Row-wise optimizers: an update applied to the rows a push names and to no other.

A shard that owns an embedding table receives one summed gradient per touched row
(psgd/core/rows.py `sum_rows`) and must leave every other row, and its optimizer state, as it
was: the "lazy" update of sparse embeddings (torch's `nn.Embedding(sparse=True)` with
`torch.optim.SGD` or `torch.optim.Adagrad`, which take sparse gradients).

Contract: `RowSGD(table, lr)` and `RowAdagrad(table, lr, eps, initial_accumulator_value,
lr_decay)` over one table tensor (rows, dim); `step(rows, grads)` with `rows` distinct int64 ids
and `grads` (len(rows), dim) (`trusted=True`: the caller checked them, as psgd/core/rowstore.py
does). Each does torch's own arithmetic, operation for operation, of the same optimizer given
the same rows as a coalesced sparse gradient (torch/optim/sgd.py and adagrad.py, their
single-tensor sparse paths):
- SGD:     w[r] += (-lr) * g
- Adagrad: s[r] += g^2; std = sqrt(s[r]) + eps; w[r] += (-clr) * (g / std),
           clr = lr / (1 + (t - 1) x lr_decay), t the steps taken (this one included)
tests/test_rowoptim.py checks both bit for bit against torch's optimizers on sparse gradients, and
against dense torch on a full gradient that is zero off the rows (Adagrad: a zero gradient leaves
a row and its sum unchanged, so the two agree there too).
Not offered, because the lazy and the dense update differ and torch refuses them with sparse
gradients: weight decay (it would decay every row) and momentum (every row ever touched would keep
moving). ValueError for bad input (a repeated row, a count or width that does not match, a row out
of range), before anything changes.
`state_dict` / `load_state_dict` for checkpoints; `RowOptimizer` is the common shape.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RowOptimizer(Protocol):
    table: torch.Tensor
    steps: int

    def step(self, rows: torch.Tensor, grads: torch.Tensor, trusted: bool = False) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def check_rows(table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """ValueError unless `rows` are distinct int64 ids of `table` and `grads` has a row of its width each."""
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"rows must be a 1-D int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
    if grads.dim() != 2 or grads.shape[0] != rows.shape[0] or grads.shape[1] != table.shape[1]:
        raise ValueError(f"{len(rows)} rows of width {table.shape[1]} need gradients of shape "
                         f"({len(rows)}, {table.shape[1]}), got {tuple(grads.shape)}")
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]:
        raise ValueError(f"a row id is out of range for a table of {table.shape[0]} rows")
    if torch.unique(rows).numel() != rows.numel():
        raise ValueError("a row appears twice in one update: sum its gradients first (rows.sum_rows)")


class RowSGD:
    """Plain SGD on the named rows (torch.optim.SGD without momentum or weight decay)."""

    def __init__(self, table: torch.Tensor, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.table, self.lr, self.steps = table, lr, 0

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grads: torch.Tensor, trusted: bool = False) -> None:
        if not trusted:
            check_rows(self.table, rows, grads)
        self.table.index_add_(0, rows, grads, alpha=-self.lr)
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])


class RowAdagrad:
    """Adagrad (Duchi et al. 2011) on the named rows, one accumulator per element as torch keeps it."""

    def __init__(self, table: torch.Tensor, lr: float = 0.01, eps: float = 1e-10,
                 initial_accumulator_value: float = 0.0, lr_decay: float = 0.0) -> None:
        if not lr > 0 or not eps > 0 or initial_accumulator_value < 0 or lr_decay < 0:
            raise ValueError(f"Adagrad needs lr > 0, eps > 0, initial_accumulator_value >= 0 and lr_decay >= 0; "
                             f"got {lr}, {eps}, {initial_accumulator_value}, {lr_decay}")
        self.table, self.lr, self.eps, self.lr_decay = table, lr, eps, lr_decay
        self.sum = torch.full_like(table, initial_accumulator_value)
        self.steps = 0

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grads: torch.Tensor, trusted: bool = False) -> None:
        if not trusted:
            check_rows(self.table, rows, grads)
        self.steps += 1
        clr = self.lr / (1 + (self.steps - 1) * self.lr_decay)
        self.sum.index_add_(0, rows, grads.pow(2))
        std = self.sum[rows].sqrt_().add_(self.eps)
        self.table.index_add_(0, rows, grads / std, alpha=-clr)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "sum": self.sum.clone()}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["sum"].shape) != tuple(self.table.shape):
            raise ValueError(f"an Adagrad state of shape {tuple(state['sum'].shape)} does not fit a table of "
                             f"{tuple(self.table.shape)}")
        self.steps, self.sum = int(state["steps"]), state["sum"].to(self.table.device).clone()
