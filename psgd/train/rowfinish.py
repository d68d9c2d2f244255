"""A run with embedding rows by key, at its end: whole-model snapshots to evaluate, and the rows' figures.

The dense shards' snapshots (psgd/train/evaluate.py) hold every parameter but the tables; the row
services wrote theirs beside them at the same versions (OUT/rows-K.pt, psgd/train/rowshard.py).
`full(out, cfg, model, snaps, final)` joins them: for each version every shard has, the model's
flat vector in its own parameter order (what `evaluate.evaluate` loads), and the final one.
`summary_extra(out, cfg)`: summary.json's rows part (`rows`):
- `staleness`: the per-row staleness over every row gradient applied (psgd/core/rowclock.py:
  updates a row took between the pull and the push), beside the global `staleness` (updates of
  the whole shard in between), with the same mean / p50 / p99 / max / hist;
- per shard: `share` (rows held), `load` (rows pulled and pushed through it), `bytes` (payload in
  and out, `rows.wire_bytes`: accounting by construction), and the `mode` the rows ran under.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from psgd.core.config import RunConfig
from psgd.train.dlrm import embedding_tables
from psgd.train.metrics import hist_stats


def _tables(saved: list[dict], at: list[int], shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each table whole from the shards' blocks of one snapshot (`at[k]`: its index in shard k's);
    one store for every table (fused, psgd/train/rowshard.py `fusable`) is cut back into them."""
    fused = len(saved[0]["ids"]) == 1 < len(shapes)
    out = [torch.empty(sum(r for r, _ in shapes), shapes[0][1])] if fused else [torch.empty(r, d) for r, d in shapes]
    for s, i in zip(saved, at, strict=True):
        for t, ids in enumerate(s["ids"]):
            out[t][ids] = s["snapshots"][i][2][t]
    return list(out[0].split([r for r, _ in shapes])) if fused else out


def join(model: torch.nn.Module, dense: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """The model's flat vector in parameter order: the tables where they sit, the dense values elsewhere."""
    where = {id(m.weight): t for t, (_, m) in enumerate(embedding_tables(model))}
    parts, at = [], 0
    for p in model.parameters():
        if id(p) in where:
            parts.append(tables[where[id(p)]].reshape(-1))
        else:
            parts.append(dense[at:at + p.numel()])
            at += p.numel()
    assert at == len(dense), f"the dense snapshot has {len(dense)} values, the model's dense part {at}"
    return torch.cat(parts)


def full(out: Path, cfg: RunConfig, model, snaps: list, final: torch.Tensor) -> tuple[list, torch.Tensor]:
    saved = [torch.load(out / f"rows-{k}.pt", weights_only=True) for k in range(cfg.servers)]
    shapes = [tuple(m.weight.shape) for _, m in embedding_tables(model)]
    index = [{v: i for i, (v, _, _) in enumerate(s["snapshots"])} for s in saved]
    joined = [(v, t, join(model, dense, _tables(saved, [ix[v] for ix in index], shapes)))
              for v, t, dense in snaps if all(v in ix for ix in index)]
    last = _tables(saved, [len(s["snapshots"]) - 1 for s in saved], shapes)
    return joined, join(model, final, last)


def summary_extra(out: Path, cfg: RunConfig) -> dict:
    stats = [json.loads((out / f"rows-{k}.json").read_text()) for k in range(cfg.servers)]
    hist: Counter = Counter()
    for s in stats:
        for table in s["tables"]:
            hist.update({int(k): v for k, v in table["staleness"].items()})
    return {"rows": {
        "embeddings": cfg.embeddings, "mode": stats[0]["mode"], "partition": cfg.row_partition,
        "optimizer": cfg.row_optimizer, "staleness": hist_stats(hist),
        "share": [sum(t["rows"] for t in s["tables"]) for s in stats],
        "load": [sum(t["rows_in"] + t["rows_out"] for t in s["tables"]) for s in stats],
        "bytes": [sum(t["bytes_in"] + t["bytes_out"] for t in s["tables"]) for s in stats],
    }}
