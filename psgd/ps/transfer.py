"""What every transport shares about one transfer: its `Events`, and the check of a pull's header.

`Events` lets a caller follow a transfer chunk by chunk, per shard k: the emulated link paces
there (psgd/ps/transport.py `PacedTransport`), and --overlap's forward hooks wait on a pull's
progress (psgd/ps/pull_streams.py). `NO_EVENTS`: nobody listens (the fast paths); `chain(a, b)`:
both sets of callbacks, a's first. `check_pull_header(k, header, out)`: True when a pull's values
follow, False when the run is done; an `ExchangeError` when the shard announces the wrong length.
psgd/ps/grpc_transport.py and tcp_transport.py import these; neither imports the other's wire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core.errors import ExchangeError


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

