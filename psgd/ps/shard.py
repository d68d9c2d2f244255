"""One parameter shard, transport-free: parameters, optimizer, policy, buffers, snapshots, stats.

The mechanism of a shard; `psgd/core/consistency.py` is its policy and decides when. The gRPC
servicer (psgd/ps/grpc_server.py) and the raw-TCP data plane (psgd/ps/tcp_server.py) are thin
adapters that move bytes in and out around it, so every check and every state change is written
once, whichever transport (or future transport) carries the bytes. `Shard` is this file's core
(init, push, turn, the optimizer step, the remedies' glue) and three parts: psgd/ps/snapshots.py
(pulls, snapshots, buffer pools), membership.py (join, leave, loss), persist.py (checkpoints, save).

Contract (every method thread-safe; a refusal raises `ShardError(code, message)` and changes nothing):
- `init(values)`: the first caller's values become the parameters (later calls only check the
  length): returns (version, whether this caller initialised). Until then pushes are refused
  with FAILED_PRECONDITION and pulls wait.
- `check_init(worker_id, shard, num_elements)`: an Init header, checked against the shard's
  length from the server's config (`num_params`) when given, before any memory is sized by it.
- `check_push(worker_id, shard, num_elements, sparse_count)`: validates a push's header before any
  byte of its data is read. `turn(worker_id, clock, timeout)`: then waits, still before any byte is
  read, until the policy takes that worker's gradient next (sync folds a step in worker order, so an
  early push waits in its worker, not in the shard's memory: psgd/core/sync.py `turn`); returns the
  seconds waited (the reply's `wait_s`: waiting, not pushing); DEADLINE_EXCEEDED after `timeout`.
  `receive_buffer()`: a reused fp32 buffer of the shard's length to read it into.
- A sparse push (--topk) arrives as indices and values; its adapter scatters them into the pooled
  buffer (psgd/core/sparsify.py `Scatter`), so `push` always sees a dense gradient and every
  policy and the optimizer work unchanged; `check_push` refuses a count above the shard's length.
- `push(worker_id, clock, base_version, grad, dtype, wire_bytes)`: a non-finite gradient is refused (or with
  `--skip-nonfinite` counted and skipped); the policy buffers or applies it; returns the
  policy's `PushOutcome` (done once the run's budget is spent). The caller keeps `grad`, except
  a buffer from `receive_buffer()`: sync may keep that one as its step's sum instead of copying
  it, and the buffer it gives back goes to the pool in its place.
- `pull(worker_id, shard, clock, dtype, timeout)`: a context manager; waits for the policy, then
  gives a `Pulled` whose `values` are the parameters of one version in the wire dtype, which no
  later update changes, or None when the run is done (lent, read-only; a joiner's first pull as a
  long poll: psgd/ps/snapshots.py).
- PushPull, the combined exchange: `push` of clock c, then `next_pull(outcome, ...)`, the `pull` of
  clock c + 1 (the parameters the worker computes on next, once the policy allows), or at once a
  done Pulled when the push said the budget is spent. Two calls, so that an adapter gives the
  received gradient's buffer back before the pull may be held.
- Every update is one step of the run's optimizer (`psgd.core.optim.build`: torch's SGD update
  with momentum, weight decay and a linear warmup, or AdamW's) on the shard tensor, so a sync run
  reproduces single-process training. With `--local-steps H` > 1 a push is a worker's model delta
  and the step the outer one (core/localsgd.py): the average w - mean(delta), or DiLoCo's Nesterov.
- Start barrier: every worker's first pull (clock 0) is held until all N workers asked for it;
  its `wait_s` includes the time it waited for the first Init before that.
- `join`, `cancel_join`, `leave`, `expire`, `lose`: who is in the run (psgd/ps/membership.py).
- Snapshots every `--eval-every` updates, checkpoints, `stats` and `save(out)`: psgd/ps/persist.py.
- `--link`: `link_in` / `link_out` pace this shard's NIC (pushes in, pulls out, shared by the N
  workers' streams); the adapters pace each chunk with them (gRPC: psgd/core/link.py `paced`).
- A sync round in which every gradient was skipped (--skip-nonfinite) counts as an update but
  takes no optimizer step, so it does not advance the warmup schedule either.
- Remedies for stale gradients (async / SSP; the arithmetic is psgd/core/staleness.py), applied by
  the policy's `adjust` callback under the lock, before the step: `--staleness-lr` divides a
  gradient of staleness tau by max(1, tau); `--dc-lambda L` adds L * g * g * (w_now - w_then).
  w_then is the snapshot the pushing worker pulled last (in the wire dtype: exactly what it
  received), kept lent to it from its pull to its push: no copy beyond the pull's own, but up to
  N snapshots stay alive (N x the shard's length x the wire dtype's bytes; `stats` reports the
  peak). A push whose base version is not the version that worker last pulled from this shard is
  refused (FAILED_PRECONDITION): there is no w_then to compensate it with. Nothing extra crosses
  the wire.

Locking: the policy's condition (`self.lock`, the policy's `cond`) is the one lock of the shard;
it guards the parameters, the optimizer, the snapshots and the counters. The policy calls
`_apply` and the pull's read callback with it held. Decoding and sending happen outside it.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from psgd.core import codec, link
from psgd.core.consistency import Policy, PolicyError, PushOutcome
from psgd.core.errors import Code, ShardError
from psgd.ps.membership import Membership
from psgd.ps.persist import Persistence
from psgd.ps.snapshots import Lending, Pulled, _Slot, _Snapshot

__all__ = ["Pulled", "Shard", "ShardOptions", "all_finite"]


@dataclass(frozen=True)
class ShardOptions:
    """The mechanism's settings of one shard (its policy and its optimizer are objects of their own)."""
    num_shards: int = 1               # K, for Info
    mode: str = "sync"                # the policy's name, for Info and the checkpoints' identity
    expected: int | None = None       # the shard's length when the server knows the model, else the first Init's
    eval_every: int = 0               # snapshot the parameters every this many updates (0: at 0 and the end)
    checkpoint_every: int = 0         # write a checkpoint every this many updates (0: never)
    checkpoint_dir: str = ""          # where (psgd run: OUT/checkpoints)
    skip_nonfinite: bool = False      # count and skip a non-finite gradient instead of refusing it
    fail_at: int | None = None        # fault injection: SIGKILL this process once the version reaches it
    link: str = ""                    # pace this shard's NIC to an emulated link (psgd/core/link.py)
    rpc_timeout: float = 60.0         # the longest a pull may be held (the adapters' deadline)
    # Each worker's intra-op threads (train/threads.py): a shard's wait for a push spins (shm) only where they and the
    # shards fit the cores, never beside a row service (`serves_rows`: it needs this process's GIL meanwhile).
    worker_threads: int = 1
    serves_rows: bool = False


Optimizer = Any  # psgd/core/optim.py: step(), param, state_dict() / load_state_dict(); optim.OPTIMIZERS
Remedy = Any     # psgd/ps/remedies.py: adjust / pulled / forget


class Shard(Lending, Membership, Persistence):
    """One shard: `Shard(index, policy, optimizer, options, remedies)`.

    `policy` (psgd/core/consistency.py) decides when a gradient is applied and a pull served; the
    shard attaches its own `apply` (the optimizer step) and, with remedies, `adjust` to it.
    `optimizer(param)` builds the optimizer over the shard's tensor once the first Init gives it
    (`functools.partial(psgd.core.optim.build, cfg=..., fused=True)`). `remedies`
    (psgd/ps/remedies.py) correct stale gradients. psgd/train/assemble.py builds them from a run's config.
    """

    def __init__(self, index: int, policy: Policy, optimizer: Callable[[torch.Tensor], Optimizer],
                 options: ShardOptions | None = None, remedies: tuple[Remedy, ...] = ()) -> None:
        self.index, self.options = index, options or ShardOptions(mode=policy.name)
        assert 0 <= index < self.options.num_shards, f"shard {index} out of range for {self.options.num_shards}"
        assert self.options.mode == policy.name, f"options say {self.options.mode}, the policy is {policy.name}"
        self.expected = self.options.expected
        self.policy, self._make_optimizer, self.remedies = policy, optimizer, tuple(remedies)
        assert not (self.remedies and policy.name == "sync"), "remedies correct stale gradients: sync has none"
        policy.attach(self._apply, self._adjust if self.remedies else None)
        self.workers = policy.num_workers
        self.lock = self.policy.cond
        self.param: torch.Tensor | None = None
        self.opt: Optimizer | None = None  # made by init, over the first Init's values
        self.ready = threading.Event()
        self.left: set[int] = set()  # workers that said they finished (Leave)
        self.finished = threading.Event()  # set once all N workers have left
        self.snapshots: list[tuple[int, float, torch.Tensor]] = []  # (version, unix time, params)
        self.bytes_in = self.bytes_out = 0
        self.apply_s = 0.0
        self._pending: dict | None = None  # a checkpoint taken under the lock, not written yet
        self.checkpoints, self.checkpoint_s = 0, 0.0
        self.restored_from: int | None = None  # the version a `restore` started from
        lk = link.parse(self.options.link)
        self.link_in = link.Pacer(lk) if lk else None
        self.link_out = link.Pacer(lk) if lk else None
        # Scratch buffers (received gradients, pull snapshots) per dtype, reused across requests: a fresh
        # 64 MiB tensor costs ~3x a copy into a warm one here (page faults); concurrent requests need their own.
        self._pools: dict[torch.dtype, queue.SimpleQueue[torch.Tensor]] = {
            dt: queue.SimpleQueue() for dt in codec.WIRE_DTYPES.values()}
        self._current: dict[torch.dtype, _Snapshot] = {}  # the newest snapshot per wire dtype
        self._receiving: dict[int, _Slot] = {}  # receive buffers lent out and not yet pushed, by id
        self.allocated: dict[torch.dtype, int] = {}  # pool buffers ever made, per dtype (stats)
        self._lent = 0  # receive buffers out of the pool now
        self.copies_on_write = 0  # updates that found the parameters lent to a pull (see `_snapshot`)
        self._corrected: torch.Tensor | None = None  # a remedy's corrected gradient (`scratch`)
        self.remedy = {"gradients": 0, "step_scale_sum": 0.0, "dc_relative_sum": 0.0, "dc_then_peak_bytes": 0}

    @property
    def num_elements(self) -> int:
        return 0 if self.param is None else self.param.numel()

    # -- the policy's callback (lock held) ------------------------------------------------------
    def _apply(self, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        self._unshare_params()
        self.param.grad = grad
        self.opt.step()
        self.param.grad = None  # the gradient's buffer goes back to the pool after the push
        version = self.policy.version  # the version this update makes (the policy counted it)
        if self.options.eval_every and version % self.options.eval_every == 0:
            self.snapshots.append((version, time.time(), self.param.detach().clone()))
        if self.options.checkpoint_every and version % self.options.checkpoint_every == 0:
            # A consistent cut, right after an update (in sync the next step's sum is still empty): copied
            # here under the lock, written by the pushing thread once the lock is free.
            self._pending = self.state()
        self.apply_s += time.perf_counter() - start

    def _adjust(self, grad: torch.Tensor, worker: int, tau: int) -> torch.Tensor | None:
        """The remedies' gradient for `grad` of staleness `tau` from `worker` (the policy's adjust
        callback, lock held): each remedy in turn (psgd/ps/remedies.py). None: skip it."""
        out: torch.Tensor | None = grad
        for remedy in self.remedies:
            out = remedy.adjust(self, out, worker, tau)
            if out is None:
                return None
        self.remedy["gradients"] += 1
        if not any(getattr(r, "scales", False) for r in self.remedies):
            self.remedy["step_scale_sum"] += 1.0
        return out

    # -- requests -------------------------------------------------------------------------------
    def init(self, values: torch.Tensor, opt: Optimizer | None = None) -> tuple[int, bool]:
        """The first caller's values become the parameters; returns (version, this caller did it).
        `opt`: an optimizer over `values` already (a restored one), else the shard builds it."""
        with self.lock:
            if self.param is None:
                self.param = values
                self.opt = opt if opt is not None else self._make_optimizer(values)
                self.snapshots.append((0, time.time(), values.clone()))
                self.ready.set()
                return self.policy.version, True
            if values.numel() != self.param.numel():
                raise ShardError(Code.INVALID_ARGUMENT,
                                 f"shard {self.index} holds {self.param.numel()} elements; Init sent "
                                 f"{values.numel()}: another model")
            return self.policy.version, False

    def check_init(self, worker_id: int, shard: int, num_elements: int) -> None:
        """Validate an init's header before any byte of its data is read or any memory sized by
        it: its length must be the server's own (`expected`), else the first init's (in `init`)."""
        self._check_sender(worker_id, shard)
        if self.expected is not None and num_elements != self.expected:
            raise ShardError(Code.INVALID_ARGUMENT, f"shard {self.index} of this model has {self.expected} elements; "
                             f"Init header says {num_elements}")
        if not 0 < 4 * num_elements <= codec.MAX_TENSOR_BYTES:
            raise ShardError(Code.INVALID_ARGUMENT, f"Init header says {num_elements} elements "
                             f"(1..{codec.MAX_TENSOR_BYTES // 4})")

    @property
    def max_payload(self) -> int:
        """The most bytes any request to this shard carries: a sparse push (--topk) of every element,
        an int32 index and an fp32 value each; before the length is known, codec.MAX_TENSOR_BYTES."""
        n = self.expected if self.expected is not None else self.num_elements
        return 8 * n if n else codec.MAX_TENSOR_BYTES

    def check_push(self, worker_id: int, shard: int, num_elements: int, sparse_count: int = 0) -> None:
        """Validate a push's header before any byte of its data is read (`sparse_count`: the
        entries of a sparse push, 0 for a dense one)."""
        if not self.ready.is_set():
            raise ShardError(Code.FAILED_PRECONDITION, f"shard {self.index} is not initialised yet")
        self._check_sender(worker_id, shard)
        if num_elements != self.num_elements:
            raise ShardError(Code.INVALID_ARGUMENT,
                             f"shard {self.index} has {self.num_elements} elements, header says {num_elements}")
        if sparse_count > num_elements:
            raise ShardError(Code.INVALID_ARGUMENT,
                             f"sparse push of {sparse_count} entries for a shard of {num_elements} elements")

    def _check_sender(self, worker_id: int, shard: int) -> None:
        if shard != self.index:
            raise ShardError(Code.INVALID_ARGUMENT, f"tensor for shard {shard} sent to shard {self.index}")
        if worker_id >= self.workers:
            raise ShardError(Code.INVALID_ARGUMENT, f"worker id {worker_id} out of range 0..{self.workers - 1}")

    def turn(self, worker_id: int, clock: int, timeout: float | None) -> float:
        """Before a checked push's data is read: wait for its turn; the seconds waited (module docstring)."""
        try:
            start = time.perf_counter()
            if not self.policy.turn(worker_id, clock, timeout, lambda: self._lent == 0):
                raise ShardError(Code.DEADLINE_EXCEEDED, f"worker {worker_id}'s push of clock {clock} waited "
                                 f"{timeout}s for the lower-ranked workers' gradients of its step")
        except PolicyError as e:
            raise ShardError(Code.INVALID_ARGUMENT, str(e)) from None
        return time.perf_counter() - start

    def push(self, worker_id: int, clock: int, base_version: int, grad: torch.Tensor, dtype: str,
             wire_bytes: int | None = None) -> PushOutcome:
        """Hand one received gradient (header checked) to the policy; `dtype` is what it travelled as,
        `wire_bytes` the bytes it took (default: dense, every element in `dtype`)."""
        skipped = False
        if not all_finite(grad):
            if not self.options.skip_nonfinite:
                raise ShardError(Code.INVALID_ARGUMENT,
                                 f"non-finite gradient from worker {worker_id} at clock {clock} refused "
                                 "(run servers with --skip-nonfinite to skip such gradients)")
            skipped = True
        # A receive buffer is the shard's own: the policy may keep it rather than copy it. Its entry leaves
        # `_receiving` now, so a later borrow of the buffer has its own (a live entry's id is `grad`'s).
        slot = self._receiving.pop(id(grad), None)
        try:
            out = self.policy.push(worker_id, clock, base_version, None if skipped else grad, keep=slot is not None)
        except PolicyError as e:
            raise ShardError(Code.INVALID_ARGUMENT, str(e)) from None
        if out.kept:
            slot.back = out.spare
        if self._pending is not None:
            # Written before this push is answered: who sees the next version knows the checkpoint is on disk.
            self._write_pending()
        if self.options.fail_at is not None and out.version >= self.options.fail_at:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection (--fail-shard-at): die like a crashed host
        with self.lock:
            self.bytes_in += grad.numel() * codec.itemsize(dtype) if wire_bytes is None else wire_bytes
        return out

    def close(self) -> None:
        """Release held pulls (they return done) and refuse further pushes."""
        self.policy.close()


def all_finite(t: torch.Tensor) -> bool:
    """True when no element is NaN or +-inf.

    A finite sum implies finite elements (NaN and inf propagate through addition), and a sum costs
    one pass without temporaries where `isfinite(t).all()` builds a bool tensor (an order of
    magnitude slower on large shards); only a non-finite sum (or one that overflowed) takes the
    exact test. The sum is read as a Python float (exact for a float32).
    """
    return math.isfinite(t.sum().item()) or bool(torch.isfinite(t).all())
