"""All-reduce mode: the workers average their gradients among themselves; no parameter servers.

Contract: `CollectiveExchange` is the `psgd.core.step.Exchange` of `--mode allreduce`, so the worker loop
(stragglers, budget, metrics) is the same as in the PS modes.
- setup: join the process group, broadcast rank 0's parameters (every rank built the same seeded
  model, but another host's build need not agree), and build the run's optimizer (`psgd.core.optim.build`:
  torch's SGD or AdamW update) over the flat parameter buffer. Rank 0 snapshots version 0. Then a start
  barrier (`dist.barrier`): the worker loop's clock starts when every rank is ready.
- before_compute: nothing to fetch; every replica already holds the current parameters.
- after_compute: the flat gradient is cut into buckets of `--bucket-mb` MiB, each all-reduced
  (SUM) by torch.distributed (`--allreduce-impl library`) or by the hand-written ring
  (`ring`, psgd/allreduce/ring.py), divided by N, and every replica takes the same optimizer step (with
  the same linear warmup as a shard's optimizer). `done` after the `--steps`-th update.
- `--local-steps H` > 1 (local SGD, psgd/core/localsgd.py): every step is a local optimizer step on
  this replica; every H-th step the PARAMETERS are all-reduced (SUM, / N) instead, in the same
  buckets. The version counts these averaging rounds (snapshots, --check-every too), and
  `done` comes after `localsgd.rounds(--steps, H)` of them.
- Replica consistency: every `--check-every` updates and after the last one the ranks compare a
  SHA-256 of their parameters; if any differs every rank raises CollectiveError (exit 1).
- close: rank 0 writes OUT/replica-0.pt (its snapshots, every `--eval-every` updates, at 0 and
  at the end; `psgd run` evaluates them) and every rank writes OUT/replica-R.json (traffic,
  times, checks, final hash), which `summary_extra` (psgd/allreduce/summary.py) folds into summary.json.
- Rendezvous and backend (psgd/allreduce/group.py, re-exported here): the standard variables
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env://), which
  torchrun sets and `launch_args` sets for `psgd run`; nccl when each rank on a host has its own
  CUDA device, gloo otherwise (`--backend` overrides; nccl without one GPU per rank is a UsageError).
- Every collective carries `--rpc-timeout` as its deadline: a dead or stuck peer is a
  one-line CollectiveError, never a hang.
- Timing: the all-reduce counts as `push_s`. A collective cannot tell waiting for the slowest
  rank apart from moving bytes, so a straggler shows up there. `bytes_pushed` / `bytes_pulled`
  are what this rank sent / received: exact for the ring; for the library the textbook ring
  amount 2(N-1)/N x size, an estimate, since torch.distributed does not report its traffic.

Run it:
    psgd run --mode allreduce --workers 4 --model mlp --dataset mnist1d --steps 300 --out results/runs/ar4
    psgd run --mode allreduce --allreduce-impl ring --workers 4 --model mlp --dataset mnist1d --steps 300
    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 -m psgd worker --mode allreduce --workers 4 ...
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --master-addr HOST0 --master-port 29500 \\
        -m psgd worker --mode allreduce --workers 8 ...          # on each of two hosts
Under torchrun nobody evaluates the snapshots; rank 0 still writes OUT/replica-0.pt.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from psgd.allreduce.group import Rendezvous
from psgd.allreduce.group import choose_backend as choose_backend
from psgd.allreduce.group import free_port as free_port
from psgd.allreduce.group import launch_args as launch_args
from psgd.allreduce.group import usable_cuda_devices as usable_cuda_devices
from psgd.allreduce.ring import Traffic, ring_all_reduce, ring_bytes
from psgd.allreduce.summary import summary_extra as summary_extra
from psgd.core import codec, localsgd, optim
from psgd.core.config import OptimConfig
from psgd.core.devices import pick_device
from psgd.core.step import Flat, StepReport

MIB = 1 << 20
T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed (dead peer, timeout, diverged replicas); the message is one line."""


@dataclass(frozen=True)
class CollectiveOptions:
    """What an all-reduce replica does besides talking: its optimizer, budget, buckets, records."""
    optim: OptimConfig = OptimConfig()  # every replica steps the same optimizer (psgd/core/optim.py)
    outer: OptimConfig | None = None    # local SGD's outer step when it is not the plain average (DiLoCo)
    steps: int = 100                    # --steps: updates in all (local steps with --local-steps)
    local_steps: int = 1                # local SGD: average the parameters every H steps
    device: str = "auto"                # the worker's --device (nccl: which GPU this rank reduces on)
    bucket_mb: float = 25.0             # gradients reduced in flat buckets of this many MiB (DDP's 25)
    allreduce_impl: str = "library"     # torch.distributed's all_reduce, or the hand-written ring
    rpc_timeout: float = 60.0           # the process group's timeout
    eval_every: int = 20                # rank 0 snapshots the parameters every this many updates
    check_every: int = 50               # compare every replica's hash every this many updates
    out: str = ""                       # the run folder: rank 0's replica-0.pt, every rank's hash file


class CollectiveExchange:
    """worker.Exchange for --mode allreduce: one per process, driven by the worker's one thread.

    It owns the optimizer, the update counter, rank 0's snapshots and the traffic counters.
    psgd/train/assemble.py `collective_exchange` builds one from a run's config and the environment.
    """

    def __init__(self, cfg: CollectiveOptions, rdv: Rendezvous, backend: str) -> None:
        self.cfg, self.rdv, self.backend = cfg, rdv, backend
        self.n = rdv.world_size
        # nccl reduces on the rank's own GPU, the one the worker picks (psgd/core/devices.py:
        # cuda:LOCAL_RANK, as choose_backend made sure each rank has its own); gloo on the CPU (a
        # CUDA model is staged through it).
        self.comm_device = torch.device("cpu")
        if backend == "nccl":
            picked = pick_device(cfg.device, rdv.rank, rdv.local_rank, torch.cuda.device_count())
            self.comm_device = torch.device(picked)
            torch.cuda.set_device(self.comm_device)  # NCCL's communicator binds to the current device
        self.bucket_numel = max(1, int(cfg.bucket_mb * MIB) // 4)  # fp32 elements per bucket
        self.opt = None  # optim.build: SGD or AdamW
        self.local_steps = cfg.local_steps
        self.outer = cfg.outer if cfg.local_steps > 1 else None
        self.rounds = localsgd.rounds(cfg.steps, cfg.local_steps)  # updates in all; = --steps without local SGD
        self.failed = False  # a collective failed: close() then skips the final barrier
        self.joined = False  # a process group was set up (then `psgd worker` leaves by os._exit)
        self.version = 0
        self.snapshots: list[tuple[int, float, torch.Tensor]] = []  # rank 0: (version, unix time, params)
        self.stats = dict(bytes_sent=0, bytes_received=0, allreduce_s=0.0, optimizer_s=0.0, check_s=0.0,
                          checks=0)
        self.final_sha256 = ""

    # -- worker.Exchange -------------------------------------------------------------------------
    def setup(self, flat: Flat, rank: int) -> None:
        assert rank == self.rdv.rank, f"worker rank {rank} != rendezvous rank {self.rdv.rank}"
        timeout = datetime.timedelta(seconds=self.cfg.rpc_timeout)
        extra = {"device_id": self.comm_device} if self.backend == "nccl" else {}
        self._guard(f"rendezvous ({self.backend}, {self.n} ranks)", lambda: dist.init_process_group(
            self.backend, init_method=self.rdv.init_method, rank=self.rdv.rank, world_size=self.n,
            timeout=timeout, **extra))
        self.joined = True
        buf = self._on_comm_device(flat.params)
        self._guard("broadcast of the initial parameters", lambda: dist.broadcast(buf, src=0))
        if buf is not flat.params:
            flat.params.copy_(buf)
        flat.params.grad = flat.grads  # backward writes into grads, the optimizer reads them there
        self.opt = optim.build(flat.params, self.cfg.optim)
        if self.outer is not None:  # DiLoCo's global parameters, their outer gradient and outer optimizer
            self.global_params = flat.params.detach().clone()
            self.global_params.grad = torch.empty_like(self.global_params)
            self.outer_opt = optim.build(self.global_params, self.outer)
        self._snapshot(flat)
        # The start barrier: no rank trains before every rank is ready, so the worker loop's
        # train_start (taken right after setup) is the same instant on every rank and excludes
        # start-up, the model's build, the warm-up and the rendezvous.
        self._guard("start barrier", dist.barrier)

    def before_compute(self, clock: int, flat: Flat) -> StepReport:
        return StepReport()  # the replica is current: the last step was applied everywhere

    def after_compute(self, clock: int, flat: Flat) -> StepReport:
        assert self.opt is not None, "setup() must run first"
        local_s = 0.0
        if self.local_steps > 1:
            # Local SGD: a step on this replica alone; every H-th step ends a round, whose
            # all-reduce averages the parameters instead of the gradients (psgd/core/localsgd.py).
            t0 = time.perf_counter()
            self.opt.step()
            local_s = time.perf_counter() - t0
            self.stats["optimizer_s"] += local_s
            if (clock + 1) % self.local_steps:
                return StepReport(compute_s=local_s)
        t0 = time.perf_counter()
        reduced = flat.grads if self.local_steps == 1 else flat.params
        if self.outer is not None:
            # DiLoCo: all-reduce each replica's change since the round started, then the same outer
            # step on every replica's copy of the global parameters (psgd/core/localsgd.py).
            reduced = torch.sub(self.global_params, flat.params, out=self.global_params.grad)
        traffic = self._guard(f"all-reduce of update {self.version + 1}", lambda: self._all_reduce_mean(reduced))
        t1 = time.perf_counter()
        if self.local_steps == 1:
            self.opt.step()  # the same step on every replica (its schedule counts the updates)
            self.stats["optimizer_s"] += time.perf_counter() - t1
        elif self.outer is not None:
            self.outer_opt.step()
            flat.params.copy_(self.global_params)
            self.stats["optimizer_s"] += time.perf_counter() - t1
        self.version += 1
        self.stats["allreduce_s"] += t1 - t0
        self.stats["bytes_sent"] += traffic.sent
        self.stats["bytes_received"] += traffic.received
        done = self.version >= self.rounds
        if done or (self.cfg.eval_every and self.version % self.cfg.eval_every == 0):
            self._snapshot(flat)
        if done or (self.cfg.check_every and self.version % self.cfg.check_every == 0):
            self.final_sha256 = self.check_replicas(flat.params)
        return StepReport(done=done, push_s=t1 - t0, bytes_pushed=traffic.sent, bytes_pulled=traffic.received,
                          compute_s=local_s)

    def close(self, failed: bool = False) -> None:
        if self.opt is not None:
            out = Path(self.cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            if self.rdv.rank == 0:
                torch.save({"snapshots": self.snapshots}, out / "replica-0.pt")
            (out / f"replica-{self.rdv.rank}.json").write_text(json.dumps(self.report(), indent=1))
        if dist.is_initialized() and not (failed or self.failed):
            # Tear down together: a rank that destroys its group while a peer's gloo threads still
            # talk to it makes that peer abort at exit ("terminate called without an active
            # exception"). After a failure (here or in the loop) the ranks are no longer in step and a
            # peer may be gone: a barrier could pair with a peer's all-reduce or wait out the
            # timeout, so leave at once (`psgd worker` exits without the interpreter's teardown).
            self._guard("final barrier", dist.barrier)
            dist.destroy_process_group()

    # -- the parts -------------------------------------------------------------------------------
    def _all_reduce_mean(self, values: torch.Tensor) -> Traffic:
        """Average `values` (gradients, or local SGD's parameters) in place across the group, bucket by bucket."""
        buf = self._on_comm_device(values)
        # Buckets, as DDP makes them: bounded message sizes (and memory for staging), and the
        # library may overlap one bucket's reduction with the next one's transfer.
        buckets = buf.split(self.bucket_numel)
        if self.cfg.allreduce_impl == "ring":
            parts = [ring_all_reduce(b) for b in buckets]
            traffic = Traffic(sum(p.sent for p in parts), sum(p.received for p in parts))
        else:
            works = [dist.all_reduce(b, op=dist.ReduceOp.SUM, async_op=True) for b in buckets]
            for w in works:
                w.wait()
            # An estimate: the library does not report its traffic, and its ring moves this much.
            moved = sum(ring_bytes(b.numel(), self.n, b.element_size()) for b in buckets)
            traffic = Traffic(moved, moved)
        # SUM then divide once, as the sync PS does: the mean stays within float rounding of a
        # single process computing the whole global batch.
        buf.div_(self.n)
        if buf is not values:
            values.copy_(buf)
        return traffic

    def check_replicas(self, params: torch.Tensor) -> str:
        """Compare every rank's parameter hash; return the common hash or raise CollectiveError.

        After an all-reduce every rank holds bit-identical averaged gradients (each chunk is
        summed by one rank and copied to the rest), and the same optimizer step on the same
        inputs gives the same bits: any difference is a bug, or a corrupted replica.
        """
        t0 = time.perf_counter()
        digest = bytes.fromhex(codec.sha256(params))
        mine = torch.tensor(list(digest), dtype=torch.uint8, device=self.comm_device)
        everyone = [torch.empty_like(mine) for _ in range(self.n)]
        self._guard(f"replica check after update {self.version}", lambda: dist.all_gather(everyone, mine))
        hashes = [bytes(t.cpu().tolist()).hex() for t in everyone]
        self.stats["check_s"] += time.perf_counter() - t0
        differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
        if differ:
            raise CollectiveError(
                f"replicas differ after update {self.version}: rank(s) {', '.join(map(str, differ))} hold "
                f"parameters different from rank 0's (sha256 {hashes[differ[0]][:12]} vs {hashes[0][:12]}); "
                "after an all-reduce step every copy must be identical")
        self.stats["checks"] += 1
        return hashes[0]

    def report(self) -> dict:
        """This rank's OUT/replica-R.json."""
        return dict(self.stats, rank=self.rdv.rank, world_size=self.n, backend=self.backend,
                    allreduce_impl=self.cfg.allreduce_impl, bucket_mb=self.cfg.bucket_mb, updates=self.version,
                    bytes_estimated=self.cfg.allreduce_impl == "library", final_sha256=self.final_sha256,
                    replicas_consistent=bool(self.final_sha256))

    def _snapshot(self, flat: Flat) -> None:
        if self.rdv.rank == 0 and (not self.snapshots or self.snapshots[-1][0] != self.version):
            self.snapshots.append((self.version, time.time(), flat.params.detach().to("cpu", copy=True)))

    def _on_comm_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.comm_device else t.to(self.comm_device)

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run one collective; a backend failure becomes a one-line CollectiveError."""
        try:
            return fn()
        except CollectiveError:
            self.failed = True
            raise
        except (RuntimeError, ValueError) as e:  # DistBackendError, DistNetworkError, timeouts: RuntimeError
            self.failed = True
            raise CollectiveError(f"{what} failed on rank {self.rdv.rank} (a peer died or did not answer "
                                  f"within --rpc-timeout {self.cfg.rpc_timeout:g}s): {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    """The gist of a backend error: its first line, less gloo's source location and advice."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # "[.../gloo/transport/tcp/pair.cc:553] "
    return first.split(" This is typically")[0][:300]
