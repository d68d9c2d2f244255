"""A worker's exchange with embedding rows by key (`--embeddings rows | hybrid`): rows and dense side by side.

`attach(cfg, dense, parts, rank)` takes the worker's dense `PSExchange` and its parts
(psgd/train/assemble.py `worker_parts`) and returns a `RowExchange` and the parts with the model
replaced by its `DenseView`: the worker loop (psgd/train/worker.py) flattens and the dense shards
hold every parameter but the embedding tables, which `SparseRows` (psgd/train/rowtrain.py) pulls
and pushes by row from each shard's row service (psgd/train/rowshard.py: the port in
OUT/rows-K.port, the host the dense shard's). Nothing changes in the loop or the dense exchange.

A step, in this order (the order makes a sync run's snapshots consistent, rowshard.py):
    before_compute   the dense pull (PushPull: already in hand), then the rows of the batch
                     (`model.row_ids(x)` before forward: one request per shard)
    after_compute    the row gradients (one summed row per touched id), then the dense push
`setup` first offers each shard its rows of the seeded tables (INIT: every worker, the first
wins), then the dense setup: the shards' version-0 snapshot has the tables. The row pull and push
times and bytes are added to the step's (StepReport: pull_s, push_s, bytes_pulled, bytes_pushed),
so summary.json's bytes per step count both parts. A model without `row_ids` has its rows pulled
by the tables' hooks during forward (one request per table, inside compute time): async rows
only (--embeddings hybrid, or --mode async), since sync and SSP count a worker's clock by its
requests. A wire error is an ExchangeError naming the shard. The rows go first, so a worker's
last push in an async run whose budget the dense shards find spent (refused, not counted) has
still updated its rows: at most one gradient per worker beyond the budget, on the rows alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch
from torch import nn

from psgd.core.config import RunConfig
from psgd.core.errors import ExchangeError, UsageError
from psgd.core.rowconfig import row_mode
from psgd.core.step import StepReport
from psgd.train import rowshard
from psgd.train.dlrm import embedding_tables
from psgd.train.rowtrain import SparseRows, dense_parameters


class DenseView(nn.Module):
    """The model as the dense exchange sees it: its forward, and every parameter but the tables."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", model)  # not a submodule: its tables are not this view's
        for i, p in enumerate(dense_parameters(model)):
            self.register_parameter(f"dense_{i}", p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def row_addresses(out: str, dense: list[str], wire: str = "tcp") -> list[str]:
    """Each shard's row service on `wire` (tcp or grpc): the dense shard's host, the port shard K wrote
    to OUT/rows-K.port for that wire."""
    found = []
    for k, address in enumerate(dense):
        path = Path(out) / f"rows-{k}.port"
        if not path.exists():
            raise UsageError(f"--embeddings: shard {k} serves no rows ({path} is missing): start the shards with "
                             "the same --embeddings and --out")
        found.append(f"{address.rsplit(':', 1)[0]}:{int(path.read_text().split()[wire == 'grpc'])}")
    return found


def attach(cfg: RunConfig, dense, parts, rank: int):
    """(the RowExchange around `dense`, `parts` with the model's DenseView); see the module docstring."""
    from psgd.ps import auth, rows_grpc, transport  # noqa: PLC0415
    from psgd.ps.rows_tcp import RowClient  # noqa: PLC0415

    model = parts.model
    tables = [m for _, m in embedding_tables(model)]
    if not tables:
        raise UsageError(f"--embeddings {cfg.embeddings}: --model {cfg.model.model} has no nn.Embedding table")
    prefetch = hasattr(model, "row_ids")
    if not prefetch and row_mode(cfg) != "async":
        raise UsageError(f"--embeddings {cfg.embeddings} under --mode {cfg.mode} needs a model with row_ids(x) (the "
                         "ids each table reads, before forward); give --embeddings hybrid or --mode async")
    token = auth.load(cfg.token_file)
    try:
        # The dense plane's transport carries the rows: gRPC's stream, tcp's service, or a transport's
        # own client of that service (shm's doorbell).
        chosen = transport.choose(cfg.transport, dense.addresses, bool(cfg.tls_ca), linked=bool(cfg.link))
        wire, own = ("grpc" if chosen == "grpc" else "tcp"), transport.row_client(chosen)
        processes = cfg.workers + cfg.servers
        connect = (functools.partial(own, processes=processes) if own is not None
                   else rows_grpc.connect if wire == "grpc" else RowClient)
        clients = [connect(a, token, cfg.rpc_timeout) for a in row_addresses(cfg.out, dense.addresses, wire)]
    except (OSError, RuntimeError) as e:  # a refusal (RowWireError: a wrong token, a segment not mapped) too
        raise ExchangeError(f"the shards' row services: {e}", getattr(e, "status", "")) from None
    shapes = [tuple(m.weight.shape) for m in tables]
    rows = SparseRows(model, clients, rowshard.partitions(cfg, shapes, rowshard.fusable(model)), rank,
                      every_shard=prefetch)
    rows.enabled = False  # until setup: the warm-up forward reads the seeded tables as they are
    batches, accumulate = parts.batches, cfg.accumulate

    def ids_for(clock: int) -> dict[int, torch.Tensor]:
        return model.row_ids(torch.cat([x for x, _ in batches.micro(clock, accumulate)]))

    return RowExchange(dense, rows, ids_for if prefetch else None), dataclasses.replace(parts, model=DenseView(model))


class RowExchange:
    """The worker loop's `Exchange` for a model whose tables travel by row (see the module docstring)."""

    def __init__(self, dense, rows: SparseRows, ids_for) -> None:
        self.dense, self.rows, self.ids_for = dense, rows, ids_for

    @property
    def start_clock(self) -> int:
        return getattr(self.dense, "start_clock", 0)

    @property
    def while_waiting(self):
        return self.dense.while_waiting

    @while_waiting.setter
    def while_waiting(self, fn) -> None:
        self.dense.while_waiting = fn

    def _wire(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (OSError, RuntimeError) as e:  # RowWireError (a refusal), a closed or timed-out socket
            raise ExchangeError(f"rows {what}: {e}", getattr(e, "status", "")) from None

    def setup(self, flat, rank: int) -> None:
        for k, client in enumerate(self.rows.shards):
            offer = [(t, p.owned(k), w.detach()[p.owned(k)])
                     for t, (p, w) in enumerate(zip(self.rows.partitions, self.rows.weights, strict=True))]
            self._wire(f"init of shard {k}", client.init, rank, offer)
        self.dense.setup(flat, rank)
        for m in self.rows.tables:
            m.weight.grad = None  # the warm-up's
        self.rows.enabled = True

    def before_compute(self, clock: int, flat) -> StepReport:
        report = self.dense.before_compute(clock, flat)
        if report.done or self.ids_for is None:
            return report
        t0, b0 = time.perf_counter(), self.rows.bytes_pulled
        self._wire("pull", self.rows.prefetch, self.ids_for(clock))
        report.pull_s += time.perf_counter() - t0
        report.bytes_pulled += self.rows.bytes_pulled - b0
        return report

    def after_compute(self, clock: int, flat) -> StepReport:
        t0, b0 = time.perf_counter(), self.rows.bytes_pushed
        self._wire("push", self.rows.push)
        row_s, row_bytes = time.perf_counter() - t0, self.rows.bytes_pushed - b0
        report = self.dense.after_compute(clock, flat)
        report.push_s += row_s
        report.bytes_pushed += row_bytes
        return report

    def close(self, failed: bool = False) -> None:
        for client in self.rows.shards:
            client.close()  # the shard's row service sees the worker leave (a sync round waits no longer)
        self.dense.close(failed)
