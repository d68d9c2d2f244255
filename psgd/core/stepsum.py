"""One sync step's gradients and their sum in worker order: the one step sum of psgd, which the
textbook (psgd/core/textbook.py) and production's Sync (psgd/core/sync.py) both take.

The arithmetic: ((g0 + g1) + g2) + ..., in worker order, whatever order the gradients arrived in.
Float addition is not associative, so with 3 or more workers the arrival order would change the
sum's last bits and two identical runs would end apart; worker order is the same every run.
Divided once by the count, it is within float rounding of one process computing the whole global
batch. This class computes exactly that sum while holding as few buffers as it can, since at 4.3M
parameters one buffer is 17 MB and N of them grow with N:

- the running sum (`total`) is the sum of a prefix of the step's workers in worker order. A
  gradient whose every lower-ranked worker of the step has been folded or will not come (the
  policy says so with `upto`, the lowest worker still due) is folded at once: the first becomes
  the sum (the caller's own buffer when it gives it up, `offered`, a spare going back in its
  place), later ones are added into it and never kept;
- a gradient that comes ahead of its turn is held until its turn (in the caller's buffer when
  offered, else copied into a spare). Sync's shards make every push wait for its turn before
  its bytes are read (`Sync.turn`), so on that path nothing is ever held and a step costs the
  sum and the one buffer being received; a caller that does not wait (the textbook, tests,
  backup workers) has each gradient copied until the step is complete, then summed in order;
- the gradient that completes the step is read in the sum and never kept;
- the sum goes back to the spares for later steps (at most `keep` of them), and so does every
  held buffer once folded.

Called with the policy's lock held; no lock of its own. `allocated` counts the gradient-sized
buffers this object ever made (a test bounds it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepSum:
    def __init__(self) -> None:
        self.total: torch.Tensor | None = None         # the folded prefix's sum, the policy's own
        self.held: dict[int, torch.Tensor] = {}       # gradients ahead of their turn, the policy's own
        self.last: tuple[int, torch.Tensor] | None = None  # the gradient that completes the step
        self.arrived = 0                               # gradients of this step, skipped ones included
        self.folded = 0                                # gradients in `total`
        self.spares: list[torch.Tensor] = []           # buffers of earlier steps, reused
        self.allocated = 0

    def add(self, worker: int, grad: torch.Tensor | None, completes: bool, offered: bool = False,
            upto: int = 0) -> tuple[bool, torch.Tensor | None]:
        """Take `worker`'s gradient of this step (None: skipped); `completes`: it is the step's last
        (`apply` comes next); `offered`: the caller gives up `grad`'s memory (else it is copied, or
        read in the sum); `upto`: every worker below it has given its gradient of this step or will
        not (0: fold nothing before `apply`). Returns (kept the caller's buffer, the spare it gets
        instead)."""
        kept, spare = False, None
        if completes:  # `apply` folds everything left, this one in its place
            if grad is not None:
                self.last = (worker, grad)  # read in the sum by `apply`, never kept
        elif grad is not None:
            if worker < upto:  # its turn: into the running sum, after any held one below it
                self._fold_held(worker)
                if self.total is None and offered:
                    self.total, kept, spare = grad, True, self._take_spare(grad)
                    self.folded += 1
                else:
                    self._fold(grad, owned=False)
            elif offered:
                self.held[worker], kept, spare = grad, True, self._take_spare(grad)
            else:
                self.held[worker] = self._scratch(grad).copy_(grad)
        if not completes:
            self._fold_held(upto)
        self.arrived += 1
        return kept, spare

    def apply(self, finish: Callable[[torch.Tensor, int], None], keep: int) -> bool:
        """Fold the rest of the step in worker order and call finish(sum, count); False (finish not
        called) when every gradient of the step was skipped. The step is empty afterwards, whatever
        finish does."""
        rest = dict(self.held)
        if self.last is not None:
            rest[self.last[0]] = self.last[1]
        owned = [g for w, g in rest.items() if self.last is None or w != self.last[0]]
        try:
            for w in sorted(rest):
                self._fold(rest[w], owned=any(rest[w] is t for t in owned))
            if self.total is None:
                return False
            finish(self.total, self.folded)
            return True
        finally:
            # Back for later steps (the completing caller's buffer is never among them).
            if self.total is not None:
                self.spares.append(self.total)
            self.spares.extend(t for t in owned if t is not self.total and all(t is not s for s in self.spares))
            del self.spares[keep:]
            self.total, self.held, self.last, self.arrived, self.folded = None, {}, None, 0, 0

    def _fold_held(self, upto: int) -> None:
        for w in sorted(w for w in self.held if w < upto):
            self._fold(self.held.pop(w), owned=True)

    def _fold(self, grad: torch.Tensor, owned: bool) -> None:
        """Add `grad` to the running sum (the sum's first part: `grad` itself when it is the step's
        own buffer, else a copy). a + b is the same bits whichever buffer holds the result."""
        if self.total is None:
            self.total = grad if owned else self._scratch(grad).copy_(grad)
        else:
            self.total.add_(grad)
            if owned:
                self.spares.append(grad)
        self.folded += 1

    def _take_spare(self, like: torch.Tensor) -> torch.Tensor | None:
        for i, t in enumerate(self.spares):
            if t.shape == like.shape and t.dtype == like.dtype:
                return self.spares.pop(i)
        return None

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        buf = self._take_spare(like)
        if buf is None:
            self.allocated += 1
            buf = torch.empty_like(like)
        return buf
