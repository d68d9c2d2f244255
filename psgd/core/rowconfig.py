"""The run settings of embedding rows by key (`--embeddings rows | hybrid`) and what they refuse.

`--embeddings dense` (the default) moves a model's `nn.Embedding` tables whole, as any parameter.
`rows`: the shards own the tables' rows by key (`--row-partition hash | range`,
psgd/core/rows.py), a worker pulls and pushes the rows its batch touches (psgd/train/rowexchange.py)
and the shards step them with `--row-optimizer` at `--lr` (psgd/core/rowoptim.py), under the
run's --mode (psgd/core/rowrounds.py). `hybrid`: the same, with the rows async whatever --mode
the dense part runs (Persia's scheme with --mode sync).

`check_rows(cfg)` gives validate's (ok, message) pairs; `row_mode(cfg)` the rows' mode. Stdlib
only: psgd/core/config.py calls it.
"""

from __future__ import annotations

from typing import Any

EMBEDDINGS = ("dense", "rows", "hybrid")


def by_key(cfg: Any) -> bool:
    """Whether the run moves embedding rows by key."""
    return cfg.embeddings != "dense"


def row_mode(cfg: Any) -> str:
    """The mode of the rows: hybrid's async, else the run's."""
    return "async" if cfg.embeddings == "hybrid" else cfg.mode


def check_rows(cfg: Any) -> list[tuple[bool, str]]:
    flag = f"--embeddings {cfg.embeddings}"
    if not by_key(cfg):
        return [(cfg.embeddings in EMBEDDINGS, f"--embeddings must be one of {', '.join(EMBEDDINGS)}")]
    return [
        (cfg.mode != "allreduce", f"{flag} serves rows from parameter shards: --mode allreduce reduces whole tables "
                                  "(give --embeddings dense)"),
        (cfg.local_steps == 1, f"{flag} pushes a step's row gradients: --local-steps pushes model deltas"),
        (cfg.topk == 1, f"{flag} already sends only the touched rows: drop --topk"),
        (not cfg.overlap, f"{flag} pulls the rows a batch touches before forward: drop --overlap"),
        (cfg.backup_workers == 0 and not cfg.elastic and cfg.max_workers == 0,
         f"{flag} keeps a fixed set of workers: drop --backup-workers, --elastic and --max-workers"),
        (cfg.restart_workers == 0,
         f"{flag}: a restarted worker would find its row clocks past its step; drop --restart-workers "
         "(--restart-servers restarts the whole run from a checkpoint that holds the rows)"),
        (cfg.accumulate == 1 or cfg.model.model == "dlrm",
         f"{flag} with --accumulate > 1 needs a model whose ids are known before forward (--model dlrm)"),
    ]
