"""Offline evaluation of parameter snapshots, after the run (so it never disturbs timing).

Contract: `evaluate(model, flat, x, y)` loads the flat fp32 vector into the model and returns
(mean cross-entropy, accuracy). `load_shard_snapshots(out, K)` joins the K shards' snapshots
taken at the same version into full vectors, ordered by version.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             batch: int = 4096) -> tuple[float, float]:
    torch.nn.utils.vector_to_parameters(flat.to(next(model.parameters()).device), model.parameters())
    model.eval()
    loss_sum, correct = 0.0, 0
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch])
        loss_sum += float(F.cross_entropy(logits, y[i:i + batch], reduction="sum"))
        correct += int((logits.argmax(1) == y[i:i + batch]).sum())
    return loss_sum / max(1, len(x)), correct / max(1, len(x))


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
