"""Embedding rows owned by key: which shard holds a row, and the rows a batch touches, deduplicated.

The dense path splits one flat vector into K contiguous ranges (sharding.py). An embedding table is
different: a batch reads a few of its rows, so a parameter server keeps each table by row and moves
only the rows asked for (Li et al. 2014, "Scaling distributed machine learning with the parameter
server": key ranges; TorchRec's row-wise sharding). Pure module (torch tensors, no transport).

Contract:
- `RowPartition(rows, shards, scheme)`: table rows [0, rows) among `shards` shards.
  `range`: shard k holds the contiguous ids `sharding.shard_ranges(rows, shards)[k]`, so ids that
  are close share a shard; with ids numbered by frequency (psgd/train/clicks.py: id 0 the hottest)
  the first shard takes every hot id. `hash`: id i goes to shard floor(h(i) x K / 2^32), h Knuth's
  multiplicative hash of i mod 2^32 (i x 2654435761 mod 2^32), which scatters neighbours: hot ids
  spread over the shards. Both are deterministic functions of (rows, shards, scheme).
  `owner(ids)` the shard of each id; `local(ids)` its row in that shard's block (the shard's rows
  kept in id order, so block row j of shard k is `owned(k)[j]`); `share()` rows per shard.
  `RowPartition(sum(V), K, scheme, tables=V)` fuses tables of V_t rows into one id space, each
  partitioned as if alone (`bases`: where each table's ids start).
- `dedup(ids)`: the distinct ids (sorted) and the inverse map, so `unique[inverse] == ids`: what a
  worker pulls (each row once) and how it spreads the rows back over the batch.
- `sum_rows(ids, grads)`: one gradient per distinct id, the sum of that id's rows of `grads`
  (added in the order they come, from zero: the arithmetic of `index_add_`), with the distinct
  ids sorted. What a worker pushes.
- `by_shard(partition, ids)`: for each shard, (positions in `ids` of the ids it owns, their local
  rows): how one pull or push of distinct ids is cut into per-shard requests.
- `lookups_per_shard(partition, ids)`: ids (with repetition) each shard serves, the load a
  batch puts on it; `wire_bytes(rows, dim)`: what moving `rows` rows and their ids costs.
Tests: tests/test_rows.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from psgd.core.sharding import shard_ranges

SCHEMES = ("hash", "range")
KNUTH = 2654435761           # Knuth's multiplicative hash constant, about 2^32 / golden ratio
MAX_ROWS = 1 << 31           # id x KNUTH stays below 2^63: no int64 overflow in `owner`
ID_BYTES = 8                 # ids travel as int64


@dataclass(frozen=True)
class RowPartition:
    rows: int                 # the table's rows
    shards: int               # K
    scheme: str = "hash"      # one of SCHEMES
    # Several tables fused into one id space (table t's id i is `bases[t] + i`), each partitioned by
    # the scheme on its own ids, as if alone: () for one table. TorchRec's table-batched embeddings
    # fuse tables likewise, so that a step asks each shard once, not once per table.
    tables: tuple[int, ...] = ()
    _owner: torch.Tensor = field(init=False, repr=False, compare=False)  # shard of every id: one gather per call
    _local: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"row partition scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.shards < 1:
            raise ValueError(f"a row partition needs >= 1 shard, got {self.shards}")
        if not 0 <= self.rows < MAX_ROWS:
            raise ValueError(f"a table's rows must be in [0, 2^31), got {self.rows}")
        if self.tables and sum(self.tables) != self.rows:
            raise ValueError(f"fused tables of {sum(self.tables)} rows in all cannot make {self.rows} rows")
        ids = torch.arange(self.rows, dtype=torch.int64)
        owners = (torch.cat([self._owners(torch.arange(v, dtype=torch.int64), v) for v in self.tables])
                  if self.tables else self._owners(ids, self.rows))
        object.__setattr__(self, "_owner", owners)
        # Block row of each id: its rank among the ids of its shard, in id order.
        counts = torch.bincount(owners, minlength=self.shards)
        starts = torch.cumsum(counts, 0) - counts
        order = torch.argsort(owners, stable=True)
        local = torch.empty_like(ids)
        local[order] = ids - starts[owners[order]]
        object.__setattr__(self, "_local", local)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The shard of each id (int64, ids' shape)."""
        return self._owner[self._checked(ids)]

    @property
    def bases(self) -> list[int]:
        """Where each fused table's ids start ([0] for one table)."""
        sizes = self.tables or (self.rows,)
        return [sum(sizes[:t]) for t in range(len(sizes))]

    def _owners(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """The scheme itself on a table of `rows` (see the module docstring), once per id at construction."""
        if self.scheme == "range":
            stops = torch.tensor([hi for _, hi in shard_ranges(rows, self.shards)], dtype=torch.int64)
            return torch.searchsorted(stops, ids, right=True)
        h = (ids * KNUTH) & 0xFFFFFFFF
        return (h * self.shards) >> 32

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in its shard's block."""
        return self._local[self._checked(ids)]

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner, local) of each id, the ids checked once."""
        ids = self._checked(ids)
        return self._owner[ids], self._local[ids]

    def owned(self, shard: int) -> torch.Tensor:
        """The ids shard `shard` holds, in block order (id order)."""
        return torch.nonzero(self._owner == shard, as_tuple=True)[0]

    def share(self) -> list[int]:
        """Rows each shard holds."""
        return torch.bincount(self._owner, minlength=self.shards).tolist()

    def _checked(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.int64:
            raise ValueError(f"row ids must be int64, got {ids.dtype}")
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= self.rows:
                bad = ids[(ids < 0) | (ids >= self.rows)][0]
                raise ValueError(f"row id {int(bad)} out of range for a table of {self.rows} rows")
        return ids


def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct ids sorted, inverse) of a batch's ids, any shape: unique[inverse] == ids."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return unique, inverse


def sum_rows(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct ids sorted, one summed gradient row each) of `grads` (len(ids), dim) by `ids`."""
    if ids.dim() != 1 or grads.dim() != 2 or len(ids) != len(grads):
        raise ValueError(f"sum_rows takes ids (n,) and grads (n, dim), got {tuple(ids.shape)} and "
                         f"{tuple(grads.shape)}")
    unique, inverse = dedup(ids)
    summed = torch.zeros(len(unique), grads.shape[1], dtype=grads.dtype, device=grads.device)
    summed.index_add_(0, inverse, grads)
    return unique, summed


def by_shard(partition: RowPartition, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each shard k: (positions in `ids` of the ids k owns, in order; their rows in k's block)."""
    owners, local = partition.locate(ids)
    out = []
    for k in range(partition.shards):
        pos = torch.nonzero(owners == k, as_tuple=True)[0]
        out.append((pos, local[pos]))
    return out


def lookups_per_shard(partition: RowPartition, ids: torch.Tensor) -> list[int]:
    """How many of `ids` (repetitions counted) each shard serves."""
    return torch.bincount(partition.owner(ids.reshape(-1)), minlength=partition.shards).tolist()


def wire_bytes(rows: int, dim: int, value_bytes: int = 4) -> int:
    """Bytes of `rows` rows of `dim` values and their ids: a sparse pull's or push's payload."""
    return rows * (dim * value_bytes + ID_BYTES)
