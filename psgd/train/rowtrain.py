"""A worker's sparse side: pull the rows a batch touches, push one summed gradient per touched row.

Any model's `nn.Embedding` tables (psgd/train/dlrm.py `embedding_tables`: DLRM's, or a user's
`--model FILE.py:FUNCTION`) are served by row stores (psgd/core/rowstore.py, one per shard and
table), the rest of the model by the dense path as before. No change to the model's code: a
forward pre-hook on each table sees the ids of the lookup, deduplicates them (rows.dedup), cuts
them by owner (rows.by_shard), pulls those rows from their stores and writes them into the
worker's copy of the table just before the lookup reads it; the table's gradient is taken sparse
(the module's `sparse` flag: one gradient row per lookup, never a dense (rows, dim) tensor), and
`push()` sums it per distinct id (rows.sum_rows) and pushes each shard its rows. The worker's copy
of a table is full-size but only the rows just pulled are current: every row a forward reads was
pulled for that forward.

Contract: `SparseRows(model, stores, rank)`, `stores[t][k]` the store of table t (in
`embedding_tables` order) on shard k, all of one table sharing its `RowPartition`. Per step:
forward and backward as usual, then `push()` (returns the per-row staleness of every row pushed,
one tensor per table). `bytes_pulled` / `bytes_pushed` count payload bytes (`rows.wire_bytes`),
`rows_pulled` the distinct rows. One lookup per table per forward: a table read twice in one
forward (a shared table) raises RuntimeError, since its second pull would replace the first's
note of the rows' clocks. Not thread-safe (one worker's state). `dense_parameters(model)` is what
the dense path still moves. Tests: tests/test_rowtrain.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from psgd.core import rows
from psgd.core.rowstore import RowStore
from psgd.train.dlrm import embedding_tables


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters that are not in an embedding table, in parameter order."""
    sparse = {id(m.weight) for _, m in embedding_tables(model)}
    return [p for p in model.parameters() if id(p) not in sparse]


class SparseRows:
    def __init__(self, model: nn.Module, stores: Sequence[Sequence[RowStore]], rank: int) -> None:
        self.tables = [m for _, m in embedding_tables(model)]
        if len(stores) != len(self.tables):
            raise ValueError(f"the model has {len(self.tables)} embedding tables and {len(stores)} were given stores")
        self.stores, self.rank = stores, rank
        self.pulled: dict[int, torch.Tensor] = {}
        self.bytes_pulled = self.bytes_pushed = self.rows_pulled = 0
        for t, table in enumerate(self.tables):
            table.sparse = True  # backward gives one gradient row per lookup (a sparse COO tensor)
            table.register_forward_pre_hook(lambda module, args, t=t: self._pull(t, module, args[0]))

    def _pull(self, t: int, module: nn.Embedding, ids: torch.Tensor) -> None:
        if t in self.pulled:
            raise RuntimeError(f"embedding table {t} is looked up twice in one step; psgd's sparse path pulls a "
                               "table's rows once per step")
        unique, _ = rows.dedup(ids)
        stores = self.stores[t]
        for k, (pos, _) in enumerate(rows.by_shard(stores[0].partition, unique)):
            if len(pos):
                got = stores[k].pull(self.rank, unique[pos])
                with torch.no_grad():
                    module.weight[unique[pos]] = got
                self.bytes_pulled += rows.wire_bytes(len(pos), got.shape[1])
        self.pulled[t] = unique
        self.rows_pulled += len(unique)

    def push(self) -> list[torch.Tensor]:
        """Push every table's summed row gradients to their shards; the per-row staleness of each."""
        out = []
        for t, table in enumerate(self.tables):
            g = table.weight.grad
            if t not in self.pulled or g is None:
                out.append(torch.empty(0, dtype=torch.int64))
                continue
            ids, summed = rows.sum_rows(g._indices()[0], g._values().reshape(-1, table.embedding_dim))
            stale = []
            stores = self.stores[t]
            for k, (pos, _) in enumerate(rows.by_shard(stores[0].partition, ids)):
                if len(pos):
                    stale.append(stores[k].push(self.rank, ids[pos], summed[pos], count=len(pos)))
                    self.bytes_pushed += rows.wire_bytes(len(pos), summed.shape[1])
            out.append(torch.cat(stale) if stale else torch.empty(0, dtype=torch.int64))
            table.weight.grad = None
        self.pulled.clear()
        return out


def make_stores(model: nn.Module, shards: int, scheme: str, optimizer) -> list[list[RowStore]]:
    """Row stores for every table of `model` on `shards` shards, initialised from its tables
    (one `RowPartition` per table): what K shards would hold, in one process."""
    out = []
    for _, m in embedding_tables(model):
        partition = rows.RowPartition(m.num_embeddings, shards, scheme)
        out.append([RowStore(partition, k, m.weight.detach(), optimizer) for k in range(shards)])
    return out


def assemble(stores: Sequence[RowStore]) -> torch.Tensor:
    """One table whole again from its shards' stores."""
    first = stores[0]
    table = torch.empty(first.partition.rows, first.dim)
    for s in stores:
        ids, block = s.snapshot()
        table[ids] = block
    return table
