"""One shard's rows of one embedding table: pulls and pushes by key, checked, without a transport.

What a shard keeps for a table it owns part of (psgd/core/rows.py `RowPartition`): the block of its
rows (in id order), the row-wise optimizer over that block (psgd/core/rowoptim.py) and the
per-row clock (psgd/core/rowclock.py). The dense part of a model stays on the dense `Shard`
(psgd/ps/shard.py) as today; this is the piece a sparse request reaches.

Contract: `RowStore(partition, shard, table, optimizer)`: `table` the full initial table (rows,
dim), of which the store copies the rows it owns; `optimizer` a factory block -> RowOptimizer
(`functools.partial(RowAdagrad, lr=0.05)`).
- `pull(worker, ids)` -> (len(ids), dim) a copy of the rows: `ids` distinct, sorted, owned here.
  Notes the rows' update counts for the worker's push.
- `push(worker, ids, grads, count)` applies one summed gradient per row to those rows alone and
  returns their per-row staleness; `count` is the row count the request announced.
- Both in two phases when a request spans tables: `check_pull` / `check_push` (every check, no
  change) return a `Checked` that `apply` carries out.
- Bad input (an id out of range or owned by another shard, a duplicate or unsorted id, a count or
  width that does not match, a row the worker's last pull did not read) raises `RowError` with
  one line, and the store is unchanged: every check runs before the first write. An adapter
  answers it as INVALID_ARGUMENT (the dense path's checks: psgd/ps/shard.py).
- `bytes_in` / `bytes_out`: payload bytes of the pushes taken and pulls served (rows x dim x 4
  plus 8 per id, `rows.wire_bytes`): accounting by construction, not a measurement of a wire.
- `snapshot()` the full table's rows this store owns, as (ids, block) copies.
- `state()` / `load(state)`: the store in a shard's checkpoint (its rows, the optimizer's state,
  the rows' update counts) and back; a loaded store is initialised (an INIT after it is ignored).
- `initialised=False`: the store holds zeros until `init(ids, values)` gives it its rows (a
  worker's seeded table, psgd/ps/rows_tcp.py's INIT; the first one wins, as the dense Init does).
- `apply_round(checked, divisor)`: a sync round, every worker's checked push of one step as one
  update: the gradients summed row by row in the order given (worker order: the dense shard's
  step sum, psgd/core/stepsum.py, adds zeros where a worker did not touch a row, and x + 0 is x),
  divided by `divisor` (the workers), one optimizer step on the union of their rows.
Thread-safe: one lock guards the block, the optimizer's state, the clock and the counters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from psgd.core import rows
from psgd.core.rowclock import RowClock
from psgd.core.rowoptim import RowOptimizer


class RowError(ValueError):
    """A sparse request the store refuses; the message is one line."""


@dataclass(frozen=True)
class Checked:
    """A request that passed every check of one store (`check_pull` / `check_push`), to `apply`."""
    worker: int
    local: torch.Tensor                 # block rows
    grads: torch.Tensor | None          # None: a pull
    at: torch.Tensor | None             # where the rows sit in the worker's last pull (a push)


class RowStore:
    def __init__(self, partition: rows.RowPartition, shard: int, table: torch.Tensor,
                 optimizer: Callable[[torch.Tensor], RowOptimizer], initialised: bool = True) -> None:
        if table.dim() != 2 or table.shape[0] != partition.rows:
            raise ValueError(f"a table of {partition.rows} rows must be (rows, dim), got {tuple(table.shape)}")
        if not 0 <= shard < partition.shards:
            raise ValueError(f"shard {shard} out of range for {partition.shards} shards")
        self.partition, self.shard = partition, shard
        self.ids = partition.owned(shard)                 # global id of each block row
        self.block = table.detach()[self.ids].clone().float()
        self.optimizer = optimizer(self.block)
        self.clock = RowClock(len(self.ids))
        self.bytes_in = self.bytes_out = 0
        self.initialised = initialised
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        return int(self.block.shape[1])

    def pull(self, worker: int, ids: torch.Tensor) -> torch.Tensor:
        return self.apply(self.check_pull(worker, ids))

    def push(self, worker: int, ids: torch.Tensor, grads: torch.Tensor, count: int) -> torch.Tensor:
        return self.apply(self.check_push(worker, ids, grads, count))

    # Two phases, for a request that spans several tables (psgd/ps/rows_tcp.py): every table's
    # checks first, then every table's change, so a refused table leaves the others unchanged too.
    # Between the two only the same worker could move its own note, and a worker waits for its answer.
    def check_pull(self, worker: int, ids: torch.Tensor) -> Checked:
        return Checked(worker, self._local(ids), None, None)

    def check_push(self, worker: int, ids: torch.Tensor, grads: torch.Tensor, count: int) -> Checked:
        if count != len(ids) or grads.dim() != 2 or grads.shape != (len(ids), self.dim):
            raise RowError(f"a push announced {count} rows and carries {len(ids)} ids and gradients of shape "
                           f"{tuple(grads.shape)}; each row needs one gradient of width {self.dim}")
        local = self._local(ids)
        with self._lock:
            try:
                at = self.clock.check(worker, local, names=ids, trusted=True)
            except ValueError as e:
                raise RowError(str(e)) from None
        return Checked(worker, local, grads.to(self.block.dtype), at)

    def apply(self, req: Checked) -> torch.Tensor:
        """A checked pull's rows (a copy), or a checked push's per-row staleness."""
        with self._lock:
            if req.grads is None:
                self.clock.pulled(req.worker, req.local, trusted=True)
                self.bytes_out += rows.wire_bytes(len(req.local), self.dim)
                return self.block[req.local]  # advanced indexing: a copy
            self.optimizer.step(req.local, req.grads, trusted=True)
            self.bytes_in += rows.wire_bytes(len(req.local), self.dim)
            return self.clock.applied(req.worker, req.local, trusted=True, at=req.at)

    def init(self, ids: torch.Tensor, values: torch.Tensor) -> bool:
        """Take the store's rows (`ids` exactly the ids it owns, in order) unless it has them; returns
        whether this call did. RowError for ids or a shape that do not match."""
        if not torch.equal(ids, self.ids) or tuple(values.shape) != tuple(self.block.shape):
            raise RowError(f"an init must carry this shard's {len(self.ids)} rows of width {self.dim} in id order, "
                           f"got {len(ids)} ids and values of shape {tuple(values.shape)}")
        with self._lock:
            if self.initialised:
                return False
            self.block.copy_(values)
            self.initialised = True
            return True

    def apply_round(self, checked: list[Checked], divisor: int) -> None:
        """Checked pushes of one sync round (worker order) as one update; see the module docstring."""
        with self._lock:
            union = torch.unique(torch.cat([c.local for c in checked])) if checked else self.ids[:0]
            total = torch.zeros(len(union), self.dim, dtype=self.block.dtype)
            for c in checked:
                total.index_add_(0, torch.searchsorted(union, c.local), c.grads)
                self.bytes_in += rows.wire_bytes(len(c.local), self.dim)
            self.optimizer.step(union, total.div_(divisor), trusted=True)
            self.clock.applied_round([(c.worker, c.local, c.at) for c in checked], union)

    def state(self) -> dict:
        """What a checkpoint keeps of the store (copies): its rows, the optimizer's state, each row's
        update count. Not the workers' pull notes: a restored run's workers pull before they push."""
        with self._lock:
            return {"ids": self.ids.clone(), "block": self.block.clone(), "optimizer": self.optimizer.state_dict(),
                    "updates": self.clock.updates.clone()}

    def load(self, state: dict) -> None:
        """Take a checkpoint's `state()` of this store: RowError, and the store unchanged, if it is
        another shard's or table's rows."""
        if not torch.equal(state["ids"], self.ids) or tuple(state["block"].shape) != tuple(self.block.shape):
            raise RowError(f"the checkpoint holds {len(state['ids'])} rows of width {state['block'].shape[-1]}; "
                           f"this store owns {len(self.ids)} rows of width {self.dim}")
        with self._lock:
            self.optimizer.load_state_dict(state["optimizer"])
            self.block.copy_(state["block"])
            self.clock.updates.copy_(state["updates"])
            self.initialised = True

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            return self.ids.clone(), self.block.clone()

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        """Block rows of `ids`, RowError unless they are distinct, sorted, in range and owned here."""
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise RowError(f"row ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise RowError("row ids must be distinct and sorted (rows.dedup gives them so)")
        try:
            owners, local = self.partition.locate(ids)
        except ValueError as e:
            raise RowError(str(e)) from None
        if ids.numel() and not bool((owners == self.shard).all()):
            other = ids[owners != self.shard][0]
            raise RowError(f"row {int(other)} is held by shard {int(self.partition.owner(other[None])[0])}, "
                           f"not by shard {self.shard}")
        return local  # sorted ids of one shard: block rows sorted too (the block is in id order)
