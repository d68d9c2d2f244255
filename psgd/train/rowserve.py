"""A process that serves one shard's embedding rows (psgd/ps/rows_tcp.py) for a built-in model.

    python -m psgd.train.rowserve --dataset clicks --model dlrm --shard 0 --shards 2 --scheme hash

builds the model as every worker does (seeded: the same initial tables everywhere,
psgd/train/models.py), keeps the rows of each `nn.Embedding` table that shard `--shard` owns
(psgd/core/rows.py `RowPartition`, one per table, or one over all with `--fused`), steps them with
`--optimizer` (sgd or adagrad, psgd/core/rowoptim.py), serves them on 127.0.0.1 (`--port`, 0 for any
free one), prints `port N` on stdout once it listens, and serves until its stdin closes (its
parent's lifeline: the process never outlives whoever started it). Not yet started by `psgd run`:
the benchmark (`psgd bench sparse`) and tests start it. Usage errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from psgd.core.config import ModelConfig
from psgd.core.rowoptim import RowAdagrad, RowSGD
from psgd.core.rows import SCHEMES, RowPartition
from psgd.core.rowstore import RowStore
from psgd.train import data, dlrm, models

OPTIMIZERS = {"sgd": RowSGD, "adagrad": RowAdagrad}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m psgd.train.rowserve", description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="clicks")
    p.add_argument("--model", default="dlrm")
    p.add_argument("--width", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--scheme", default="hash", choices=SCHEMES)
    p.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fused", action="store_true", help="every table in one store (one id space)")
    p.add_argument("--port", type=int, default=0)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.dataset not in data.SHAPES or not 0 <= args.shard < args.shards:
        print(f"rowserve: error: --dataset must be one of {', '.join(data.SHAPES)} and --shard in "
              f"0..{args.shards - 1}", file=sys.stderr)
        return 2
    from psgd.ps import rows_tcp, transport  # noqa: PLC0415

    input_dim, classes = data.SHAPES[args.dataset]  # the shape is enough: a shard loads no data
    model = models.build(ModelConfig(model=args.model, width=args.width), input_dim, classes, args.seed)
    if not dlrm.embedding_tables(model):
        print(f"rowserve: error: --model {args.model} has no nn.Embedding table to serve", file=sys.stderr)
        return 2
    optimizer = functools.partial(OPTIMIZERS[args.optimizer], lr=args.lr)
    tables = [m.weight.detach() for _, m in dlrm.embedding_tables(model)]
    if args.fused:  # psgd/train/rowtrain.py's fused layout: tables one after another, each partitioned alone
        part = RowPartition(sum(len(t) for t in tables), args.shards, args.scheme, tuple(len(t) for t in tables))
        stores = [RowStore(part, args.shard, torch.cat(tables), optimizer)]
    else:
        stores = [RowStore(RowPartition(len(t), args.shards, args.scheme), args.shard, t, optimizer) for t in tables]
    server = rows_tcp.serve(stores, port=args.port, upgrades=transport.row_upgrades())  # shm's ATTACH too
    print(f"port {server.port}", flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
