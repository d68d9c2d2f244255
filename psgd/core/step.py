"""What a gradient exchange gives the training loop: the types both sides agree on.

The worker loop (psgd/train/worker.py) drives an `Exchange` and reads `StepReport`s; the PS
exchange (psgd/ps/exchange.py) and the all-reduce exchange (psgd/allreduce/collective.py)
implement it. The types live here, below both, so that neither side imports the other.

`Flat` is what an exchange needs of the model: one flat fp32 parameter buffer and one flat
gradient buffer that every parameter and gradient of the model is a view of
(psgd/train/models.py `FlatParams` is the implementation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class Flat(Protocol):
    params: torch.Tensor  # every model parameter is a view of this buffer
    grads: torch.Tensor   # every parameter's .grad is a view of this one

    def rehome(self, params: torch.Tensor, grads: torch.Tensor) -> None:
        """Move both buffers into these (memory a transport lends); every view follows."""


@dataclass
class StepReport:
    """What an exchange did in one call; `done` ends the loop. Times exclude `wait_s`."""
    done: bool = False
    counted: bool = True      # after_compute: the gradient was taken (not refused for budget)
    pull_s: float = 0.0
    push_s: float = 0.0
    wait_s: float = 0.0
    bytes_pulled: int = 0
    bytes_pushed: int = 0
    clock_gap: int = 0
    overlapped_s: float = 0.0  # after_compute: exchange time spent blocked inside forward / backward
                               # (--overlap); already in pull_s / push_s, so not counted as compute
    compute_s: float = 0.0     # after_compute: compute done by the exchange (local SGD's optimizer step)
    version: int = -1          # before_compute (PS): the first shard's version of the pulled parameters


class Exchange(Protocol):
    def setup(self, flat: Flat, rank: int) -> None:
        """Agree on initial parameters (PS: chief offers them; all-reduce: broadcast)."""

    def before_compute(self, clock: int, flat: Flat) -> StepReport:
        """Make flat.params current for step `clock`."""

    def after_compute(self, clock: int, flat: Flat) -> StepReport:
        """Deliver flat.grads of step `clock`."""

    def close(self, failed: bool = False) -> None:
        """Release everything; called once, also when the loop failed (`failed`: then quickly,
        without waiting for peers or in-flight transfers)."""

    # Optional: `watch(model, flat)`, called once after setup, for an exchange that overlaps
    # with compute through hooks on the model (PS `--overlap`, psgd/ps/exchange.py).
