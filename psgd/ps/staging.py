"""Host staging of a PS worker whose model lives on a GPU: the host buffers pulls land in and pushes leave from.

Contract: `HostStaging(params, grads, stage=None)` over the model's flat buffers (models.FlatParams):
- Model on the CPU (`stage` not forced): no staging. `params` / `grads` ARE the model's buffers, so
  a pull writes straight into the parameters and a push reads the gradient where backward left it;
  `to_device`, `to_host` and `host_copy` copy nothing. Zero copies and zero bytes, as before.
- Model on a CUDA device: two host buffers of the model's size, fp32, allocated once here and
  reused by every step (a pull's chunks land in `params`, a push sends from `grads`). They are
  page-locked (pinned): a copy between pinned memory and the device is a DMA transfer that runs
  while the CPU and the GPU's compute go on, where `non_blocking=True` from ordinary pageable
  memory is a synchronous copy through a driver bounce buffer. Memory: 2 x 4 bytes x parameters
  of pinned host RAM per worker (25M parameters: 200 MB), besides the model on the device.
  - `to_device(start, stop)` queues the host->device copy of params[start:stop] on a copy stream,
    after the work already queued on the compute stream (kernels that still read the old
    parameters), and makes the compute stream wait for it: it returns at once, and the forward
    queued after it runs once the bytes are there. --overlap calls it per layer, so the copy of
    a layer's range overlaps the compute of the layers before it.
  - `to_host(start, stop, source=grads)` queues the device->host copy of source[start:stop] into
    `grads` on the copy stream, after the work queued so far (the backward that produces those
    gradients), and returns a `Ready`: `wait()` blocks until the bytes are on the host. Send only
    after it. --overlap queues one per shard from backward's hooks and waits in a push thread,
    so shard k's copy and send overlap the backward of the layers before it.
  - `host_params()` waits for every `to_device` copy still reading `params` before a pull may
    overwrite them (on the copy stream, in order: waiting for the last one is enough).
- `stage=True` on a CPU model (tests): the same buffers and calls over plain memory, with
  synchronous copies and no streams, so the CPU-side logic (ranges, reuse of one allocation, copy
  before send) runs on any machine (tests/test_staging.py); only pinning and streams need a GPU
  (tests/test_gpu.py).
Used by one worker thread, and by --overlap's hook and push threads for disjoint ranges.
"""

from __future__ import annotations

import torch


class Ready:
    """A copy queued on the device: `wait()` returns once it has finished (at once on the CPU)."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostStaging:
    def __init__(self, params: torch.Tensor, grads: torch.Tensor, stage: bool | None = None) -> None:
        self.model_params, self.model_grads = params, grads
        self.staged = params.device.type != "cpu" if stage is None else stage
        self.pinned = False
        self._stream: torch.cuda.Stream | None = None
        self._loading = Ready()
        if not self.staged:
            self.params, self.grads = params, grads
            return
        cuda = params.device.type == "cuda"
        self.pinned = cuda  # pinning needs a CUDA driver; on a CPU model the buffers are plain memory
        self.params = torch.empty(params.numel(), dtype=torch.float32, pin_memory=cuda)
        self.grads = torch.empty(grads.numel(), dtype=torch.float32, pin_memory=cuda)
        if cuda:
            self._stream = torch.cuda.Stream(params.device)

    def host_params(self) -> torch.Tensor:
        """The buffer a pull writes into, once no queued copy reads it any more."""
        self._loading.wait()
        return self.params

    def to_device(self, start: int = 0, stop: int | None = None) -> Ready:
        """Queue params[start:stop] host -> model; the compute stream waits for it (see the docstring)."""
        if not self.staged:
            return Ready()
        ready = self._copy(self.model_params[start:stop], self.params[start:stop], compute_waits=True)
        self._loading = ready
        return ready

    def to_host(self, start: int = 0, stop: int | None = None, source: torch.Tensor | None = None) -> Ready:
        """Queue source[start:stop] (default: the gradient) model -> grads[start:stop]; wait() before sending."""
        if not self.staged:
            return Ready()
        source = self.model_grads if source is None else source
        return self._copy(self.grads[start:stop], source[start:stop], compute_waits=False)

    def host_copy(self, source: torch.Tensor) -> torch.Tensor:
        """`source` (the gradient, or local SGD's delta) on the host, ready to send: itself when not staged."""
        if not self.staged:
            return source
        self.to_host(source=source).wait()
        return self.grads

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, compute_waits: bool) -> Ready:
        if self._stream is None:
            dst.copy_(src)  # CPU: synchronous, done when it returns
            return Ready()
        compute = torch.cuda.current_stream(self.model_params.device)
        self._stream.wait_stream(compute)  # after the kernels queued so far (they read or write src / dst)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        if compute_waits:
            compute.wait_stream(self._stream)  # kernels queued from now on see the copied values
        return Ready(event)
