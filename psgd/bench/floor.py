"""The floor of a parameter server's round trip on one host: `psgd bench roundtrip`'s `floor` arm.

Why: the no-server loop (`plain`) is the ceiling of the ratio issue 36 asks of psgd, but no design
with a server in another process can reach it: the server's step runs after the worker's backward,
not inside it, and two processes must wake each other twice per step. This arm measures the least
any such design pays on this machine, so that psgd's distance to it (its own overhead) and the
floor's to the ceiling (the price of a second process) are read apart, in the same invocation.

What it does, and nothing more (the least a server that owns its parameters must do):
- the worker (this process) holds its parameters and gradients as views of one shared-memory
  region (psgd's FlatParams layout: [parameters | gradients]), so neither a push nor a pull is a
  copy on its side;
- the server (a child forked before the clock starts) keeps its own copy of the parameters and the
  optimizer of the config (torch's, as the plain loop builds it: the same update arithmetic);
- each step: the worker computes its gradient, wakes the server (one byte on a socketpair), and
  blocks; the server steps its optimizer with the gradient where the worker wrote it, copies its
  parameters into the region, and wakes the worker. Blocking, not spinning: a server that spins
  holds a core that a worker on the same host needs, and psgd's shards block too.

Contract: one worker, psgd's model, batches and warm-up (as `torch_loop`, psgd/bench/transformer.py),
so the run computes what the plain loop does: its final loss is the plain loop's, bit for bit
(tests/test_bench.py holds this). Returns the fields `torch_loop` returns. The server exits when
the worker closes its end; the worker waits for it, so no process outlives the arm.
"""

from __future__ import annotations

import mmap
import os
import socket
import time
from collections.abc import Callable

from psgd.core.config import RunConfig


def floor_loop(cfg: RunConfig, make_optimizer: Callable) -> dict:
    """Run the floor arm of `cfg` (one worker, one server process); the fields of `torch_loop`.
    `make_optimizer(params, cfg)`: the plain loop's optimizer (transformer.py `make_optimizer`)."""
    import torch

    from psgd.train import assemble, launch

    torch.set_num_threads(launch.thread_budget(cfg))
    parts = assemble.worker_parts(cfg, 0, torch.device("cpu"))
    model, loss_fn = parts.model, parts.loss
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    region = mmap.mmap(-1, 8 * n)  # anonymous and shared: the forked server maps the same pages
    flat = torch.frombuffer(region, dtype=torch.float32)
    shared_params, shared_grads = flat[:n], flat[n:]
    offset = 0
    for p in params:  # the worker's parameters and gradients become views of the region (FlatParams' way)
        k = p.numel()
        shared_params[offset:offset + k].copy_(p.data.reshape(-1))
        p.data = shared_params[offset:offset + k].view_as(p)
        p.grad = shared_grads[offset:offset + k].view_as(p)
        offset += k
    xb, yb = parts.batches.micro(0)[0]
    loss_fn(model(xb), yb).backward()  # the warm-up psgd's worker and the plain loop do
    shared_grads.zero_()
    worker_end, server_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the server: never returns
        worker_end.close()
        _serve(server_end, shared_params, shared_grads, cfg, make_optimizer)
    server_end.close()
    ends, compute_s, loss = [], 0.0, 0.0
    try:
        for clock in range(cfg.steps):
            t0 = time.perf_counter()
            shared_grads.zero_()
            for xm, ym in parts.batches.micro(clock):
                out = loss_fn(model(xm), ym)
                out.backward()
                loss = float(out.detach())
            compute_s += time.perf_counter() - t0
            worker_end.sendall(b"g")  # the gradient is in the region
            if worker_end.recv(1) != b"p":  # the parameters are
                raise RuntimeError("the floor's server process ended in the middle of a step")
            ends.append(time.time())
    finally:
        worker_end.close()  # the server's recv sees the end and exits
        os.waitpid(pid, 0)
    return {"rank": 0, "ends": ends, "final_train_loss": loss, "threads": torch.get_num_threads(),
            "compute_s": compute_s}


def _serve(sock: socket.socket, shared_params, shared_grads, cfg: RunConfig, make_optimizer) -> None:
    """The server process: its own parameters, the config's optimizer; one update per wake-up."""
    import torch

    code = 0
    try:
        own = torch.nn.Parameter(shared_params.clone())
        opt = make_optimizer([own], cfg)
        while sock.recv(1) == b"g":
            own.grad = shared_grads
            opt.step()
            shared_params.copy_(own.detach())
            sock.sendall(b"p")
    except BaseException:  # noqa: BLE001 - the worker reads a closed socket and says so
        code = 1
    finally:
        os._exit(code)  # a forked child: never run the parent's cleanup
