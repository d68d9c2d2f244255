"""Offline evaluation of parameter snapshots, after the run (so it never disturbs timing).

Contract: `evaluate(model, flat, x, y, loss)` loads the flat fp32 vector into the model and returns
(mean loss, accuracy): the loss is the run's (`--loss`, psgd/train/losses.py; mean cross-entropy by
default, each batch's mean weighted by its size for another loss), and the accuracy is None
unless the loss is cross-entropy (top-1, over every target: per token for a sequence model).
`load_shard_snapshots(out, K)` joins the K shards' snapshots taken at the same version into full
vectors, ordered by version.
`each_snapshot(snaps, on_progress)` hands them out one at a time, telling `on_progress(k, n)`
before the k-th of n is evaluated (the live line's "evaluating k/n": psgd/train/progress.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from psgd.train import losses

EVAL_ELEMENTS = 1 << 16  # input elements per evaluation batch (see `evaluate`)


@torch.no_grad()
def evaluate(model: nn.Module, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, loss: str = "cross_entropy",
             batch: int | None = None) -> tuple[float, float | None]:
    torch.nn.utils.vector_to_parameters(flat.to(next(model.parameters()).device), model.parameters())
    if batch is None:
        # Sized by elements, not rows: 4096 rows of a 40-feature MNIST-1D sample are nothing, 4096
        # windows of 64 tokens through a transformer took the launcher's peak RSS from 0.2 to 2.2 GB.
        per_row = max(1, x[0].numel() if len(x) else 1)
        batch = max(1, min(4096, EVAL_ELEMENTS // per_row))
    model.eval()
    fn, classifies = losses.get(loss), losses.classifies(loss)
    loss_sum, correct, targets = 0.0, 0, 0
    for i in range(0, len(x), batch):
        out, yb = model(x[i:i + batch]), y[i:i + batch]
        if classifies:
            loss_sum += float(losses.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(-1) == yb).sum())
            targets += yb.numel()
        else:
            loss_sum += float(fn(out, yb)) * len(yb)
    if classifies:  # per target: the cross-entropy's own mean (per token for a sequence model)
        return loss_sum / max(1, targets), correct / max(1, targets)
    return loss_sum / max(1, len(x)), None


def load_shard_snapshots(out: Path, num_shards: int) -> list[tuple[int, float, torch.Tensor]]:
    """(version, unix time, full flat params) for every version that all shards snapshotted."""
    per_shard = []
    for k in range(num_shards):
        saved = torch.load(out / f"shard-{k}.pt", weights_only=True)
        per_shard.append({v: (t, p) for v, t, p in saved["snapshots"]})
    common = sorted(set.intersection(*(set(s) for s in per_shard)))
    return [(v, max(s[v][0] for s in per_shard), torch.cat([s[v][1] for s in per_shard])) for v in common]


def load_final_params(out: Path, num_shards: int) -> torch.Tensor:
    """The last snapshot of every shard (its parameters at shutdown), joined."""
    parts = [torch.load(out / f"shard-{k}.pt", weights_only=True)["snapshots"][-1][2] for k in range(num_shards)]
    return torch.cat(parts)


def each_snapshot(snaps: Sequence, on_progress: Callable[[int, int], None] | None = None) -> Iterator:
    """The snapshots in order; `on_progress(k, n)` is told before the k-th (1-based) of the n is
    handed out, so a caller's evaluation of it can be shown as under way."""
    for k, snap in enumerate(snaps, 1):
        if on_progress is not None:
            on_progress(k, len(snaps))
        yield snap
