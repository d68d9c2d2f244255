"""Push and pull overlapped with compute (`psgd run --overlap`): the PS exchange's `Overlap`.

`Overlap(model, flat, client, staging, accumulate)` (--overlap) registers hooks on the model, then
drives each step in place of the plain pull-compute-push of `PSExchange`:

- `before_compute(clock)`: starts the pull of every shard and returns as soon as their headers
  are in (the consistency policy released the pull, `done` is known). The values keep streaming
  into the flat buffer while the worker fetches its batch and runs forward: a forward pre-hook
  on each module waits only for that module's own parameter range (chunks arrive in order, so
  the first layers can compute while the last ones are still on the wire).
- backward: a post-accumulate-grad hook on each parameter counts gradients in; once every
  parameter of shard k's range has its final gradient (after the last of `accumulate`
  micro-batches), shard k's push starts in the background. This is DDP's bucketing (Li et al.,
  VLDB 2020): a bucket's communication starts once all its gradients are ready. Here a bucket is
  a shard's key range, since the PS protocol takes one whole range per push: more shards give
  finer buckets. Backward produces the last layers first, so the last shards leave first.
- `after_compute(clock)`: starts any shard not started yet (a parameter that got no gradient),
  waits for every reply.

Same parameters, same gradients, same pushes as without --overlap, so a sync run ends with the
same weights; only the timing changes. Time spent blocked in a forward hook is pull time and is
reported as `overlapped_s` so that the worker does not count it as compute. Assumes each
module's parameters are used by that module's own forward (true for the zoo: Linear, Conv1d).

    psgd run --mode sync --workers 2 --servers 4 --model wide_mlp --width 3500 --overlap
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from psgd.core.step import StepReport
from psgd.ps.client import PSClient, PullStreams
from psgd.ps.staging import HostStaging


class Overlap:
    def __init__(self, model: nn.Module, flat, client: PSClient, staging: HostStaging, accumulate: int) -> None:
        self.flat, self.client, self.staging = flat, client, staging
        # On a GPU a shard's push waits for its device-to-host copy in one of these threads, not in
        # backward's hook, so that backward keeps queueing kernels meanwhile.
        self._copies = ThreadPoolExecutor(len(client.ranges), "psgd-d2h") if staging.staged else None
        base = flat.params.data_ptr()
        size = flat.params.element_size()

        def span(params: list[torch.Tensor]) -> tuple[int, int]:
            starts = [(p.data_ptr() - base) // size for p in params]
            assert min(starts) >= 0, "a parameter outside the flat buffer: build FlatParams(model) first"
            return min(starts), max(s + p.numel() for s, p in zip(starts, params, strict=True))

        def shards_of(a: int, b: int) -> list[int]:
            return [k for k, (lo, hi) in enumerate(client.ranges) if lo < b and a < hi]

        params = list(model.parameters())
        self._param_shards = [shards_of(*span([p])) for p in params]
        # Hook calls that complete shard k: one per parameter in its range per micro-batch.
        self._needed = [0] * len(client.ranges)
        for ks in self._param_shards:
            for k in ks:
                self._needed[k] += accumulate
        self._lock = threading.Lock()  # guards _pending and _futures (hooks may run on autograd threads)
        self._pending = list(self._needed)
        self._futures: list = [None] * len(client.ranges)
        self._streams: PullStreams | None = None
        self._clock = 0
        self._blocked_s = 0.0
        self._copied: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(params)]
        for m in model.modules():
            own = list(m.parameters(recurse=False))
            if own:
                self._handles.append(m.register_forward_pre_hook(self._forward_hook(id(m), *span(own))))

    # -- hooks ------------------------------------------------------------------------------------
    def _forward_hook(self, key: int, start: int, stop: int):
        def hook(module, args):
            if self._streams is None:
                return
            t0 = time.perf_counter()
            self._streams.wait_range(start, stop)
            if key not in self._copied:  # GPU: queue this layer's host-to-device copy (no wait)
                self.staging.to_device(start, stop)
                self._copied.add(key)
            self._blocked_s += time.perf_counter() - t0
        return hook

    def _grad_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            ready = []
            with self._lock:
                for k in self._param_shards[index]:
                    self._pending[k] -= 1
                    if self._pending[k] == 0:
                        ready.append(k)
            for k in ready:
                self._start_push(k)
        return hook

    def _start_push(self, k: int) -> None:
        with self._lock:
            if self._futures[k] is not None:
                return
            if self._copies is None:
                self._futures[k] = self.client.start_push(k, self._clock, self.flat.grads)
            else:
                ready = self.staging.to_host(*self.client.ranges[k])  # queued after backward's kernels so far
                self._futures[k] = self._copies.submit(self._push_when_copied, ready, k, self._clock)

    def _push_when_copied(self, ready, k: int, clock: int):
        ready.wait()  # shard k's gradient is on the host
        return self.client.start_push(k, clock, self.staging.grads).result()

    # -- one step -----------------------------------------------------------------------------------
    def before_compute(self, clock: int) -> StepReport:
        t0 = time.perf_counter()
        with self._lock:
            self._clock, self._pending = clock, list(self._needed)
            self._futures = [None] * len(self.client.ranges)
        self._blocked_s, self._copied = 0.0, set()
        self._streams = self.client.start_pull(clock, self.staging.host_params())
        headers = self._streams.wait_headers()
        done = self.client.over([h.done for h in headers])
        if not done:
            # Pushes may start during backward, before the pull's result is collected.
            self.client.versions = [h.version for h in headers]
        wait_s = max(h.wait_s for h in headers)
        return StepReport(done=done, pull_s=max(0.0, time.perf_counter() - t0 - wait_s), wait_s=wait_s,
                          clock_gap=max(h.clock_gap for h in headers), version=headers[0].version)

    def after_compute(self, clock: int) -> StepReport:
        t0 = time.perf_counter()
        assert self._streams is not None and clock == self._clock, "after_compute without its before_compute"
        pulled = self._streams.result()
        self._streams = None
        for k in range(len(self.client.ranges)):
            self._start_push(k)
        replies = [f.result() for f in self._futures]
        done, refused, sent = self.client.push_outcome(replies)
        # A sync push held for its turn (psgd/core/sync.py) is waiting, not pushing: as much of it as
        # this call spent blocked (the rest was overlapped with backward).
        elapsed = time.perf_counter() - t0
        waited = min(elapsed, max(r.wait_s for r in replies))
        return StepReport(done=done, counted=not refused, push_s=elapsed - waited, wait_s=waited,
                          pull_s=self._blocked_s, overlapped_s=self._blocked_s,
                          bytes_pulled=pulled.bytes, bytes_pushed=0 if refused else sent)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self._copies is not None:
            self._copies.shutdown(wait=True)
