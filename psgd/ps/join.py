"""`join_job`: a worker takes a slot in a job that is running already.

For `psgd worker --join` and `psgd.connect(join=True)`: `join_job(transport, flat)` takes a slot
in the running job, the first shard's pick, on every shard, and returns (worker id, first clock).
It first offers `flat` as an Init (the first Init of the run wins). A shard that refuses leaves
the others' admission undone (the worker cancels there, or Leaves them), so no shard waits for
it; a sync join whose step went past meanwhile is tried again from fresh versions. Failures
raise `ExchangeError` with one line.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec
from psgd.core.errors import ExchangeError
from psgd.core.sharding import shard_ranges
from psgd.ps import wire
from psgd.ps.transport import Transport


def join_job(transport: Transport, flat: torch.Tensor, attempts: int = 3) -> tuple[int, int]:
    """Take a slot in the running job on every shard (see the module docstring): (worker id, clock).
    First offers `flat` (the joiner's seeded parameters) as every worker does, so a join that comes
    before any worker's Init is not refused: the first Init wins, the others only check the length.

    Sync: the first step is two past the newest shard version (Info), named to every shard; the
    first shard picks the slot, the others take it in parallel. If one refuses (its step went past
    meanwhile), the admissions made are cancelled and the join tried again from fresh versions."""
    ranges = shard_ranges(flat.numel(), len(transport.addresses))
    shards = list(range(len(ranges)))
    values = flat.detach().to("cpu")
    transport.init(shards, lambda k: pb.TensorHeader(worker_id=0, dtype=wire.DTYPE_ENUMS["fp32"], shard=k,
                                                     num_elements=ranges[k][1] - ranges[k][0]),
                   lambda k: codec.encode(values[ranges[k][0]:ranges[k][1]], "fp32"))
    for attempt in range(attempts):
        infos = transport.info(shards)
        sync = infos[0].mode == "sync"
        at = max(i.version for i in infos) + 2 if sync else 0

        def request(k: int, worker: int | None = None, sync: bool = sync, at: int = at) -> pb.JoinRequest:
            return pb.JoinRequest(shard=k, any_slot=worker is None, worker_id=worker or 0, has_clock=sync,
                                  clock=at, num_elements=ranges[k][1] - ranges[k][0])
        first = transport.join(0, request(0))
        admitted, failure = [0], None
        rest = shards[1:]
        outcomes = _each(lambda k, w=first.worker_id, req=request: transport.join(k, req(k, w)), rest)
        for k, outcome in zip(rest, outcomes, strict=True):
            if isinstance(outcome, ExchangeError):
                failure = failure or outcome
            else:
                admitted.append(k)
        if failure is None:
            return first.worker_id, first.clock
        # Undo: a sync shard would otherwise wait for this worker from its first step, and the slot
        # would be lost. A shard whose answer was lost may have admitted it too: cancel there as well.
        for k in shards:
            try:
                transport.join(k, pb.JoinRequest(shard=k, worker_id=first.worker_id, cancel=True))
            except ExchangeError:
                if k in admitted:
                    with contextlib.suppress(ExchangeError):
                        transport.leave([k], first.worker_id)
        if attempt == attempts - 1 or "applied already" not in str(failure):
            raise failure
    raise AssertionError("unreachable")


def _each(fn, items: list) -> list:
    """fn(item) for each item in parallel threads; each result, or the ExchangeError it raised."""
    out: list = [None] * len(items)

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except ExchangeError as e:
            out[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
