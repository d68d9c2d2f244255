"""The parameter-server step of the worker loop: pull before compute, push after (`PSExchange`),
or both overlapped with compute (`Overlap`, `psgd run --overlap`).

`PSExchange` is the `psgd.core.step.Exchange` of the PS modes: `setup` connects (`make_client`,
psgd/ps/client.py) and offers its seeded initial parameters (every worker does; the first Init
wins); `before_compute` pulls the parameters straight into the model's flat buffer;
`after_compute` pushes the flat gradient.
By default the push and the next pull are one round trip (PushPull): `after_compute` pushes the
gradient of clock c and receives the parameters of clock c + 1 in the reply, and the next
`before_compute` has nothing left to fetch (only clock 0 pulls on its own). The same requests
reach the same policy in the same order, so the parameters are the same bit for bit as with
`--separate-pull` (push, then pull: two round trips, the textbook pattern); the time of the
round trip is split at the first byte of the reply: before it, less the policy's holds, is push
time; after it, pull time. The holds are wait time, whichever part they held: a sync push waiting
for its turn (the lower-ranked workers' gradients of its step: psgd/core/sync.py `turn`), which the
shard reports in its PushReply, and a pull held by the policy.
With `local_steps` H > 1 (local SGD, sync or async, psgd/core/localsgd.py) the worker steps its own
replica with a local optimizer, pulls only at the start of each round of H steps and pushes the
delta w_pulled - w_local at its end; pull and push carry the round as clock.
A model on a GPU pulls into and pushes from pinned host buffers allocated once (`HostStaging`,
psgd/ps/staging.py); the plain exchange waits for each copy (host-to-device in pull time,
device-to-host in push time), `Overlap` queues them per layer and per shard without waiting.

`Overlap` (--overlap, psgd/ps/overlap.py) drives each step in place of the plain
pull-compute-push: pulls stream into forward, pushes leave during backward.

    psgd run --mode sync --workers 2 --servers 4 --model wide_mlp --width 3500 --overlap
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from psgd.core import link as link_mod
from psgd.core import optim
from psgd.core.config import OptimConfig
from psgd.core.errors import ExchangeError, UsageError
from psgd.core.step import StepReport
from psgd.ps.client import PSClient, make_client
from psgd.ps.overlap import Overlap
from psgd.ps.staging import HostStaging

__all__ = ["Overlap", "PSExchange"]


class PSExchange:
    """The parameter-server step of the worker loop: pull before compute, push after.

    With `overlap` (`Overlap`, below) the pull streams in while the batch loads and forward
    runs, and each shard's push starts as soon as backward has produced its gradients; `watch`
    (called by the worker loop with the model) installs the hooks that does this. With `link`
    ("1gbit,200us", psgd/core/link.py) every stream is paced to that emulated wire. `transport`
    names what carries the tensors (psgd/ps/transport.py; "auto": the fastest that reaches the shards).
    With `topk` (a fraction, --topk) each push sends the largest entries of each shard's slice, and
    with `error_feedback` the worker keeps the rest for its next push (psgd/core/sparsify.py).
    With `local_steps` H > 1 (local SGD, sync or async, psgd/core/localsgd.py) the worker steps its own
    replica with a local optimizer (`optim`), pulls only at the start of each round of H steps
    and pushes the delta w_pulled - w_local at its end; pull and push carry the round as clock.
    With `joins` (rank -> update: the scheduled joiners of --elastic) a joiner's `setup` waits for its
    admission at that update, however long that takes (`PSClient.wait_admitted`).
    """

    def __init__(self, addresses: list[str], wire_dtype: str = "fp32", rpc_timeout: float = 60.0,
                 link: str = "", overlap: bool = False, accumulate: int = 1, transport: str = "auto",
                 local_steps: int = 1, optim_cfg: OptimConfig | None = None, separate_pull: bool = False,
                 token: bytes | None = None, stage: bool | None = None, backup_workers: int = 0,
                 topk: float | None = None, error_feedback: bool = True, tls_ca: str = "",
                 joins: dict[int, int] | None = None) -> None:
        if local_steps > 1 and overlap:
            raise UsageError("--overlap pushes gradients during backward, --local-steps pushes a model delta every "
                             "H steps: use one or the other")
        self.addresses, self.wire_dtype, self.rpc_timeout = addresses, wire_dtype, rpc_timeout
        self.link, self.overlap, self.accumulate = link_mod.parse(link), overlap, accumulate
        self.transport, self.token = transport, token
        self.topk, self.error_feedback, self.tls_ca = topk, error_feedback, tls_ca
        self.local_steps, self.optim = local_steps, optim_cfg or OptimConfig()
        self.combined = not (separate_pull or overlap)  # --overlap streams its pulls apart, into forward
        # Backup workers: one shard may finish before another (psgd/ps/client.py): work on until all have.
        self.all_done = backup_workers > 0
        self.client: PSClient | None = None
        self._next = None  # the PushPull's pull, which the next before_compute hands to the loop
        self.start_clock = 0  # the loop's first step: 0, or a restored run's (setup learns it)
        self._overlap = None
        self._local = None  # local SGD: optim.build
        self.stage = stage  # host staging (psgd/ps/staging.py): None = when the model is on a GPU
        self.staging: HostStaging | None = None
        self.joins = joins or {}  # scheduled joiners (--elastic): rank -> the update it is in the run from
        # Work the loop hands over to be done while the shards answer a push (the previous step's
        # metrics line: psgd/train/metrics.py `defer`); the worker loop sets it.
        self.while_waiting: Callable[[], None] | None = None

    def setup(self, flat, rank: int) -> None:
        self.client = make_client(self.transport, self.addresses, rank, flat.params.numel(), self.wire_dtype,
                                  self.rpc_timeout, self.link, self.token, self.all_done, self.topk,
                                  self.error_feedback, self.tls_ca)
        infos = self.client.wait_ready()
        # A run resumed from checkpoints (psgd run --resume) or a restarted worker starts at the
        # clock its shards hold it at; every shard must agree, or the step numbers would disagree too.
        # They disagree when this worker's last process died between its pushes to two shards (the
        # launcher then rolls a sync run back to a checkpoint: psgd/train/launch.py `_split`), or when
        # they were restored from checkpoints of different steps. Its words "at different clocks"
        # are what the launcher looks for.
        starts = {tuple(i.clocks)[rank] if i.clocks else 0 for i in infos}
        if len(starts) > 1:
            raise ExchangeError(f"the shards hold worker {rank} at different clocks {sorted(starts)}: its last "
                                "process died between its pushes to them, or they were restored from checkpoints "
                                "of different steps")
        self.start_clock = starts.pop()
        # The flat buffers move where the transport would have them (memory the shard reads and writes
        # in place: no copy on this side of a PushPull), when they are what each step sends and receives.
        lent = self.client.lend(flat.params.numel()) if (self.combined and self.local_steps == 1 and not self.stage
                                                         and flat.params.device.type == "cpu") else None
        if lent is not None:
            flat.rehome(*lent)
        self.staging = HostStaging(flat.params, flat.grads, self.stage)
        # Every worker offers its seeded initial parameters (all build the same model): the first Init
        # wins and the others only check its length, so no one worker's loss before Init can stall
        # the job (a restored shard keeps its checkpoint). One model's worth of bytes per worker, once.
        self.client.init(flat.params)
        if self.joins.get(rank, 0) > 0:
            # Wait here, in the start-up, for the admission (any time away: a long poll). The first
            # step then pulls the same clock again and is served at once, on whichever path it takes
            # (--overlap's streams too).
            self.client.wait_admitted(self.start_clock, self.staging.host_params())
        if self.local_steps > 1:
            flat.params.grad = flat.grads  # backward writes into grads, the local optimizer reads them there
            self._local = optim.build(flat.params, self.optim)
            self._pulled = torch.empty_like(flat.params)  # w_pulled of the round (the delta's base)
            self._delta = torch.empty_like(flat.params)

    def watch(self, model, flat) -> None:
        if self.overlap:
            self._overlap = Overlap(model, flat, self.client, self.staging, self.accumulate)

    def before_compute(self, clock: int, flat):
        if self._overlap is not None:
            return self._overlap.before_compute(clock)
        if clock % self.local_steps:
            return StepReport()  # local SGD, inside a round: the replica trains on its own
        if self._next is not None:
            # PushPull brought these parameters with the last push; its time and bytes were
            # reported there.
            r, self._next = self._next, None
            return StepReport(done=r.done, clock_gap=r.clock_gap, version=r.versions[0])
        t0 = time.perf_counter()
        # The shards count rounds: without local SGD a round is one step and this is the clock.
        r = self.client.pull(clock // self.local_steps, self.staging.host_params())
        self._landed(r, flat)
        elapsed = time.perf_counter() - t0
        return StepReport(done=r.done, pull_s=max(0.0, elapsed - r.wait_s), wait_s=r.wait_s,
                          bytes_pulled=r.bytes, clock_gap=r.clock_gap, version=r.versions[0])

    def _landed(self, r, flat) -> None:
        """Pulled parameters are in the staging buffer: give them to the model (and local SGD).
        On a GPU the host-to-device copy is waited for, so that it counts as pull time."""
        if not r.done:
            self.staging.to_device().wait()
        if not r.done and self._local is not None:
            self._pulled.copy_(flat.params)

    def after_compute(self, clock: int, flat):
        if self._overlap is not None:
            return self._overlap.after_compute(clock)
        local_s = 0.0
        pushed = flat.grads
        if self._local is not None:
            # Local SGD: step this replica; at the end of a round push its delta from the pulled
            # model (the shards apply w - mean(delta), the replicas' average: psgd/core/localsgd.py).
            t0 = time.perf_counter()
            self._local.step()
            local_s = time.perf_counter() - t0
            if (clock + 1) % self.local_steps:
                return StepReport(compute_s=local_s)
            pushed = torch.sub(self._pulled, flat.params, out=self._delta)
        t0 = time.perf_counter()
        pushed = self.staging.host_copy(pushed)  # on a GPU: to the pinned host buffer (push time)
        if self.combined:
            # The gradient is zeroed for the next step while the shards answer, once the transport
            # frees it (on the CPU: a 17 MB memset is ~1.3 ms of a 4.3M-parameter step otherwise spent
            # before compute); if it never says so before the reply, the loop zeroes it.
            zero = flat.zero_grad if flat.grads.device.type == "cpu" else None
            o = self.client.push_pull(clock // self.local_steps, pushed, self.staging.host_params(),
                                      on_sent=self.while_waiting, on_free=zero)
            self._landed(o.pulled, flat)
            self._next = o.pulled
            end, r = time.perf_counter(), o.pulled
            return StepReport(done=o.done, counted=not o.refused, compute_s=local_s,
                              push_s=max(0.0, o.replied_at - t0 - o.wait_s), pull_s=end - o.replied_at,
                              wait_s=o.wait_s, bytes_pushed=0 if o.refused else o.sent, bytes_pulled=r.bytes)
        replies = self.client.push_replies(clock // self.local_steps, pushed)
        done, refused, sent = self.client.push_outcome(replies)
        elapsed, waited = time.perf_counter() - t0, max(r.wait_s for r in replies)  # waited: a sync push's turn
        return StepReport(done=done, counted=not refused, push_s=max(0.0, elapsed - waited), wait_s=waited,
                          bytes_pushed=0 if refused else sent, compute_s=local_s)

    def close(self, failed: bool = False) -> None:
        if self._overlap is not None:
            self._overlap.close()
        if self.client is not None:
            self.client.close(failed)
