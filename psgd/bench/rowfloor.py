"""The floor of a row path with a server on one host: `psgd bench roundtrip`'s `floor-rows` arm.

Why: issue 56 asks a row path (embedding rows on the shards, pulled and pushed by key) for 0.8x the
plain loop's samples/s on `dlrm`. The `floor` arm (psgd/bench/floor.py) says what a second process
costs when the tables travel whole; `psgd bench sparse`'s floor says what the rows cost in one
process. This arm puts the two together: the least a row path whose server lives in another
process must do, so that psgd's row path (`psgd run --embeddings rows`) is read against what is
possible on this host, not only against the plain loop.

What it does, and nothing more:
- the worker (this process) holds the dense parameters and gradients as the `floor` arm does (views
  of two flat buffers in shared memory); the server (a child forked before the clock starts) holds
  every table, fused in one store, and its own copy of the dense parameters with the config's
  optimizer (torch's, as the plain loop builds it);
- the rows ride the one round trip a step the `floor` arm pays, on psgd's own prefetch order: after
  backward the worker writes the summed gradient of each row it read and the deduplicated ids the
  next step will read (`torch.unique` once over the batch's fields), and wakes the server; the server
  steps the dense part, adds -lr times each row gradient into its store (`index_add_`: plain SGD,
  the arithmetic torch's SGD does on a dense table gradient), gathers the next step's rows into the
  shared rows buffer, and wakes the worker; the worker's forward reads its lookups from that buffer
  (each table's lookup replaced by its field's slice of one gather, as `psgd bench sparse`'s floor).
  One more round trip before the clock brings step 0's rows. Waits are `floor`'s (`Bell`: block or
  spin).

Contract: `dlrm` (any model with `row_ids(x) -> {table: ids}` whose forward calls each table once
with those ids), plain SGD without momentum or weight decay (a row's momentum or decay would need
state per row: not the floor), one micro-batch a step; returns the fields `torch_loop` returns
(psgd/bench/arms.py). It trains what the plain loop trains up to the order of a row's sums
(tests/test_bench.py: rel 1e-5). The server exits when the worker says the end or dies; the
worker reaps it and stops with one line if the server dies first.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import socket
import time
from collections.abc import Callable

from psgd.bench.floor import Bell, serve
from psgd.core.config import RunConfig


def row_floor_loop(cfg: RunConfig, make_optimizer: Callable, wait: str = "block") -> dict:
    """Run the floor-rows arm of `cfg` (one worker, one server process); the fields of `torch_loop`."""
    import torch

    o = cfg.optim
    if wait not in ("block", "spin"):
        raise ValueError(f"wait is block or spin, not {wait!r}")
    if o.optimizer != "sgd" or o.momentum or o.weight_decay or cfg.accumulate != 1:
        raise ValueError("the row floor steps its rows by plain SGD (no momentum, no weight decay), one micro-batch "
                         "a step")
    w = _Worker(cfg)
    counters = mmap.mmap(-1, 16)
    worker_end, server_end = socket.socketpair()
    pending = w.prepare(0)
    pid = os.fork()
    if pid == 0:  # the server: never returns
        worker_end.close()
        parent = os.getppid()
        bell = Bell(server_end, counters, wait, mine=8, theirs=0, alive=lambda: os.getppid() == parent)
        _serve(bell, w, cfg, make_optimizer)
    server_end.close()
    bell = Bell(worker_end, counters, wait, mine=0, theirs=8, alive=lambda: os.waitpid(pid, os.WNOHANG)[0] == 0)

    def trip(round_: int) -> None:
        bell.ring(round_)
        if bell.wait(round_) is None:
            raise RuntimeError("the row floor's server process ended in the middle of a step")

    ends, compute_s, loss = [], 0.0, 0.0
    try:
        trip(1)  # step 0's rows
        w.step(pending)  # the warm-up, as the plain loop's: its gradients discarded
        w.flat.zero_grad()
        for clock in range(cfg.steps):
            t0 = time.perf_counter()
            loss = w.step(pending)
            compute_s += time.perf_counter() - t0
            w.grad_buf[:pending[0]] = w.leaf.grad  # each distinct row's summed gradient
            pending = w.prepare(clock + 1) if clock + 1 < cfg.steps else w.prepare(None)
            trip(clock + 2)
            w.flat.zero_grad()
            ends.append(time.time())
    finally:
        bell.ring(-1)
        worker_end.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return {"rank": 0, "ends": ends, "final_train_loss": loss, "threads": torch.get_num_threads(),
            "compute_s": compute_s}


class _Worker:
    """The worker's side, built before the fork (the server's store and buffers are its copies and
    mappings): the model with each table's lookup reading its field of the step's one gather, the
    dense part in shared flat buffers, and the shared row buffers."""

    def __init__(self, cfg: RunConfig) -> None:
        import torch

        from psgd.train import assemble, models, threads
        from psgd.train.dlrm import embedding_tables
        from psgd.train.rowexchange import DenseView

        torch.set_num_threads(threads.thread_budget(cfg))
        parts = assemble.worker_parts(cfg, 0, torch.device("cpu"))
        self.batches, self.model, self.loss_fn = parts.batches, parts.model, parts.loss
        tables = [m for _, m in embedding_tables(self.model)]
        if not tables or not hasattr(self.model, "row_ids"):
            raise ValueError(f"the row floor needs a model with embedding tables and row_ids(x), not {cfg.model.model}")
        self.bases = torch.tensor([0, *torch.tensor([t.num_embeddings for t in tables]).cumsum(0)[:-1].tolist()])
        self.store = torch.cat([t.weight.detach() for t in tables])  # the server's (its copy once forked)
        self.looked: dict[str, torch.Tensor] = {}
        for f, t in enumerate(tables):
            t.forward = functools.partial(lambda f, ids: self.looked["e"][:, f], f)
        self.flat = models.FlatParams(DenseView(self.model))  # the dense part, as the floor holds it
        self.flat.params.share_memory_()
        self.flat.grads.share_memory_()
        cap, dim = cfg.batch_size * len(tables), self.store.shape[1]  # at most `cap` distinct rows a step
        self.ids_buf = torch.zeros(cap, dtype=torch.int64).share_memory_()
        self.rows_buf, self.grad_buf = torch.zeros(cap, dim).share_memory_(), torch.zeros(cap, dim).share_memory_()
        self.count = torch.zeros(1, dtype=torch.int64).share_memory_()

    def prepare(self, clock: int | None) -> tuple:
        """Write step `clock`'s distinct ids for the server (None: none, the end); (their count,
        where each lookup reads, the batch)."""
        import torch

        if clock is None:
            self.count[0] = 0
            return 0, None, None, None
        (x, y), = self.batches.micro(clock)
        ids, where = torch.unique(torch.stack(list(self.model.row_ids(x).values()), 1) + self.bases,
                                  return_inverse=True)
        self.ids_buf[:len(ids)] = ids
        self.count[0] = len(ids)
        return len(ids), where, x, y

    def step(self, pending: tuple) -> float:
        """Forward and backward of a prepared step on the rows the server gathered, read in place."""
        n, where, x, y = pending
        self.leaf = self.rows_buf[:n].detach().requires_grad_()
        self.looked["e"] = self.leaf[where]
        out = self.loss_fn(self.model(x), y)
        out.backward()
        return float(out.detach())


def _serve(bell: Bell, w: _Worker, cfg: RunConfig, make_optimizer) -> None:
    """The server process: the tables' store and the dense part's optimizer; per wake-up, the last
    step's update (none before step 0) and the next step's rows."""
    import torch

    flat, store, ids_buf, rows_buf, grad_buf, count = w.flat, w.store, w.ids_buf, w.rows_buf, w.grad_buf, w.count

    def make_step():
        own = torch.nn.Parameter(flat.params.clone())
        opt = make_optimizer([own], cfg)
        served = [torch.zeros(0, dtype=torch.int64)]  # the ids whose rows the worker read last

        def step(round_: int) -> None:
            if round_ > 1:
                own.grad = flat.grads
                opt.step()
                flat.params.copy_(own.detach())
                store.index_add_(0, served[0], grad_buf[:len(served[0])], alpha=-cfg.optim.lr)
            served[0] = ids_buf[:int(count[0])].clone()
            torch.index_select(store, 0, served[0], out=rows_buf[:len(served[0])])
        return step

    serve(bell, make_step)
