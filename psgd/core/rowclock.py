"""Per-row staleness: how many updates a row took between a worker's pull of it and its push.

psgd's global staleness (policy.py) counts the shard's updates between a pull and the push that
answers it: with N async workers about N - 1, whatever the model. An embedding row changes only
when a push names it, so a gradient for a cold row is computed on a row nobody else touched in
between: its own staleness is 0 even when the global one is N - 1. That gap is the mechanism by
which async SGD costs a sparse model less than a dense one (the seed article's "recommender
systems and other sparse settings"; Recht et al. 2011, Hogwild!, make the same sparsity argument).

Contract: `RowClock(rows)` keeps, for each row of one table, the updates it took (`updates`).
`pulled(worker, ids)` notes the update count of each row the worker read (distinct ids; a later
pull by the same worker replaces the note); `applied(worker, ids)` is called as the push of those
rows is applied: it returns each row's staleness (its updates now minus at the pull), adds one
update to each, and tallies the values in `histogram` (staleness -> rows). A push may name only
rows the worker's last pull read (ValueError otherwise, nothing counted): a row's gradient is
computed from the value pulled. Not thread-safe: the shard calls it under its lock. Pure module.
"""

from __future__ import annotations

from collections import Counter

import torch


class RowClock:
    def __init__(self, rows: int) -> None:
        self.updates = torch.zeros(rows, dtype=torch.int64)
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # worker -> (sorted ids, their counts)
        self.histogram: Counter[int] = Counter()

    def pulled(self, worker: int, ids: torch.Tensor, trusted: bool = False) -> None:
        """`trusted`: the caller has checked `ids` (distinct, sorted, in range), as RowStore does."""
        ids = ids if trusted else self._checked(ids)
        self._seen[worker] = (ids, self.updates[ids])  # advanced indexing: a copy

    def applied(self, worker: int, ids: torch.Tensor, trusted: bool = False,
                at: torch.Tensor | None = None) -> torch.Tensor:
        """`at`: what `check` returned for these ids, when the caller checked them just before."""
        at = self.check(worker, ids, trusted=trusted) if at is None else at
        staleness = self.updates[ids] - self._seen[worker][1][at]
        self.updates[ids] += 1
        self.histogram.update(staleness.tolist())
        return staleness

    def applied_round(self, pushes: list[tuple[int, torch.Tensor, torch.Tensor]], union: torch.Tensor) -> None:
        """A sync round: every worker's push of one step applied as one update. `pushes` are
        (worker, ids, at) with `at` what `check` returned; `union` the distinct ids of all of them.
        Each row's staleness is counted against the updates before the round, and each row of
        `union` takes one update, however many workers pushed it (the round is one update)."""
        for worker, ids, at in pushes:
            self.histogram.update((self.updates[ids] - self._seen[worker][1][at]).tolist())
        self.updates[union] += 1

    def check(self, worker: int, ids: torch.Tensor, names: torch.Tensor | None = None,
              trusted: bool = False) -> torch.Tensor:
        """ValueError unless `applied(worker, ids)` would be accepted; else where ids sit in the pull.
        `names`: what to call each of `ids` in the message (a shard's global ids for its block rows)."""
        ids = ids if trusted else self._checked(ids)
        if worker not in self._seen:
            raise ValueError(f"worker {worker} pushes rows it never pulled")
        seen_ids = self._seen[worker][0]
        at = torch.searchsorted(seen_ids, ids).clamp_(max=max(0, len(seen_ids) - 1))
        if len(ids) and (len(seen_ids) == 0 or not torch.equal(seen_ids[at], ids)):
            names = ids if names is None else names
            missing = names[seen_ids[at] != ids] if len(seen_ids) else names
            raise ValueError(f"worker {worker} pushes row {int(missing[0])}, which its last pull did not read")
        return at

    def forget(self, worker: int) -> None:
        """Drop a departed worker's note."""
        self._seen.pop(worker, None)

    def mean(self) -> float:
        """Mean staleness over every row gradient applied so far (0 when none)."""
        n = sum(self.histogram.values())
        return sum(s * c for s, c in self.histogram.items()) / n if n else 0.0

    def _checked(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"row ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        if ids.numel():
            if int(ids.min()) < 0 or int(ids.max()) >= len(self.updates):
                raise ValueError(f"a row id is out of range for a table of {len(self.updates)} rows")
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise ValueError("row ids must be distinct and sorted (rows.dedup gives them so)")
        return ids
