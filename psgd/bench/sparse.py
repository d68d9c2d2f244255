"""`psgd bench sparse`: the sparse path's accounting and mechanism, in one process (`--wire`: over row servers).

What it measures, on `--model dlrm` over `--dataset clicks*` (psgd/train/dlrm.py, clicks.py), with
the row stores and the worker's sparse side of psgd/core/rowstore.py and psgd/train/rowtrain.py:
- bytes: per worker and step, what a sparse pull and push move (the touched rows and their ids,
  counted by the stores as they serve them) against what the dense path moves (every parameter,
  fp32, each way), and the ratio of the sparse payload to the touched rows' own bytes (the issue's
  bound: at most 1.1). Accounting by construction: the bytes a request carries, not a wire measured.
- staleness: N workers in turn, async's steady state as psgd/core/textbook.py plays it (each
  pulls, computes, and pushes after the N - 1 others pushed): the global staleness (N - 1 by
  construction) beside the per-row staleness the stores count (mean, p99, share of zeros).
- load: lookups each shard serves over the run's batches under `hash` and `range` partitions
  (max over mean: 1.0 is even).
- speed: samples/s of one worker training through K row stores in this process against two plain
  torch loops on the same model and batches (torch.optim.SGD; the tables' gradients dense, as
  psgd's dense path takes them, and sparse, `nn.Embedding(sparse=True)`: the tighter ceiling),
  alternated `--repeats` times in one run: the sparse mechanism's own cost (dedup, cut by owner,
  copies, row updates) with no transport in between; beside them the row path's floor
  (`_floor_loop`: one dedup, one gather, one index_add_ per step and nothing else), so psgd's
  distance to the least a row path does and the floor's distance to the plain loops read apart.
- wire (`--wire`): the same worker with its rows on K row-server processes over loopback TCP
  (psgd/train/rowserve.py, psgd/ps/rows_tcp.py) and, on the same servers, over shm (psgd/ps/shm/rows.py),
  the dense part stepped locally (no dense shard yet): samples/s against the plain torch loop,
  alternated in one run, and the bytes on the wire (prefixes included) over the touched rows' own
  bytes and ids.
Whole `psgd run`s (async N=1, the shard in its own process) against the plain loops are `psgd bench
roundtrip --workloads dlrm-rows,dlrm-large-rows --arms plain,plain-sparse,ps,shm` (roundtrip.py).
Writes OUT/sparse.json and OUT/command.txt; prints one table.

    psgd bench sparse                                     # about half a minute on 2 cores
    psgd bench sparse --dataset clicks-large --workers 2,8 --steps 200
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from psgd.bench.record import scratch
from psgd.bench.transport import parse_int_list
from psgd.core import rows
from psgd.core.config import DataConfig, ModelConfig
from psgd.core.errors import UsageError
from psgd.core.rowoptim import RowSGD
from psgd.train import clicks, data, dlrm, models, rowtrain


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psgd bench sparse", description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="clicks", choices=list(clicks.PROFILES))
    p.add_argument("--num-samples", type=int, default=20_000)
    p.add_argument("--width", type=int, default=16, help="embedding dimension")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--workers", default="1,2,4,8", help="N for the staleness rows")
    p.add_argument("--steps", type=int, default=200, help="pushes per staleness row and per speed repeat")
    p.add_argument("--repeats", type=int, default=3, help="speed: alternations of the two loops")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--wire", action="store_true", help="also train over K row-server processes (TCP)")
    p.add_argument("--per-table", action="store_true", help="a store per table (default: every table fused in one)")
    p.add_argument("--out", default=scratch("bench/sparse"), help="folder for its JSON and command")
    return p


def _model(args, ds):
    return models.build(ModelConfig(model="dlrm", width=args.width), ds.input_dim, ds.num_classes, seed=0)


def _batch(ds, step: int, size: int):
    n = len(ds.x_train) // size
    i = step % n
    return ds.x_train[i * size:(i + 1) * size], ds.y_train[i * size:(i + 1) * size]


def _local(args, model) -> tuple[list, list]:
    return rowtrain.make_local(model, args.shards, "hash", functools.partial(RowSGD, lr=args.lr),
                               fused=not args.per_table)


def _sparse_step(model, worker, x, y, dense=None) -> None:
    """One step of the sparse path: every table's rows asked of each shard at once (DLRM's table f
    reads column f), forward, backward, the rows pushed, the dense part stepped where given."""
    worker.prefetch({f: x[:, f] for f in range(x.shape[1])})
    if dense is not None:
        dense.zero_grad()
    F.cross_entropy(model(x), y).backward()
    worker.push()
    if dense is not None:
        dense.step()


def bytes_row(args, ds) -> dict:
    """One worker's sparse pull and push against the dense path's, averaged over `--steps` steps."""
    model = _model(args, ds)
    sparse = rowtrain.SparseRows(model, *_local(args, model), rank=0)
    for step in range(args.steps):
        _sparse_step(model, sparse, *_batch(ds, step, args.batch_size))
    dense_params = sum(p.numel() for p in rowtrain.dense_parameters(model))
    table_params = sum(m.weight.numel() for _, m in dlrm.embedding_tables(model))
    rows_per_step = sparse.rows_pulled / args.steps
    own = rows_per_step * args.width * 4 + rows_per_step * rows.ID_BYTES
    return {"params": dense_params + table_params, "table_params": table_params, "dense_params": dense_params,
            "touched_rows_per_step": rows_per_step,
            "sparse_pull_bytes_per_step": sparse.bytes_pulled / args.steps,
            "sparse_push_bytes_per_step": sparse.bytes_pushed / args.steps,
            "dense_part_bytes_per_step": 4 * dense_params,
            "dense_path_bytes_per_step": 4 * (dense_params + table_params),
            "payload_over_touched_rows": (sparse.bytes_pulled / args.steps) / own}


def staleness_row(args, ds, n: int) -> dict:
    """N workers in turn through shared stores; per-row staleness beside the global one."""
    model = _model(args, ds)
    shards, partitions = _local(args, model)
    replicas = [copy.deepcopy(model) for _ in range(n)]
    workers = [rowtrain.SparseRows(r, shards, partitions, rank=w) for w, r in enumerate(replicas)]
    glob: list[int] = []
    for step in range(args.steps + n):
        w = step % n
        if step >= n:
            workers[w].push()
            glob.append(n - 1)  # in turn: the others' N - 1 pushes came between its pull and its push
        x, y = _batch(ds, step, args.batch_size)
        workers[w].prefetch({f: x[:, f] for f in range(x.shape[1])})
        F.cross_entropy(replicas[w](x), y).backward()
    hist = rowtrain.staleness_histogram(shards)
    a = np.repeat(np.array(list(hist), dtype=np.int64), list(hist.values()))
    return {"workers": n, "global_mean": float(np.mean(glob)), "row_mean": float(a.mean()),
            "row_p99": float(np.percentile(a, 99)), "row_max": int(a.max()), "row_zero_share": float((a == 0).mean())}


def load_row(args, ds) -> dict:
    """Lookups per shard of every field's table under each scheme, over `--steps` batches of N=1."""
    x = ds.x_train[:args.steps * args.batch_size]
    out = {}
    for scheme in rows.SCHEMES:
        per = np.zeros(args.shards)
        for f, v in enumerate(clicks.PROFILES[args.dataset].vocab):
            per += rows.lookups_per_shard(rows.RowPartition(v, args.shards, scheme), x[:, f].contiguous())
        out[scheme] = {"lookups": per.astype(int).tolist(), "max_over_mean": float(per.max() / per.mean())}
    return out


def speed_row(args, ds) -> dict:
    """samples/s of the sparse loop and the two plain torch loops (dense and sparse embedding
    gradients), alternated, medians of the repeats."""
    plain = functools.partial(_plain_loop, args, ds)
    plain_sparse = functools.partial(_plain_loop, args, ds, sparse=True)

    def sparse():
        m = _model(args, ds)
        worker = rowtrain.SparseRows(m, *_local(args, m), rank=0)
        opt = torch.optim.SGD(rowtrain.dense_parameters(m), lr=args.lr)
        for step in range(args.steps):
            _sparse_step(m, worker, *_batch(ds, step, args.batch_size), dense=opt)

    floor = functools.partial(_floor_loop, args, ds)
    times: dict[str, list[float]] = {"plain": [], "plain_sparse": [], "sparse": [], "floor": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", plain), ("plain_sparse", plain_sparse), ("sparse", sparse), ("floor", floor)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    rate = {k: args.steps * args.batch_size / statistics.median(v) for k, v in times.items()}
    return {"plain_samples_per_s": rate["plain"], "plain_sparse_samples_per_s": rate["plain_sparse"],
            "sparse_samples_per_s": rate["sparse"], "sparse_over_plain": rate["sparse"] / rate["plain"],
            "sparse_over_plain_sparse": rate["sparse"] / rate["plain_sparse"], "floor_samples_per_s": rate["floor"],
            "floor_over_plain": rate["floor"] / rate["plain"], "sparse_over_floor": rate["sparse"] / rate["floor"],
            "repeats": args.repeats}


def _floor_loop(args, ds) -> float:
    """The least any row path does in one process, the floor under psgd's: the tables fused in one
    store, the batch's ids deduplicated once (`torch.unique`), the distinct rows gathered into one
    leaf tensor that forward reads (each table's lookup replaced by its slice), and after backward one
    index_add_ of the summed row gradients into the store: no owners, clocks, checks or copies beyond
    these. The dense part is torch's SGD as in `_plain_loop`. Returns the final training loss (the
    plain loop's within rounding: tests/test_bench_sparse.py)."""
    m = _model(args, ds)
    tables = [t for _, t in dlrm.embedding_tables(m)]
    offsets = torch.tensor([0, *np.cumsum([t.num_embeddings for t in tables])[:-1].tolist()])
    store = torch.cat([t.weight.detach() for t in tables])
    looked: dict[str, torch.Tensor] = {}
    for f, t in enumerate(tables):
        t.forward = functools.partial(lambda f, ids: looked["e"][:, f], f)
    opt = torch.optim.SGD(rowtrain.dense_parameters(m), lr=args.lr)
    loss = torch.zeros(())
    for step in range(args.steps):
        x, y = _batch(ds, step, args.batch_size)
        ids, where = torch.unique(x + offsets, return_inverse=True)
        rows_ = store[ids].requires_grad_()
        looked["e"] = rows_[where]  # (B, F, d)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        store.index_add_(0, ids, rows_.grad, alpha=-args.lr)
        opt.step()
    return float(loss.detach())


def _plain_loop(args, ds, sparse: bool = False) -> float:
    """The no-server ceiling: torch.optim.SGD on the whole model in this process; `sparse`: the
    tables' gradients sparse (nn.Embedding(sparse=True), which torch's SGD takes), else dense."""
    m = _model(args, ds)
    for _, table in dlrm.embedding_tables(m):
        table.sparse = sparse
    opt = torch.optim.SGD(m.parameters(), lr=args.lr)
    loss = torch.zeros(())
    for step in range(args.steps):
        x, y = _batch(ds, step, args.batch_size)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
    return float(loss.detach())


def _start_row_servers(args) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    for k in range(args.shards):
        p = subprocess.Popen([sys.executable, "-m", "psgd.train.rowserve", "--dataset", args.dataset, "--width",
                              str(args.width), "--shard", str(k), "--shards", str(args.shards), "--lr", str(args.lr),
                              *([] if args.per_table else ["--fused"])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        procs.append(p)
        line = p.stdout.readline().split()
        if len(line) != 2 or line[0] != "port":
            raise RuntimeError(f"row server {k} did not start (said {line!r})")
        addresses.append(f"127.0.0.1:{line[1]}")
    return procs, addresses


def wire_row(args, ds) -> dict:
    """One worker over K row-server processes against the plain loop, its rows over the row
    service's TCP and over shm (the same servers, psgd/ps/shm/rows.py's doorbell), alternated;
    bytes on the wire."""
    from psgd.ps import transport  # noqa: PLC0415
    from psgd.ps.rows_tcp import RowClient  # noqa: PLC0415

    procs, addresses = _start_row_servers(args)
    try:
        carriers = {"wire": RowClient, "wire_shm": functools.partial(transport.row_client("shm"),
                                                                     processes=1 + args.shards)}
        arms, workers, clients = {}, {}, {}
        for rank, (name, connect) in enumerate(carriers.items()):
            clients[name] = [connect(a) for a in addresses]
            model = _model(args, ds)
            _, partitions = _local(args, copy.deepcopy(model))  # the layout the servers hold (same seed)
            workers[name] = rowtrain.SparseRows(model, clients[name], partitions, rank=rank)
            opt = torch.optim.SGD(rowtrain.dense_parameters(model), lr=args.lr)
            arms[name] = functools.partial(_wire_loop, args, ds, model, workers[name], opt)
        start = sum(c.bytes_sent + c.bytes_received for c in clients["wire"])
        times: dict[str, list[float]] = {"plain": [], "plain_sparse": [], "wire": [], "wire_shm": []}
        arms = {"plain": functools.partial(_plain_loop, args, ds),
                "plain_sparse": functools.partial(_plain_loop, args, ds, sparse=True), **arms}
        for _ in range(args.repeats):
            for name, fn in arms.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        on_wire = sum(c.bytes_sent + c.bytes_received for c in clients["wire"]) - start  # the STATS at connect left out
        for c in clients["wire"] + clients["wire_shm"]:
            c.close()
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    rate = {k: args.steps * args.batch_size / statistics.median(v) for k, v in times.items()}
    worker = workers["wire"]
    return {"plain_samples_per_s": rate["plain"], "plain_sparse_samples_per_s": rate["plain_sparse"],
            "wire_samples_per_s": rate["wire"], "wire_over_plain": rate["wire"] / rate["plain"],
            "wire_over_plain_sparse": rate["wire"] / rate["plain_sparse"],
            "wire_shm_samples_per_s": rate["wire_shm"], "wire_shm_over_plain": rate["wire_shm"] / rate["plain"],
            "wire_bytes_per_step": on_wire / (args.steps * args.repeats),
            "wire_over_touched_rows": on_wire / (worker.bytes_pulled + worker.bytes_pushed)}


def _wire_loop(args, ds, model, worker, opt) -> None:
    for step in range(args.steps):
        _sparse_step(model, worker, *_batch(ds, step, args.batch_size), dense=opt)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.shards < 1 or args.steps < 1 or args.batch_size < 1 or args.repeats < 1:
        raise UsageError("--shards, --steps, --batch-size and --repeats must be >= 1")
    workers = parse_int_list(args.workers, "--workers")
    torch.set_num_threads(1)
    ds = data.load(DataConfig(dataset=args.dataset, num_samples=args.num_samples))
    result = {"dataset": args.dataset, "width": args.width, "batch_size": args.batch_size, "shards": args.shards,
              "layout": "per-table" if args.per_table else "fused",
              "steps": args.steps, "bytes": bytes_row(args, ds), "load": load_row(args, ds),
              "staleness": [staleness_row(args, ds, n) for n in workers], "speed": speed_row(args, ds)}
    if args.wire:
        result["wire"] = wire_row(args, ds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "command.txt").write_text("psgd bench sparse " + shlex.join(argv) + "\n")
    _print(result)
    print(f"-> {out / 'sparse.json'}", file=sys.stderr)
    return 0


def _print(r: dict) -> None:
    b = r["bytes"]
    print(f"{r['dataset']}: dlrm of {b['params']:,} parameters ({b['table_params']:,} in tables), batch "
          f"{r['batch_size']} per worker, {r['shards']} shards, tables {r['layout']}")
    print(f"  bytes per step, each way: sparse rows {b['sparse_pull_bytes_per_step']:,.0f} + dense part "
          f"{b['dense_part_bytes_per_step']:,} vs dense path {b['dense_path_bytes_per_step']:,} "
          f"({b['touched_rows_per_step']:.0f} rows touched; payload / touched rows' bytes "
          f"{b['payload_over_touched_rows']:.3f}; accounting)")
    for scheme, v in r["load"].items():
        print(f"  load {scheme:5}: lookups per shard {v['lookups']}, max/mean {v['max_over_mean']:.2f}")
    for s in r["staleness"]:
        print(f"  N={s['workers']}: global staleness {s['global_mean']:.2f}, per row mean {s['row_mean']:.2f} "
              f"p99 {s['row_p99']:.0f} max {s['row_max']}, zero {s['row_zero_share']:.0%}")
    v = r["speed"]
    print(f"  speed (one process, no wire): sparse {v['sparse_samples_per_s']:,.0f} samples/s; plain torch "
          f"{v['plain_samples_per_s']:,.0f} (ratio {v['sparse_over_plain']:.2f}), with sparse embedding gradients "
          f"{v['plain_sparse_samples_per_s']:,.0f} (ratio {v['sparse_over_plain_sparse']:.2f}); the row path's floor "
          f"{v['floor_samples_per_s']:,.0f} ({v['floor_over_plain']:.2f} of plain; psgd's sparse loop "
          f"{v['sparse_over_floor']:.2f} of the floor)")
    if "wire" in r:
        w = r["wire"]
        print(f"  wire ({r['shards']} row-server processes, TCP; dense part local): {w['wire_samples_per_s']:,.0f} "
              f"samples/s, plain torch {w['plain_samples_per_s']:,.0f} (ratio {w['wire_over_plain']:.2f}), sparse "
              f"{w['plain_sparse_samples_per_s']:,.0f} (ratio {w['wire_over_plain_sparse']:.2f}); "
              f"{w['wire_bytes_per_step']:,.0f} bytes per step on the wire, {w['wire_over_touched_rows']:.3f} x "
              f"the touched rows and ids")
        print(f"  rows over shm (the same servers, a doorbell): {w['wire_shm_samples_per_s']:,.0f} samples/s "
              f"(ratio {w['wire_shm_over_plain']:.2f} of plain torch)")
