"""What every transport shares about one transfer: its `Events`, and the check of a pull's header.

`Events` lets a caller follow a transfer chunk by chunk, per shard k: the emulated link paces
there (psgd/ps/transport.py `PacedTransport`), and --overlap's forward hooks wait on a pull's
progress (psgd/ps/pull_streams.py). `NO_EVENTS`: nobody listens (the fast paths); `chain(a, b)`:
both sets of callbacks, a's first. `check_pull_header(k, header, out)`: True when a pull's values
follow, False when the run is done; an `ExchangeError` when the shard announces the wrong length.

`Wire`, the base of every shipped transport, gives the `Transport` protocol's step-sized calls
their generic form, which a transport with a faster way overrides (psgd/ps/shm/transport.py):
- `push_pull_direct(shards, headers, grads, outs, on_sent, on_free)`: a dense PushPull of the
  tensors themselves; `on_free()` once `grads` may be written again, `on_sent()` once every request
  is out; returns (`push_pull`'s replies, the perf_counter of the last reply header). Generic:
  `push_pull` with each slice encoded in the wire dtype, both callbacks when the last is delivered.
- `lend(count)`: (params, grads), two fp32 buffers of `count` elements where the worker may keep
  its flat parameters and gradients so that a step copies nothing on its side, or None (generic).
- `fits(addresses, tls)` / `rank` (class-level): whether it can carry a worker's traffic to these
  shards, and its place when psgd/ps/transport.py `choose`s one (the highest that fits).
psgd/ps/grpc_transport.py and tcp_transport.py import these; neither imports the other's wire.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec
from psgd.core.errors import ExchangeError
from psgd.ps import wire


@dataclass(frozen=True)
class Events:
    """Callbacks along one transfer, per shard k; None = nobody listens (the fast paths)."""
    sending: Callable[[int], None] | None = None               # (k): a request starts out
    sent: Callable[[int, int], None] | None = None             # (k, bytes): before each payload chunk (gRPC's
                                                               #      PushPull: as it is queued for the call)
    replied: Callable[[int, object], None] | None = None       # (k, reply or PullHeader): its header is in
    received: Callable[[int, int, int], None] | None = None    # (k, bytes, elements so far): after each chunk
    delivered: Callable[[int], None] | None = None             # (k): a request's last byte is out (its payload
                                                               #      may be reused; not called on a failure)


NO_EVENTS = Events()


def chain(first: Events, then: Events) -> Events:
    """Both sets of callbacks, `first`'s before `then`'s."""
    def both(a, b):
        if a is None or b is None:
            return a or b
        return lambda *args: (a(*args), b(*args))[-1]
    return Events(*(both(getattr(first, f.name), getattr(then, f.name)) for f in dataclasses.fields(Events)))


def check_pull_header(k: int, header: pb.PullHeader, out: torch.Tensor) -> bool:
    """A pull's header (both transports): True when values follow, False when the run is done."""
    if header.done:
        return False
    if header.num_elements != out.numel():
        raise ExchangeError(f"shard {k} sent {header.num_elements} elements, expected {out.numel()}")
    return True



def push_pull_stepped(transport, shards: Sequence[int], header_of, payload_of, out_of,
                      on_sent: Callable[[], None] | None = None) -> tuple[list, float]:
    """`transport.push_pull` as a worker's step wants it: `on_sent()` once every shard's request is
    out (from a transport thread), and the perf_counter at which the last reply's header came in."""
    replied: list[float] = []  # appended from the shards' threads (list.append is atomic)
    delivered: set[int] = set()
    lock = threading.Lock()

    def on_delivered(k: int) -> None:
        with lock:
            last = k not in delivered and len(delivered) == len(shards) - 1
            delivered.add(k)
        if last:
            on_sent()
    results = transport.push_pull(shards, header_of, payload_of, out_of,
                                  Events(replied=lambda k, header: replied.append(time.perf_counter()),
                                         delivered=on_delivered if on_sent else None))
    return results, max(replied)


class Wire:
    """The generic step-sized calls of a transport (see the module docstring); subclass and override."""

    rank = 0  # `choose`: 0 = never chosen by itself

    @classmethod
    def fits(cls, addresses: Sequence[str], tls: bool) -> bool:
        return True

    def lend(self, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def push_pull_direct(self, shards: Sequence[int], headers, grads, outs, on_sent=None, on_free=None):
        dtype = wire.DTYPE_NAMES[headers[shards[0]].dtype]
        both = on_sent if on_free is None else on_free if on_sent is None else (lambda: (on_free(), on_sent()))
        return push_pull_stepped(self, shards, headers.__getitem__, lambda k: codec.encode(grads[k], dtype),
                                 outs.__getitem__, both)
