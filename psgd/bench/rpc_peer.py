"""A parameter server on PyTorch RPC: the peer that `psgd bench peers` measures psgd against.

Written in this project's words after the pattern of PyTorch's own tutorials, "Implementing a
Parameter Server Using Distributed RPC Framework" and "Implementing Batch RPC Processing Using
Asynchronous Executions" (its batch-update parameter server): one process owns the model and a
`torch.optim.SGD`; trainer processes hold a remote reference (`RRef`) to it and call one remote
method per step that takes their gradients and answers with the parameters to train on next.
- async: the server applies each gradient on arrival and answers at once.
- sync: the method is `@rpc.functions.async_execution`: it returns a `torch.futures.Future`
  that the N-th gradient of the step completes, after the server applied their mean; so every
  trainer's call returns together, with the same new parameters (the tutorial's batch update).

Contract (what makes it the same workload as a `psgd run` of the same RunConfig):
- The model, its seeded initial parameters, the data and each trainer's batch at each step come
  from psgd's own train.models / train.data (`models.build`, `data.plan_for`), so a sync run
  computes exactly what psgd's sync PS computes: same init, same batches, the N gradients summed
  in fp32 and divided by N once, one plain SGD step (psgd/core/consistency.py `Sync`).
- Budget: `cfg.steps` updates in sync, `cfg.steps x N` applied gradients in async; later
  gradients are refused and the trainer stops, as psgd's shards refuse pushes past the budget.
- Timing as psgd's summary.json: each trainer runs one warm-up forward / backward (discarded),
  then a start barrier (`join`, released when all N trainers asked for the parameters);
  wall time runs from that release to the last trainer's end, `updates_per_s` = updates / wall.
  Process start-up, `init_rpc` and the warm-up fall outside it (`startup_s` is reported apart).
- Supports sync and async, one server, no momentum warmup, no accumulation (what the benchmark
  uses); anything else is refused when the config is read.
- Networking: the rendezvous is a file (`init_method="file://OUT/rendezvous"`, no TCP store) and
  TensorPipe's sockets are bound to the loopback interface (`TP_SOCKET_IFNAME=lo`, set by the
  benchmark), so nothing leaves 127.0.0.1 (checked with `strace -f -e trace=connect`).
- `--tensorpipe` picks how TensorPipe moves bytes between two processes of one host:
    uv       its `uv` transport (TCP on loopback) for control messages; tensors by its own
             channel choice, here `cma` (process_vm_readv: one copy from process to process)
    sockets  `uv` and the `basic` channel: every byte over loopback TCP, as psgd's and as
             between two hosts
    auto     TensorPipe's unmodified choice: here its `shm` transport, whose polling competes
             with compute; measured about 4x fewer sync updates per second than uv with 3
             processes on 2 cores. (`_transports` / `_channels` are torch's private options.)

Processes: rank 0 is the server and the driver (it starts each trainer's loop by RPC, as the
tutorial does, and writes OUT/result.json and OUT/final_params.pt); ranks 1..N are trainers.
By hand, one process per rank, the same config file:
    python -c 'import sys; from psgd.bench.rpc_peer import main; sys.exit(main(sys.argv[1:]))' \\
        --config OUT/config.json --rank R        # R = 0 .. N
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch.futures import Future

from psgd.core.config import RunConfig, from_dict
from psgd.train import data as data_mod
from psgd.train import evaluate, lifeline, models
from psgd.train.metrics import process_start_time

TENSORPIPE = ("uv", "sockets", "auto")
# The reply to a push: (parameters to train on next or None, done, this gradient was applied).
Reply = tuple[list[torch.Tensor] | None, bool, bool]


def check_config(cfg: RunConfig) -> None:
    """Refuse what this peer does not implement (ValueError naming the setting)."""
    unsupported = {"mode": cfg.mode not in ("sync", "async"), "servers": cfg.servers != 1,
                   "accumulate": cfg.accumulate != 1, "local_steps": cfg.local_steps != 1,
                   "warmup": cfg.optim.warmup != 0, "wire_dtype": cfg.wire_dtype != "fp32"}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"the RPC peer runs sync / async, 1 server, fp32, no warmup / accumulation / local "
                         f"steps; not {', '.join(bad)}")


class ParameterServer:
    """The model and its optimizer in one process; RPC agent threads call the methods concurrently.

    `lock` guards the model, the optimizer, the counters and the pending futures. Replies are
    completed outside it: completing a future sends the reply (serialises the tensors), and that
    need not hold up the next gradient.
    """

    def __init__(self, cfg: RunConfig, input_dim: int, num_classes: int) -> None:
        self.model = models.build(cfg.model, input_dim, num_classes, cfg.seed)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                                   weight_decay=cfg.optim.weight_decay)
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.sync = cfg.mode == "sync"
        self.workers = cfg.workers
        self.budget = cfg.steps * (1 if self.sync else cfg.workers)  # updates, as psgd's shard counts them
        self.lock = threading.Lock()
        self.updates = 0
        self.arrived = 0                         # sync: gradients of the current step so far
        self.step_done: Future = Future()        # sync: completed by the step's N-th gradient
        self.joined = 0
        self.started: Future = Future()          # the start barrier, completed by the N-th join
        self.train_start = 0.0

    def _snapshot(self) -> list[torch.Tensor]:
        # A copy taken under the lock: the reply is serialised after the lock is released, while
        # another trainer's gradient may already be changing the parameters (async).
        return [p.detach().clone() for p in self.params]

    def _step(self) -> None:
        self.opt.step()
        for p in self.params:
            p.grad.zero_()
        self.updates += 1

    @staticmethod
    @rpc.functions.async_execution
    def join(ps_rref: rpc.RRef) -> Future:
        """The start barrier: answers every trainer the initial parameters once all N asked."""
        self: ParameterServer = ps_rref.local_value()
        with self.lock:
            self.joined += 1
            fut, release = self.started, self.joined == self.workers
            if release:
                self.train_start = time.time()
                reply: Reply = (self._snapshot(), False, False)
        if release:
            fut.set_result(reply)
        return fut

    @staticmethod
    @rpc.functions.async_execution
    def push_pull(ps_rref: rpc.RRef, grads: list[torch.Tensor]) -> Future:
        """Apply (async) or add to the step's mean (sync) one trainer's gradients; the future
        carries the parameters after the update, or done once the budget is spent."""
        self: ParameterServer = ps_rref.local_value()
        with self.lock:
            if self.updates >= self.budget:
                refused: Future = Future()
                refused.set_result((None, True, False))
                return refused
            for p, g in zip(self.params, grads, strict=True):
                p.grad.add_(g)  # 0 + g is exactly g: the sum matches psgd's copy-then-add, bit for bit
            if self.sync:
                self.arrived += 1
                fut = self.step_done
                if self.arrived < self.workers:
                    return fut  # completed below by the step's last gradient
                for p in self.params:
                    p.grad.div_(self.workers)
                self.arrived, self.step_done = 0, Future()
            else:
                fut = Future()
            self._step()
            done = self.updates >= self.budget
            # The last update's answer carries no parameters: a psgd worker's pull after the last
            # update returns `done` without a transfer too.
            reply: Reply = (None if done else self._snapshot(), done, True)
        fut.set_result(reply)
        return fut


def run_trainer(ps_rref: rpc.RRef, cfg_dict: dict, rank: int) -> dict:
    """One trainer's loop (runs in trainer process `rank + 1`, started by the driver's RPC)."""
    cfg = from_dict(cfg_dict)
    ds = data_mod.load(cfg.data)
    plan = data_mod.plan_for(cfg, ds.y_train)
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    params = list(model.parameters())
    # Warm-up, as psgd's worker does: one forward / backward on the first batch, discarded.
    first = plan.indices(rank, 0)
    F.cross_entropy(model(ds.x_train[first]), ds.y_train[first]).backward()
    owner = ps_rref.owner()
    values, done, _ = rpc.rpc_sync(owner, ParameterServer.join, args=(ps_rref,), timeout=cfg.rpc_timeout)
    compute_s = exchange_s = 0.0
    steps = clock = 0
    while not done:
        t0 = time.perf_counter()
        # Loading the reply into the model is the exchange's (psgd's pull writes straight into the
        # model's flat buffer, and that counts as pull time).
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v)
        t1 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        idx = plan.indices(rank, clock)
        F.cross_entropy(model(ds.x_train[idx]), ds.y_train[idx]).backward()
        t2 = time.perf_counter()
        values, done, applied = rpc.rpc_sync(owner, ParameterServer.push_pull,
                                             args=(ps_rref, [p.grad for p in params]), timeout=cfg.rpc_timeout)
        exchange_s += (t1 - t0) + (time.perf_counter() - t2)
        compute_s += t2 - t1
        steps += int(applied)
        clock += 1
    return {"rank": rank, "steps": steps, "compute_s": compute_s, "exchange_s": exchange_s,
            "train_end": time.time(), "process_start": process_start_time()}


def backend_options(cfg: RunConfig, rendezvous: Path, tensorpipe: str) -> rpc.TensorPipeRpcBackendOptions:
    # A file rendezvous: no TCP store, whose peer-name lookups could leave the machine.
    kw = {"auto": {}, "uv": {"_transports": ["uv"]}, "sockets": {"_transports": ["uv"], "_channels": ["basic"]}}
    return rpc.TensorPipeRpcBackendOptions(init_method=f"file://{rendezvous.resolve()}",
                                           rpc_timeout=cfg.rpc_timeout, **kw[tensorpipe])


def drive(cfg: RunConfig, out: Path, tensorpipe: str) -> dict:
    """Rank 0 after init_rpc: serve, run the trainers, evaluate, write result.json."""
    ds = data_mod.load(cfg.data)
    ps = ParameterServer(cfg, ds.input_dim, ds.num_classes)
    ps_rref = rpc.RRef(ps)
    cfg_dict = json.loads((out / "config.json").read_text())
    # No deadline on the whole loop (0): each trainer's own calls carry cfg.rpc_timeout.
    futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref, cfg_dict, r), timeout=0)
            for r in range(cfg.workers)]
    ends = [f.wait() for f in futs]
    wall = max(e["train_end"] for e in ends) - ps.train_start
    final = torch.nn.utils.parameters_to_vector(ps.params).detach().clone()
    torch.save(final, out / "final_params.pt")
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    train_loss, _ = evaluate.evaluate(model, final, ds.x_train[:10_000], ds.y_train[:10_000])  # as psgd's finish
    test_loss, test_acc = evaluate.evaluate(model, final, ds.x_test, ds.y_test)
    n = len(ends)
    worker_steps = sum(e["steps"] for e in ends)
    result = {
        "system": "torch.distributed.rpc", "mode": cfg.mode, "workers": n, "params": final.numel(),
        "global_updates": ps.updates, "worker_steps": worker_steps, "wall_time_s": wall,
        "updates_per_s": ps.updates / wall if wall > 0 else 0.0,
        "startup_s": ps.train_start - min(e["process_start"] for e in ends), "train_start": ps.train_start,
        "final_train_loss": train_loss, "final_test_loss": test_loss, "final_test_accuracy": test_acc,
        "time_breakdown_s": {k: sum(e[f"{k}_s"] for e in ends) / n for k in ("compute", "exchange")},
        "per_worker_steps": {str(e["rank"]): e["steps"] for e in ends},
        "tensorpipe": tensorpipe,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str]) -> int:
    lifeline.die_with_launcher()  # started by `psgd bench peers`: die with it, however it dies
    p = argparse.ArgumentParser(prog="rpc_peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a psgd config.json (RunConfig); the run writes beside it")
    p.add_argument("--rank", type=int, required=True, help="0: server and driver; 1..N: trainers")
    p.add_argument("--tensorpipe", default="uv", choices=TENSORPIPE,
                   help="how TensorPipe moves bytes (see the module docstring); default uv")
    a = p.parse_args(argv)
    out = Path(a.config).parent
    cfg = from_dict(json.loads(Path(a.config).read_text()))
    check_config(cfg)
    torch.set_num_threads(1)  # as psgd's children (OMP_NUM_THREADS=1): several processes share few cores
    name = "ps" if a.rank == 0 else f"trainer{a.rank - 1}"
    rpc.init_rpc(name, rank=a.rank, world_size=cfg.workers + 1,
                 rpc_backend_options=backend_options(cfg, out / "rendezvous", a.tensorpipe))
    if a.rank == 0:
        drive(cfg, out, a.tensorpipe)
    rpc.shutdown()  # waits for every rank: the trainers stay until the driver is done with them
    return 0
