"""One sync step's gradients and their sum in worker order, with buffers reused: Sync's collaborator.

The arithmetic is psgd/core/rules.py `step_sum`: ((g0 + g1) + g2) + ..., in worker order (the same
bits every run, whatever the arrival order). This class computes exactly that sum while copying
as little as it can, since at 4.3M parameters one copy is a pass over 17 MB:

- a gradient that does not complete the step is held until the step is applied: in the caller's
  own buffer when the caller gives it up (`offered`: the shard's receive buffer), a spare of an
  earlier step going back in its place, else copied into a spare;
- the gradient that completes the step is read in the sum and never kept;
- the sum is built in a buffer the step already owns when it can, and every owned buffer goes
  back to the spares for later steps (at most `keep` of them).

Called with the policy's lock held; no lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepSum:
    def __init__(self) -> None:
        self.held: dict[int, torch.Tensor] = {}       # this step's gradients by worker, the policy's own
        self.last: tuple[int, torch.Tensor] | None = None  # the gradient that completes the step
        self.arrived = 0                               # gradients of this step, skipped ones included
        self.spares: list[torch.Tensor] = []           # buffers of earlier steps, reused

    def add(self, worker: int, grad: torch.Tensor | None, completes: bool,
            offered: bool) -> tuple[bool, torch.Tensor | None]:
        """Take `worker`'s gradient of this step (None: skipped); returns (kept the caller's buffer,
        the spare it gets instead)."""
        kept, spare = False, None
        if grad is not None:
            if completes:
                self.last = (worker, grad)  # read in the sum below, never kept
            elif offered:
                self.held[worker], kept, spare = grad, True, self._take_spare(grad)
            else:
                self.held[worker] = self._scratch(grad).copy_(grad)
        self.arrived += 1
        return kept, spare

    def apply(self, finish: Callable[[torch.Tensor, int], None], keep: int) -> bool:
        """Sum the step in worker order and call finish(sum, count); False (finish not called) when
        every gradient of the step was skipped. The step is empty afterwards, whatever finish does."""
        held, last = self.held, self.last
        self.arrived, self.held, self.last = 0, {}, None
        parts = dict(held)
        if last is not None:
            parts[last[0]] = last[1]
        owned = list(held.values())
        try:
            if not parts:
                return False
            order = [parts[w] for w in sorted(parts)]
            mine = [any(g is t for t in owned) for g in order[:2]]
            if len(order) == 1:
                total = order[0] if mine[0] else self._scratch(order[0]).copy_(order[0])
            elif mine[0]:
                total = order[0].add_(order[1])
            elif mine[1]:
                total = torch.add(order[0], order[1], out=order[1])  # a + b == b + a, bit for bit
            else:
                total = torch.add(order[0], order[1], out=self._scratch(order[0]))
            for g in order[2:]:
                total.add_(g)
            owned.append(total)
            finish(total, len(order))
            return True
        finally:
            # Back for later steps (the completing caller's buffer is never among them).
            self.spares.extend({id(t): t for t in owned}.values())
            del self.spares[keep:]

    def _take_spare(self, like: torch.Tensor) -> torch.Tensor | None:
        for i, t in enumerate(self.spares):
            if t.shape == like.shape and t.dtype == like.dtype:
                return self.spares.pop(i)
        return None

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        buf = self._take_spare(like)
        return torch.empty_like(like) if buf is None else buf
