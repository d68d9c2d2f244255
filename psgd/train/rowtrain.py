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
every table (a `LocalShard` in this process, or psgd/ps/rows_tcp.py's `RowClient` over TCP: the same
start / finish calls), `partitions[t]` table t's `RowPartition` (tables in `embedding_tables`
order), or one partition with `tables` over all of them (fused: tables of one width in one id space,
each shard one store; a step must then `prefetch` every table). Per step: `prefetch({table: ids})`
when the caller knows which ids each table will read (DLRM: table f reads column f), so that every
shard is asked once for all its tables; the hooks pull any table not prefetched, one request per
shard for that table. Then forward and backward as usual, then `push()`: one request per shard,
every shard at once. A push whose lookups were exactly its prefetch (each table read once with the
prefetched ids: DLRM's step) sums and cuts by the prefetch's dedup, not a second one: the same sums
bit for bit, a third fewer small torch calls per step. The per-row staleness is counted by the
stores (`staleness_histogram` for local
ones, STATS over the wire). `bytes_pulled` / `bytes_pushed` count payload bytes (`rows.wire_bytes`),
`rows_pulled` the distinct rows. A lookup of rows the step did not pull (a table read twice with
other ids) raises RuntimeError: its rows would be stale. Not thread-safe (one worker's state).
`every_shard=True`: every step asks every shard once to pull and once to push, empty requests
included, so that a shard counts a worker's clock by its requests (sync and SSP for rows,
psgd/core/rowrounds.py; a step must then `prefetch`). `enabled = False`: the hooks pull nothing
(a warm-up forward reads the worker's copy as it is). `dense_parameters(model)` is what the dense
path still moves; `make_local` builds K shards' stores in this process (fused or not), `assemble`
a store's rows whole from them. Tests: tests/test_rowtrain.py.
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


def _within(ids: torch.Tensor, pulled: torch.Tensor) -> bool:
    """Whether every id is among the sorted `pulled` (a binary search each: torch.isin sorts both,
    the larger part of a small step's cost)."""
    if not len(pulled):
        return not len(ids)
    at = torch.searchsorted(pulled, ids).clamp_(max=len(pulled) - 1)
    return bool((pulled[at] == ids).all())


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
                 rank: int, every_shard: bool = False) -> None:
        self.tables = [m for _, m in embedding_tables(model)]
        self.shards, self.partitions, self.rank = list(shards), list(partitions), rank
        self.every_shard, self.enabled = every_shard, True
        self.fused = len(partitions) == 1 and len(partitions[0].tables) == len(self.tables) > 1
        if not self.fused and len(partitions) != len(self.tables):
            raise ValueError(f"the model has {len(self.tables)} embedding tables and {len(partitions)} partitions")
        # Table t's rows live in space `space[t]` (a partition and its stores) from id `base[t]` on.
        self.space = [0 if self.fused else t for t in range(len(self.tables))]
        self.base = partitions[0].bases if self.fused else [0] * len(self.tables)
        if self.fused:  # one tensor holds every table: a pull writes it once (each table a view of it)
            fused = torch.cat([m.weight.detach() for m in self.tables])
            for m, b in zip(self.tables, self.base, strict=True):
                m.weight.data = fused[b:b + m.num_embeddings]
            self.weights = [fused]
        else:
            self.weights = [m.weight for m in self.tables]
        self.pulled: dict[int, torch.Tensor] = {}  # space -> the distinct ids pulled this step
        # What a prefetch knew, for a push that need not find it again (`_reuse`): space -> (its tables
        # in order, the inverse map, each shard's positions); table -> the ids it was prefetched with
        # and how many lookups read exactly those (1 for the short way).
        self._plan: dict[int, tuple[list[int], torch.Tensor, list[torch.Tensor]]] = {}
        self._expected: dict[int, torch.Tensor] = {}
        self._reads: dict[int, int] = {}
        self.bytes_pulled = self.bytes_pushed = self.rows_pulled = 0
        for t, table in enumerate(self.tables):
            table.sparse = True  # backward gives one gradient row per lookup (a sparse COO tensor)
            table.register_forward_pre_hook(lambda module, args, t=t: self._lookup(t, args[0]))

    def _by_space(self, items: Mapping[int, tuple]) -> dict[int, list[tuple]]:
        out: dict[int, list[tuple]] = {}
        for t, item in items.items():
            out.setdefault(self.space[t], []).append((t, *item))
        return out

    def prefetch(self, ids_by_table: Mapping[int, torch.Tensor]) -> None:
        """Pull the rows of several tables at once: one request per shard, all shards at once."""
        requests: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.shards]
        for sp, group in self._by_space({t: (ids,) for t, ids in ids_by_table.items()}).items():
            flat = {t: ids.reshape(-1) for t, ids in group}
            unique, inverse = rows.dedup(torch.cat([ids + self.base[t] for t, ids in flat.items()]))
            self.pulled[sp] = unique
            self.rows_pulled += len(unique)
            cuts = [pos for pos, _ in rows.by_shard(self.partitions[sp], unique)]
            self._plan[sp] = ([t for t, _ in group], inverse, cuts)
            for t, ids in flat.items():
                self._expected[t], self._reads[t] = ids, 0
            for k, pos in enumerate(cuts):
                if len(pos):
                    requests[k].append((sp, unique[pos]))
        if self.every_shard:  # an empty request where a shard owns none of the rows: it counts the clock
            requests = [req or [(0, torch.zeros(0, dtype=torch.int64))] for req in requests]
        handles = [(k, self.shards[k].start_pull(self.rank, req)) for k, req in enumerate(requests) if req]
        for k, handle in handles:
            for (sp, ids), got in zip(requests[k], self.shards[k].finish_pull(handle), strict=True):
                with torch.no_grad():
                    self.weights[sp][ids] = got.to(self.weights[sp].device)
                self.bytes_pulled += rows.wire_bytes(len(ids), got.shape[1])

    def _lookup(self, t: int, ids: torch.Tensor) -> None:
        if not self.enabled:
            return
        sp, flat = self.space[t], ids.reshape(-1)
        if sp not in self.pulled:
            if self.fused:
                raise RuntimeError("fused tables share one pull per step: prefetch every table's ids before forward")
            self.prefetch({t: ids})
            self._reads[t] = 1
            return
        expected = self._expected.get(t)
        if self._reads.get(t) == 0 and expected.shape == flat.shape and torch.equal(expected, flat):
            self._reads[t] = 1  # the ids it was prefetched with: pulled (one comparison instead of a search)
            return
        self._reads[t] = 2  # read otherwise or again: the push goes the long way (`_reuse`)
        if not _within(flat + self.base[t], self.pulled[sp]):
            raise RuntimeError(f"embedding table {t} reads rows this step did not pull (a table looked up twice "
                               "in one step, or a prefetch of other ids)")

    def push(self) -> None:
        """Push every table's summed row gradients: one request per shard, all shards at once."""
        grads = {t: (m.weight.grad,) for t, m in enumerate(self.tables)
                 if self.space[t] in self.pulled and m.weight.grad is not None}
        requests: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in self.shards]
        for sp, group in self._by_space(grads).items():
            reuse = self._reuse(sp, group)
            if reuse is not None:
                ids, summed, cuts = reuse
            else:
                ids = torch.cat([g._indices()[0] + self.base[t] for t, g in group])
                ids, summed = rows.sum_rows(ids, torch.cat([g._values().reshape(len(g._indices()[0]), -1)
                                                            for _, g in group]))
                cuts = [pos for pos, _ in rows.by_shard(self.partitions[sp], ids)]
            for k, pos in enumerate(cuts):
                if len(pos):
                    requests[k].append((sp, ids[pos], summed[pos]))
                    self.bytes_pushed += rows.wire_bytes(len(pos), summed.shape[1])
        for m in self.tables:
            m.weight.grad = None
        if self.every_shard:
            dim = self.weights[0].shape[1]
            requests = [req or [(0, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dim))] for req in requests]
        started = [k for k, req in enumerate(requests) if req]
        for k in started:
            self.shards[k].start_push(self.rank, requests[k])
        for k in started:
            self.shards[k].finish_push()
        self.pulled.clear()
        self._plan.clear()
        self._expected.clear()
        self._reads.clear()

    def _reuse(self, sp: int, group: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """The push of space `sp` from its prefetch's dedup and cut, when its gradients are exactly the
        prefetched lookups (the same tables in the same order, each read once with those ids, and the
        gradient's rows those ids in order, as nn.Embedding's sparse backward gives them): then
        `rows.sum_rows` would find the same distinct ids and inverse map and add the same rows in the
        same order, so the sums are bit for bit its own. None otherwise (the long way)."""
        plan = self._plan.get(sp)
        if plan is None or [t for t, _ in group] != plan[0] or any(self._reads.get(t) != 1 for t, _ in group):
            return None
        if not all(torch.equal(g._indices()[0], self._expected[t]) for t, g in group):
            return None
        values = torch.cat([g._values().reshape(len(self._expected[t]), -1) for t, g in group])
        summed = torch.zeros(len(self.pulled[sp]), values.shape[1], dtype=values.dtype, device=values.device)
        summed.index_add_(0, plan[1], values)
        return self.pulled[sp], summed, plan[2]


def make_local(model: nn.Module, shards: int, scheme: str, optimizer, fused: bool = False
               ) -> tuple[list[LocalShard], list[rows.RowPartition]]:
    """K shards' row stores for every table of `model`, in this process, initialised from its tables:
    one `RowPartition` per table, or with `fused` one over all of them (tables of one width). What K
    row servers would hold."""
    tables = [m.weight.detach() for _, m in embedding_tables(model)]
    if fused:
        partitions = [rows.RowPartition(sum(len(t) for t in tables), shards, scheme, tuple(len(t) for t in tables))]
        tables = [torch.cat(tables)]
    else:
        partitions = [rows.RowPartition(len(t), shards, scheme) for t in tables]
    stores = [[RowStore(p, k, t, optimizer) for t, p in zip(tables, partitions, strict=True)] for k in range(shards)]
    return [LocalShard(s) for s in stores], partitions


def assemble(shards: Sequence[LocalShard], table: int) -> torch.Tensor:
    """Store `table`'s rows whole again from the shards (fused: every table, one after another)."""
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
