"""The floor of a parameter server's round trip on one host: `psgd bench roundtrip`'s `floor` arm.

Why: the no-server loop (`plain`) is the ceiling of the ratio issue 36 asks of psgd, and a design
with a server in another process pays for the second process: the server's step runs after the
worker's backward, not inside it, and two processes must wake each other twice per step. This arm measures the least
any such design pays on this machine, so that psgd's distance to it (its own overhead) and the
floor's to the ceiling (the price of a second process) are read apart, in the same invocation.

What it does, and nothing more (the least a server that owns its parameters must do):
- the worker (this process) holds its parameters and gradients as psgd's worker does (FlatParams:
  views of two flat buffers), the buffers in shared memory, so neither a push nor a pull is a copy
  on its side;
- the server (a child forked before the clock starts) keeps its own copy of the parameters and the
  optimizer of the config (torch's, as the plain loop builds it: the same update arithmetic);
- each step: the worker computes its gradient, wakes the server, and waits; the server steps its
  optimizer with the gradient where the worker wrote it, copies its parameters into the worker's,
  and wakes the worker. `wait="block"` (the `floor` arm): one byte on a socketpair, each process
  asleep in recv while the other works, as psgd's shards and workers wait. `wait="spin"` (the
  `floor-spin` arm): a step counter in shared memory that the waiting process reads in a loop, so no
  process ever sleeps: what is left is the price of the second process without its wake-ups, paid
  for with a core held busy (which a worker on the same host would want).

Contract: one worker, psgd's model, batches and warm-up (as `torch_loop`, psgd/bench/arms.py),
so the run computes what the plain loop does: its final loss is the plain loop's, bit for bit
(tests/test_bench.py holds this). Returns the fields `torch_loop` returns. The server exits when
the worker says the end (its socket closed, or -1 in its counter) or dies; the worker reaps it, and
stops with one line if the server dies first, so no process outlives the arm.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable

from psgd.core.config import RunConfig


def floor_loop(cfg: RunConfig, make_optimizer: Callable, wait: str = "block") -> dict:
    """Run the floor arm of `cfg` (one worker, one server process); the fields of `torch_loop`.
    `make_optimizer(params, cfg)`: the plain loop's optimizer (arms.py `make_optimizer`);
    `wait`: "block" or "spin" (see the module docstring)."""
    import torch

    from psgd.train import assemble, models, threads, worker

    if wait not in ("block", "spin"):
        raise ValueError(f"wait is block or spin, not {wait!r}")
    torch.set_num_threads(threads.thread_budget(cfg))
    parts = assemble.worker_parts(cfg, 0, torch.device("cpu"))
    model, loss_fn = parts.model, parts.loss
    # psgd's worker layout (parameters and gradients as views of two flat buffers), the buffers moved
    # into shared memory (in place: the views follow), which the forked server maps too.
    flat = models.FlatParams(model)
    flat.params.share_memory_()
    flat.grads.share_memory_()
    worker.warm_up(model, flat, *parts.batches.micro(0)[0], loss_fn)  # as psgd's worker and the plain loop
    counters = mmap.mmap(-1, 16)  # the spin's two steps, the worker's then the server's; shared with the fork
    worker_end, server_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the server: never returns
        worker_end.close()
        parent = os.getppid()
        bell = Bell(server_end, counters, wait, mine=8, theirs=0, alive=lambda: os.getppid() == parent)
        _serve(bell, flat.params, flat.grads, cfg, make_optimizer)
    server_end.close()
    bell = Bell(worker_end, counters, wait, mine=0, theirs=8, alive=lambda: os.waitpid(pid, os.WNOHANG)[0] == 0)
    ends, compute_s, loss = [], 0.0, 0.0
    try:
        for clock in range(cfg.steps):
            t0 = time.perf_counter()
            flat.zero_grad()
            for xm, ym in parts.batches.micro(clock):
                out = loss_fn(model(xm), ym)
                out.backward()
                loss = float(out.detach())
            compute_s += time.perf_counter() - t0
            bell.ring(clock + 1)  # the gradient of step `clock` is in the shared buffer
            if bell.wait(clock + 1) is None:  # the parameters are
                raise RuntimeError("the floor's server process ended in the middle of a step")
            ends.append(time.time())
    finally:
        bell.ring(-1)  # the server sees the end and exits
        worker_end.close()
        with contextlib.suppress(ChildProcessError):  # reaped already by a spin that found it dead
            os.waitpid(pid, 0)
    return {"rank": 0, "ends": ends, "final_train_loss": loss, "threads": torch.get_num_threads(),
            "compute_s": compute_s}


class Bell:
    """How the two processes wake each other: `ring(step)` says this side's step is done (-1: the
    end); `wait(step)` returns once the other side's is, or None when it ended or died. Block: one
    byte on the socketpair. Spin: an aligned int64 per side in shared memory (written after the
    tensors it announces; x86 keeps stores in order, which is what the spin relies on), read in a
    loop that looks every so often whether the other process still lives, `alive()` (a spinning
    orphan would hold a core forever)."""

    def __init__(self, sock: socket.socket, counters: mmap.mmap, how: str, mine: int, theirs: int,
                 alive: Callable[[], bool]) -> None:
        self.sock, self.counters, self.spin, self.alive = sock, counters, how == "spin", alive
        self.mine, self.theirs = mine, theirs

    def ring(self, step: int) -> None:
        if self.spin:
            struct.pack_into("q", self.counters, self.mine, step)
        elif step >= 0:
            self.sock.sendall(b"s")

    def wait(self, step: int) -> int | None:
        if not self.spin:
            return step if self.sock.recv(1) == b"s" else None
        polls = 0
        while (got := struct.unpack_from("q", self.counters, self.theirs)[0]) != step:
            if got < 0:
                return None
            polls += 1
            if polls % 100_000 == 0 and not self.alive():
                return None
        return got


def serve(bell: Bell, make_step: Callable[[], Callable[[int], None]]) -> None:
    """A forked server's life: `make_step()` builds its state and returns its step, run once per
    wake-up (rounds from 1) until the worker says the end; then the child exits, never returning."""
    code = 0
    try:
        step = make_step()
        round_ = 1
        while bell.wait(round_) is not None:
            step(round_)
            bell.ring(round_)
            round_ += 1
    except BaseException:  # noqa: BLE001 - the worker sees the end (-1, or the closed socket) and says so
        code = 1
        bell.ring(-1)
    finally:
        os._exit(code)  # a forked child: never run the parent's cleanup


def _serve(bell: Bell, shared_params, shared_grads, cfg: RunConfig, make_optimizer) -> None:
    """The server process: its own parameters, the config's optimizer; one update per wake-up."""
    import torch

    def make_step():
        own = torch.nn.Parameter(shared_params.clone())
        opt = make_optimizer([own], cfg)

        def step(_round: int) -> None:
            own.grad = shared_grads
            opt.step()
            shared_params.copy_(own.detach())
        return step

    serve(bell, make_step)
