"""When a shard's embedding rows answer a pull and take a push: sync, async and SSP for the rows.

The dense shard's policy (psgd/core/consistency.py, the rules of psgd/core/rules.py) decides for
the flat vector; this decides the same for one shard's row stores (psgd/core/rowstore.py), with
the same rule objects' `may_read`, so that a run's mode means one thing for both parts (or, in
the hybrid mode, async for the rows beside sync for the dense part: Persia's scheme, Lian et al.
2022). A worker's n-th pull and n-th push to a shard are its clock n (psgd/train/rowexchange.py
sends every shard one pull and one push per step, empty ones included, so the counts are clocks).

Contract: `RowRounds(stores, mode, workers, staleness)`, mode one of `MODES`.
- `pull(worker, checked, timeout)`: waits until the rule lets clock `pulls[worker]` read (sync:
  every round before it applied; SSP: at most `staleness` clocks ahead of the slowest worker
  still in; async: never waits) and the stores have their initial rows (`init` came), then
  applies the checked pulls (`RowStore.check_pull`'s) and returns their rows; None when
  `timeout` seconds passed first (nothing changed).
- `push(worker, checked)`: async and SSP apply each store's checked push at once; sync keeps it
  until every worker still in pushed this round, then applies the round, store by store, as one
  update of the gradients' mean, summed in worker order (`RowStore.apply_round`): what the
  dense Sync does to its slice, so sync with rows gives the dense path's parameters.
- `restore(version, clocks)`: a checkpoint's version, each worker at its clock (its next pull and push).
- `leave(worker)`: the worker is gone (its connection closed); a round waits for it no longer.
- `version`: updates applied (sync: rounds; else pushes). Thread-safe: one condition guards the
  clocks, the round and the order in which the stores change.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from psgd.core import rules
from psgd.core.rowstore import Checked, RowStore

MODES = ("sync", "async", "ssp")


class RowRounds:
    def __init__(self, stores: Sequence[RowStore], mode: str = "async", workers: int = 1, staleness: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"row mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.stores, self.mode = list(stores), mode
        self.rule = rules.make(mode, staleness=staleness)
        self.active = set(range(workers))
        self.pulls: dict[int, int] = {}
        self.pushes: dict[int, int] = {}
        self.pending: dict[int, list[tuple[int, Checked]]] = {}  # sync: this round's pushes by worker
        self.version = 0
        self.cond = threading.Condition()

    def _slowest(self) -> int:
        return min((self.pushes.get(w, 0) for w in self.active), default=1 << 62)

    def _may_read(self, clock: int) -> bool:
        return all(s.initialised for s in self.stores) and self.rule.may_read(self.version, clock, self._slowest())

    def pull(self, worker: int, checked: list[tuple[int, Checked]], timeout: float) -> list[torch.Tensor] | None:
        with self.cond:
            clock = self.pulls.get(worker, 0)
            if not self.cond.wait_for(lambda: self._may_read(clock), timeout):
                return None
            self.pulls[worker] = clock + 1
            return [self.stores[t].apply(c) for t, c in checked]

    def push(self, worker: int, checked: list[tuple[int, Checked]]) -> None:
        with self.cond:
            self.pushes[worker] = self.pushes.get(worker, 0) + 1
            if self.mode == "sync":
                self.pending[worker] = checked
                self._close_round()
            else:
                for t, c in checked:
                    self.stores[t].apply(c)
                self.version += 1
            self.cond.notify_all()

    def init(self, entries: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Give the stores their initial rows ((table, ids, values); a store that has them ignores it)."""
        with self.cond:
            for t, ids, values in entries:
                self.stores[t].init(ids, values)
            self.cond.notify_all()

    def restore(self, version: int, clocks: Sequence[int]) -> None:
        """Start at a checkpoint: `version` updates applied, worker w at clock `clocks[w]` (the dense
        shard's, where a restored run's workers resume) for its next pull and push alike."""
        with self.cond:
            self.version = version
            self.pulls = dict(enumerate(clocks))
            self.pushes = dict(enumerate(clocks))
            self.cond.notify_all()

    def leave(self, worker: int) -> None:
        with self.cond:
            self.active.discard(worker)
            if self.mode == "sync":
                self._close_round()
            self.cond.notify_all()

    def _close_round(self) -> None:
        """Sync: apply the round once every worker still in has pushed to it (a gone worker's push
        of the round, if it made one, is in it: its gradient was computed for this step)."""
        if not self.pending or not all(w in self.pending for w in self.active):
            return
        for t, store in enumerate(self.stores):
            store.apply_round([c for w in sorted(self.pending) for tt, c in self.pending[w] if tt == t],
                              len(self.pending))
        self.pending.clear()
        self.version += 1
