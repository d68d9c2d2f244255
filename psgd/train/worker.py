"""The training loop of one worker; the gradient exchange is one pluggable step.

Contract: `train(exchange, model, batches, loss, rank=, options=, metrics=)` is given its objects
and builds none (psgd/train/assemble.py `worker_parts` makes them from a run's config: the model
seeded and identical in every process, built-in or the user's; the batch plan; the loss). It moves
the model's parameters into one flat buffer (`models.FlatParams`), then repeats until the
exchange says the budget is spent:

    exchange.before_compute(clock)   PS: pull the parameters from every shard (may block)
    forward / backward               loss(model(x), y) on `batches.micro(clock)` (--accumulate of them)
    exchange.after_compute(clock)    PS: push the gradient slices; all-reduce: reduce + step

An `Exchange` (psgd/core/step.py) owns everything mode-specific; PS modes use
`psgd.ps.exchange.PSExchange`, the all-reduce mode `CollectiveExchange`, and this loop does not
change between them. Straggler delays (`--straggler`, `--jitter`) are added to compute time: they
emulate a slower device. With `--local-steps H` (psgd/core/localsgd.py) the exchanges take a
local optimizer step after every compute and talk to the others every H steps only; `steps`
still counts this worker's steps. `exchange.close()` runs however the loop ends (with
`failed=True` after an error: then it waits for no peer).

Measuring the steady state: before the exchange's setup the worker runs one warm-up forward /
backward on its first batch and discards the gradients (`warm_up`). Then a start barrier:
the shards hold every worker's first pull until all N asked for it (psgd/core/consistency.py);
the all-reduce setup ends on `dist.barrier`. `train_start` is the moment that barrier let this
worker go, i.e. when its first `before_compute` was called plus the time the barrier held it
(reported as that call's `wait_s`, which the loop then zeroes). So every worker's train_start
is about the same instant, and process start-up, loading, the model's build, the warm-up and
waiting for slower starters are all outside wall time and outside every time split; the first
pull's transfer counts as step 0's pull time, as any other pull's does.

Device: the model's (assemble puts worker `rank` on `worker_device(--device, rank, local_rank)`, psgd/core/devices.py:
cuda:(LOCAL_RANK or rank) % GPUs, or the one --device names); on CUDA the loop synchronises the
device at the end of the warm-up and of backward, so compute time is the kernels' run, not their
launch. `worker_end` records the device, its name and the torch / CUDA versions.

Run one by hand (servers already up):
    psgd worker --rank 0 --servers 127.0.0.1:50051,127.0.0.1:50052 --workers 4 --mode sync ...
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import signal
import time
from dataclasses import dataclass

import torch

from psgd.core import devices
from psgd.core.step import Exchange, StepReport
from psgd.train import losses, models
from psgd.train.data import BatchPlan
from psgd.train.metrics import Metrics, process_start_time


def cuda_count() -> int:
    """CUDA devices torch can use here (0 on a CPU-only machine or build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_device(spec: str, rank: int, local_rank: int | None = None) -> torch.device:
    """Worker `rank`'s device on this host (psgd/core/devices.py); DeviceError if it is not here."""
    return torch.device(devices.pick_device(spec, rank, local_rank, cuda_count()))


def device_info(device: torch.device) -> dict:
    """What summary.json records of a worker's device: its name and the torch / CUDA versions."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return dict(device=str(device), device_name=name, torch_version=torch.__version__, cuda_version=torch.version.cuda)


def cpu_cgroup() -> str:
    """This process's cgroup in the cpu controller ("/" when none: the cores are shared), from the
    kernel's own record: what --cpu-quota put it in (psgd/train/cpulimit.py)."""
    try:
        for line in open("/proc/self/cgroup").read().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                return path
    except OSError:
        pass
    return ""


def sync_device(device: torch.device) -> None:
    """Wait until the device has run everything queued on it (a no-op on the CPU, which is never behind).

    CUDA kernels return before they run: a clock read right after backward would measure their
    launch, and the rest of compute would show up as push time (the push's device-to-host copy
    waits for it). The loop calls this at the boundaries it measures: end of warm-up, end of
    backward."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class LoopOptions:
    """How the loop runs, besides its objects: accumulation, an emulated slow device, a fault."""
    accumulate: int = 1             # micro-batches per push (--accumulate)
    delay_ms: float = 0.0           # extra compute per step: an emulated slower device (--straggler)
    jitter_ms: float = 0.0          # mean of a random extra delay per step (--jitter)
    jitter_tail: str = "exp"        # its distribution (--jitter-tail; see jitter_draw)
    jitter_seed: int = 0            # its random stream
    fail_step: int | None = None    # fault injection: SIGKILL this process at this step (--fail-at; -1: before setup)
    leave_at: int | None = None     # leave the run once a pull brings update >= this (--elastic's schedule)


class Batches:
    """Worker `rank`'s batches: slice `rank` of global batch `clock` of `plan` (psgd/train/batches.py),
    from the tensors `x`, `y` (on the worker's device)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, plan: BatchPlan, rank: int) -> None:
        self.x, self.y, self.plan, self.rank = x, y, plan, rank

    def micro(self, clock: int, accumulate: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Batch `clock` as `accumulate` micro-batches of (inputs, targets)."""
        idx = self.plan.indices(self.rank, clock).to(self.x.device)
        return [(self.x[m], self.y[m]) for m in idx.chunk(accumulate)]


def train(exchange: Exchange, model: torch.nn.Module, batches: Batches, loss: losses.Loss = losses.cross_entropy, *,
          rank: int = 0, options: LoopOptions = LoopOptions(), metrics: Metrics | None = None) -> dict:
    """Warm up, set the exchange up, and run steps until it says done; returns (and logs as
    `worker_end`) this worker's totals. The steps run in this function's own frame, so that the
    stack of a worker in its exchange is short (py-spy's view: tests/test_worker_frames.py)."""
    flat = models.FlatParams(model)
    loss_fn, jitter = loss, random.Random(options.jitter_seed)
    with _released_on_failure(exchange, metrics):
        ahead = _start(exchange, model, flat, batches, loss_fn, rank, options, metrics)
        totals = dict(steps=0, compute_s=0.0, pull_s=0.0, push_s=0.0, wait_s=0.0, bytes_pulled=0, bytes_pushed=0)
        clock = first = getattr(exchange, "start_clock", 0)  # > 0 when the shards were restored from checkpoints
        # Resumed past its scheduled departure (sync: clocks are steps): nothing to do.
        over = options.leave_at is not None and first >= options.leave_at
        train_start = time.time() if over else 0.0
        while not over:
            # At STEP, or at a scheduled joiner's first step when STEP comes before it (its clocks
            # start where the run was when it joined: an exact match would never come).
            if options.fail_step is not None and clock >= options.fail_step >= 0:
                if metrics is not None:
                    metrics.flush()  # the steps it took are on record, as they were before `defer`
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die like a crashed machine
            called = time.time()
            before = exchange.before_compute(clock, flat)
            if clock == first:
                # The start barrier held this first call (PS: the shards hold the clock-0 pull until all
                # N workers asked; all-reduce: setup ended on a barrier). Training starts when it let
                # go: the call's start plus its hold. What follows, the first pull's transfer, is step
                # 0's pull time; the hold itself is start-up, not wait (see the module docstring).
                train_start = called + before.wait_s
                before.wait_s = 0.0
            _add(totals, before)
            if before.done or (options.leave_at is not None and before.version >= options.leave_at):
                break  # (a scheduled departure: the exchange's close tells the shards, which shrink the quorum)
            loss_sum, compute_s = _compute(model, flat, ahead.take(clock), loss_fn, options, jitter)
            ahead.next = clock + 1
            after = exchange.after_compute(clock, flat)
            compute_s = max(0.0, compute_s - after.overlapped_s) + after.compute_s
            totals["compute_s"] += compute_s
            _add(totals, after)
            if metrics is not None:  # written while the next push is answered (`while_waiting`), or next
                metrics.defer(event="step", rank=rank, clock=clock, loss=loss_sum, compute_s=compute_s,
                              pull_s=before.pull_s + after.pull_s, wait_s=before.wait_s + after.wait_s,
                              push_s=after.push_s, clock_gap=before.clock_gap,
                              **({} if after.counted else {"counted": False}))
            clock += 1
            totals["steps"] += int(after.counted)
            if after.done:
                break
    return _finish(exchange, totals, train_start, rank, metrics, next(model.parameters()).device)


def _start(exchange: Exchange, model, flat, batches: Batches, loss_fn: losses.Loss, rank: int, options: LoopOptions,
           metrics: Metrics | None) -> Ahead:
    """Warm up, set the exchange up and give it its waiting work and hooks; the batches fetched ahead."""
    warm_up(model, flat, *batches.micro(0, options.accumulate)[0], loss_fn)
    if options.fail_step == -1:
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die while starting, before joining the shards
    exchange.setup(flat, rank)
    ahead = Ahead(batches, options.accumulate)
    if hasattr(exchange, "while_waiting"):  # work done while the shards answer a push, off the critical path
        exchange.while_waiting = ahead.fetch if metrics is None else lambda: (metrics.flush(), ahead.fetch())
    if hasattr(exchange, "watch"):
        exchange.watch(model, flat)  # after the warm-up: its backward must not trigger --overlap's pushes
    return ahead


@contextlib.contextmanager
def _released_on_failure(exchange: Exchange, metrics: Metrics | None):
    """On any failure of the loop: release connections, threads and files without waiting for peers
    that may be gone, then re-raise; the loop's own error is the one reported."""
    try:
        yield
    except BaseException as e:
        try:
            exchange.close(failed=True)
        except Exception as close_error:  # noqa: BLE001 - kept as a note on the real error
            e.add_note(f"closing the exchange failed too: {close_error}")
        if metrics is not None:
            try:
                metrics.flush()  # the last step's deferred line (after the close: a full disk must not skip it)
            except OSError as write_error:
                e.add_note(f"writing the last metrics line failed too: {write_error}")
        raise


def _finish(exchange: Exchange, totals: dict, train_start: float, rank: int, metrics: Metrics | None,
            device: torch.device) -> dict:
    if metrics is not None:
        metrics.flush()  # the last step's deferred line, before anything below may fail
    end = dict(totals, rank=rank, train_start=train_start, train_end=time.time(), process_start=process_start_time(),
               cpu_cgroup=cpu_cgroup(), **device_info(device))
    exchange.close()
    if metrics is not None:
        metrics.write(event="worker_end", **end)
    return end


PARETO_SHAPE = 1.5  # a finite mean and an infinite variance: a few steps take many times the mean


def jitter_draw(rng: random.Random, mean_ms: float, tail: str = "exp") -> float:
    """One step's random delay in ms, of mean `mean_ms` (0: none). `exp`: exponential, a memoryless
    tail. `pareto`: Pareto of shape 1.5 scaled to the same mean (minimum mean/3), whose largest of N
    draws grows like N^(2/3): the heavy tail of stragglers on shared machines that Chen et al. 2016
    ('Revisiting distributed synchronous SGD', Fig. 3) measured and built backup workers against."""
    if mean_ms <= 0:
        return 0.0
    if tail == "pareto":
        return mean_ms * (PARETO_SHAPE - 1) / PARETO_SHAPE * rng.paretovariate(PARETO_SHAPE)
    return rng.expovariate(1.0 / mean_ms)


class Ahead:
    """The next step's micro-batches, gathered while the shards answer this step's push (the
    exchange's `while_waiting`): off the critical path of a small model's step.
    A step that was not fetched ahead gathers its own; the batches are the same either way."""

    def __init__(self, batches: Batches, accumulate: int) -> None:
        self.batches, self.accumulate = batches, accumulate
        self.next = 0  # the step `fetch` gathers: set by the loop before each push
        self._clock: int | None = None
        self._got: list | None = None

    def fetch(self) -> None:
        self._clock, self._got = self.next, self.batches.micro(self.next, self.accumulate)

    def take(self, clock: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        got, self._got = self._got, None
        return got if self._clock == clock and got is not None else self.batches.micro(clock, self.accumulate)


def _compute(model, flat, micro: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: losses.Loss, options: LoopOptions,
             jitter: random.Random) -> tuple[float, float]:
    """A step's forward and backward over its micro-batches `micro`; returns (loss, compute seconds)."""
    t0 = time.perf_counter()
    # The emulated slow device delays the whole step's compute, before forward, so that a
    # gradient pushed during backward (--overlap) is not ready sooner than on such a device.
    extra_ms = options.delay_ms + jitter_draw(jitter, options.jitter_ms, options.jitter_tail)
    if extra_ms:
        time.sleep(extra_ms / 1000.0)  # emulated slow device, not synchronisation
    flat.zero_grad_once()
    loss_sum = 0.0
    for xb, yb in micro:
        # Mean loss per micro-batch / k: the k micro-batches together give the mean over
        # the worker's whole slice, so accumulation equals one bigger batch.
        loss = loss_fn(model(xb), yb) / options.accumulate
        loss.backward()
        flat.zeroed = False
        loss_sum += float(loss.detach())
    sync_device(flat.params.device)  # compute ends when backward has run, not when it was queued
    return loss_sum, time.perf_counter() - t0


def warm_up(model: torch.nn.Module, flat: models.FlatParams, x: torch.Tensor, y: torch.Tensor,
            loss_fn: losses.Loss = losses.cross_entropy) -> None:
    """One forward / backward on the worker's first (micro-)batch, gradients discarded.

    `x`, `y`: the worker's first (micro-)batch. The first pass pays one-off costs (allocator
    growth, kernel selection, lazy initialisation, CUDA context work) that are no part of the
    steady state: they are paid here, before the clock starts. Parameters are not touched, and no
    random number is drawn (the batch plan has its own generators; the jitter RNG is not used), so
    the run's results do not change.
    """
    loss_fn(model(x), y).backward()
    flat.zero_grad()
    sync_device(flat.grads.device)  # its kernels finish here, not inside step 0


def _add(totals: dict, r: StepReport) -> None:
    totals["pull_s"] += r.pull_s
    totals["push_s"] += r.push_s
    totals["wait_s"] += r.wait_s
    totals["bytes_pulled"] += r.bytes_pulled
    totals["bytes_pushed"] += r.bytes_pushed
