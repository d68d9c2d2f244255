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

Contract: `SparseRows(model, shards, partitions, rank)`: `shards[k]` reaches shard k's stores of
every table (a `LocalShard` in this process, or psgd/ps/rows_tcp.py's `RowClient` over TCP: the
same start / finish calls), `partitions[t]` table t's `RowPartition` (tables in
`embedding_tables` order). Per step: `prefetch({table: ids})` when the caller knows which ids
each table will read (DLRM: table f reads column f), so that every shard is asked once for all
its tables; the hooks pull any table not prefetched, one request per shard for that table. Then
forward and backward as usual, then `push()`: one request per shard, every shard at once. The
per-row staleness is counted by the stores (`staleness_histogram` for local ones, STATS over the
wire). `bytes_pulled` / `bytes_pushed` count payload bytes (`rows.wire_bytes`), `rows_pulled` the
distinct rows. A lookup of rows the step did not pull (a table read twice with other ids)
raises RuntimeError: its rows would be stale. Not thread-safe (one worker's state).
`dense_parameters(model)` is what the dense path still moves; `make_local` builds K shards' stores
in this process, `assemble` a table whole from them. Tests: tests/test_rowtrain.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from psgd.core import rows
from psgd.core.rowstore import RowStore
from psgd.train.dlrm import embedding_tables


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters that are not in an embedding table, in parameter order."""
    sparse = {id(m.weight) for _, m in embedding_tables(model)}
    return [p for p in model.parameters() if id(p) not in sparse]


class LocalShard:
    """One shard's stores (one per table, in table order) in this process: `RowClient`'s interface
    (psgd/ps/rows_tcp.py) without a wire. Each request is checked whole before any table changes."""

    def __init__(self, stores: Sequence[RowStore]) -> None:
        self.stores = list(stores)
        self.dims = [s.dim for s in self.stores]

    def start_pull(self, worker: int, requests: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        checked = [self.stores[t].check_pull(worker, ids) for t, ids in requests]
        return [self.stores[t].apply(c) for (t, _), c in zip(requests, checked, strict=True)]

    def finish_pull(self, rows_: list[torch.Tensor]) -> list[torch.Tensor]:
        return rows_

    def start_push(self, worker: int, requests: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        checked = [self.stores[t].check_push(worker, ids, g, len(ids)) for t, ids, g in requests]
        for (t, _, _), c in zip(requests, checked, strict=True):
            self.stores[t].apply(c)

    def finish_push(self) -> None:
        pass


class SparseRows:
    def __init__(self, model: nn.Module, shards: Sequence, partitions: Sequence[rows.RowPartition],
                 rank: int) -> None:
        self.tables = [m for _, m in embedding_tables(model)]
        if len(partitions) != len(self.tables):
            raise ValueError(f"the model has {len(self.tables)} embedding tables and {len(partitions)} partitions")
        self.shards, self.partitions, self.rank = list(shards), list(partitions), rank
        self.pulled: dict[int, torch.Tensor] = {}
        self.bytes_pulled = self.bytes_pushed = self.rows_pulled = 0
        for t, table in enumerate(self.tables):
            table.sparse = True  # backward gives one gradient row per lookup (a sparse COO tensor)
            table.register_forward_pre_hook(lambda module, args, t=t: self._lookup(t, args[0]))

    def prefetch(self, ids_by_table: Mapping[int, torch.Tensor]) -> None:
        """Pull the rows of several tables at once: one request per shard, all shards at once."""
        requests: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.shards]
        for t, ids in ids_by_table.items():
            unique, _ = rows.dedup(ids)
            self.pulled[t] = unique
            self.rows_pulled += len(unique)
            for k, (pos, _) in enumerate(rows.by_shard(self.partitions[t], unique)):
                if len(pos):
                    requests[k].append((t, unique[pos]))
        handles = [(k, self.shards[k].start_pull(self.rank, req)) for k, req in enumerate(requests) if req]
        for k, handle in handles:
            for (t, ids), got in zip(requests[k], self.shards[k].finish_pull(handle), strict=True):
                with torch.no_grad():
                    self.tables[t].weight[ids] = got
                self.bytes_pulled += rows.wire_bytes(len(ids), got.shape[1])

    def _lookup(self, t: int, ids: torch.Tensor) -> None:
        if t not in self.pulled:
            self.prefetch({t: ids})
        elif not bool(torch.isin(ids, self.pulled[t]).all()):
            raise RuntimeError(f"embedding table {t} reads rows this step did not pull (a table looked up twice "
                               "in one step, or a prefetch of other ids)")

    def push(self) -> None:
        """Push every table's summed row gradients: one request per shard, all shards at once."""
        requests: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in self.shards]
        for t, table in enumerate(self.tables):
            g = table.weight.grad
            if t not in self.pulled or g is None:
                continue
            ids, summed = rows.sum_rows(g._indices()[0], g._values().reshape(-1, table.embedding_dim))
            for k, (pos, _) in enumerate(rows.by_shard(self.partitions[t], ids)):
                if len(pos):
                    requests[k].append((t, ids[pos], summed[pos]))
                    self.bytes_pushed += rows.wire_bytes(len(pos), summed.shape[1])
            table.weight.grad = None
        started = [k for k, req in enumerate(requests) if req]
        for k in started:
            self.shards[k].start_push(self.rank, requests[k])
        for k in started:
            self.shards[k].finish_push()
        self.pulled.clear()


def make_local(model: nn.Module, shards: int, scheme: str, optimizer) -> tuple[list[LocalShard],
                                                                              list[rows.RowPartition]]:
    """K shards' row stores for every table of `model`, in this process, initialised from its tables
    (one `RowPartition` per table): what K row servers would hold."""
    partitions = [rows.RowPartition(m.num_embeddings, shards, scheme) for _, m in embedding_tables(model)]
    stores = [[RowStore(p, k, m.weight.detach(), optimizer) for (_, m), p in zip(embedding_tables(model), partitions,
                                                                                   strict=True)]
              for k in range(shards)]
    return [LocalShard(s) for s in stores], partitions


def assemble(shards: Sequence[LocalShard], table: int) -> torch.Tensor:
    """Table `table` whole again from the shards' stores."""
    first = shards[0].stores[table]
    out = torch.empty(first.partition.rows, first.dim)
    for s in shards:
        ids, block = s.stores[table].snapshot()
        out[ids] = block
    return out


def staleness_histogram(shards: Sequence[LocalShard]) -> Counter:
    """Per-row staleness -> rows, over every store of the shards."""
    total: Counter = Counter()
    for s in shards:
        for store in s.stores:
            total.update(store.clock.histogram)
    return total
