"""A shard process's embedding rows (`--embeddings rows | hybrid`): served beside its dense shard.

`psgd server` (psgd/train/serve.py) calls `start` before it says READY, when the run moves rows by
key (psgd/core/rowconfig.py): shard K of the run then also owns its rows of every `nn.Embedding`
table of the model (psgd/core/rows.py `RowPartition` by --row-partition, one store per table,
psgd/core/rowstore.py; one store for every table when they are `fusable`), serves them on a port
on ports of its own (TCP, psgd/ps/rows_tcp.py, and gRPC, rows_grpc.py: a worker with --transport grpc
takes gRPC; same bind and token as the dense shard) under the rows' mode
(psgd/core/rowrounds.py), and writes both ports to OUT/rows-K.port, where a worker that knows the
shard's address finds it (psgd/train/rowexchange.py).
The dense shard then holds only the model's other parameters (`dense_count`).

The stores start empty: the tables' shapes come from the model built on the meta device (no
values drawn); every worker offers its seeded tables (INIT) before its dense Init, the first one
wins, as the dense Init does. Each time the dense shard snapshots its parameters (every
--eval-every updates), the row stores are snapshotted with it (one version, one moment: a worker
pushes its rows before its dense gradient, so in sync the rows are at the dense version's round);
Each checkpoint of the dense shard (--checkpoint-every) holds the stores too, in the same cut (its
`companion`), and a shard started from one (--restart-servers, --resume) takes its rows from it,
each worker's row clock at its dense clock. In sync that cut is exact (a worker pushes its rows before
its dense gradient, and the round closes before the update); in async and hybrid a worker caught
between its row push and its dense push of a step pushes that step's rows again after the restart
(the rows protocol counts requests, not clocks): applied twice, where the dense part's is not (its
checkpoint holds each worker's clock).
`save` writes them and the row service's stats (per-row staleness, rows and bytes moved, the
share of rows) to OUT/rows-K.pt and OUT/rows-K.json when the shard stops.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from psgd.core.config import RunConfig
from psgd.core.rowconfig import row_mode
from psgd.core.rowoptim import RowAdagrad, RowSGD
from psgd.core.rowrounds import RowRounds
from psgd.core.rows import RowPartition
from psgd.core.rowstore import RowStore

OPTIMIZERS = {"sgd": RowSGD, "adagrad": RowAdagrad}
_SERVED: dict[int, tuple] = {}  # shard index -> (its RowServer, its snapshots): one shard per process


def meta_model(cfg: RunConfig):
    """The run's model built on the meta device: its shapes, no values, no memory."""
    from psgd.train import data, models  # noqa: PLC0415

    with torch.device("meta"), models._NoNormalDraws():  # noqa: SLF001 - models.count's own way
        return models._build(cfg.model, *data.SHAPES[cfg.data.dataset])  # noqa: SLF001


def table_shapes(cfg: RunConfig) -> list[tuple[int, int]]:
    """(rows, dim) of every embedding table of the run's model, in parameter order."""
    from psgd.train.dlrm import embedding_tables  # noqa: PLC0415

    return [tuple(m.weight.shape) for _, m in embedding_tables(meta_model(cfg))]


def dense_count(cfg: RunConfig) -> int:
    """Parameters the dense shards hold when the tables travel by row: the rest of the model."""
    from psgd.train.rowtrain import dense_parameters  # noqa: PLC0415

    return sum(p.numel() for p in dense_parameters(meta_model(cfg)))


def fusable(model) -> bool:
    """Whether the model's tables go in one store per shard (psgd/train/rowtrain.py's fused layout:
    one id space, each table partitioned as if alone, one directory entry per request): several
    tables of one width, looked up by ids known before forward (`row_ids`). Worker and shard ask it
    of the same model, so they agree."""
    from psgd.train.dlrm import embedding_tables  # noqa: PLC0415

    tables = [m for _, m in embedding_tables(model)]
    return len(tables) > 1 and hasattr(model, "row_ids") and len({m.embedding_dim for m in tables}) == 1


def partitions(cfg: RunConfig, shapes: list[tuple[int, int]], fused: bool) -> list[RowPartition]:
    """The run's row partitions: one over every table (fused), or one per table."""
    if fused:
        return [RowPartition(sum(r for r, _ in shapes), cfg.servers, cfg.row_partition, tuple(r for r, _ in shapes))]
    return [RowPartition(r, cfg.servers, cfg.row_partition) for r, _ in shapes]


def stores(cfg: RunConfig, index: int) -> list[RowStore]:
    """Shard `index`'s empty stores, one per table or one for all (`fusable`): zeros until an INIT."""
    opt = functools.partial(OPTIMIZERS[cfg.row_optimizer], lr=cfg.optim.lr)
    shapes = table_shapes(cfg)
    return [RowStore(p, index, torch.zeros(p.rows, shapes[0][1] if p.tables else shapes[t][1]), opt,
                     initialised=False)
            for t, p in enumerate(partitions(cfg, shapes, fusable(meta_model(cfg))))]


class _Tapped(list):
    """The dense shard's snapshot list: each append (version, time, params) snapshots the rows too."""

    def __init__(self, items, on_append) -> None:
        super().__init__(items)
        self.on_append = on_append

    def append(self, item) -> None:
        super().append(item)
        self.on_append(item[0], item[1])


class _InCheckpoints:
    """The dense shard's `companion` (psgd/ps/persist.py): the rows' state in each of its checkpoints."""

    def __init__(self, held: list[RowStore], rounds: RowRounds) -> None:
        self.held, self.rounds = held, rounds

    def state(self) -> dict:
        with self.rounds.cond:  # no round closes while the stores are copied
            return {"version": self.rounds.version, "stores": [s.state() for s in self.held]}


def _restore(held: list[RowStore], rounds: RowRounds, restored: dict) -> None:
    """The rows of the dense shard's checkpoint `restored` (ValueError if it has none or others)."""
    if "rows" not in restored or len(restored["rows"]["stores"]) != len(held):
        raise ValueError("the checkpoint holds no embedding rows of this model: it is of a run with --embeddings "
                         "dense, or of another model")
    for store, state in zip(held, restored["rows"]["stores"], strict=True):
        store.load(state)
    rounds.restore(restored["rows"]["version"], restored["clocks"])


def start(cfg: RunConfig, index: int, bind: str, token: bytes | None, dense, restored: dict | None = None) -> int:
    """Serve shard `index`'s rows beside `dense` (its `Shard`, started from the checkpoint `restored`
    when given: the rows come from it too); returns the TCP port, written to OUT/rows-K.port with the
    gRPC one after it."""
    from psgd.ps import rows_grpc, rows_tcp, transport  # noqa: PLC0415

    held = stores(cfg, index)
    rounds = RowRounds(held, row_mode(cfg), cfg.workers, cfg.staleness)
    if restored is not None:
        _restore(held, rounds, restored)
    # Both wires, as the dense shard listens on both: the transport is the worker's choice (gRPC with
    # --transport grpc, else the rows' own TCP service, which a transport may upgrade: shm's segments),
    # one set of stores and rounds behind them.
    server = rows_tcp.serve(held, bind, 0, token, rounds, cfg.rpc_timeout, transport.row_upgrades())
    try:
        over_grpc = rows_grpc.serve(held, bind, 0, token, rounds, cfg.rpc_timeout)
    except BaseException:
        server.close()
        raise
    snaps: list = [(v, t, [s.snapshot()[1] for s in held]) for v, t, _ in dense.snapshots]  # a restore's
    dense.snapshots = _Tapped(dense.snapshots, lambda v, t: snaps.append((v, t, [s.snapshot()[1] for s in held])))
    dense.companion = _InCheckpoints(held, rounds)
    _SERVED[index] = (server, snaps, over_grpc)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rows-{index}.port").write_text(f"{server.port} {over_grpc.port}\n")
    return server.port


def save(out: Path, index: int, version: int) -> None:
    """Write OUT/rows-K.pt (each table's ids and its snapshots, the last at `version`, the dense
    shard's final one) and OUT/rows-K.json (the row service's stats); stop serving."""
    if index not in _SERVED:
        return
    server, snaps, over_grpc = _SERVED.pop(index)
    server.close()
    over_grpc.close()
    if not snaps or snaps[-1][0] != version:
        snaps.append((version, time.time(), [s.snapshot()[1] for s in server.stores]))
    torch.save({"ids": [s.ids for s in server.stores], "snapshots": snaps}, out / f"rows-{index}.pt")
    stats = {"mode": server.rounds.mode, "version": server.rounds.version, "tables": server.stats()}
    (out / f"rows-{index}.json").write_text(json.dumps(stats, indent=1))
