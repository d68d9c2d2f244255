"""03 - one update by hand, through a real shard server's Push and Pull (gRPC on 127.0.0.1).

What it shows: what crosses the wire in one parameter-server step, message by message. One shard
server (psgd/ps/server.py: a Shard behind its gRPC service) holds a 4-number "model". The Shard is
given its pieces as objects: the async policy for 2 workers (psgd/core/consistency.py) and an
optimizer factory, SGD with lr 0.1 and no momentum (psgd/core/optim.py); `psgd run` builds the
same from its flags (psgd/train/assemble.py). Two workers, written out by hand with the
transport psgd's client uses (psgd/ps/transport.py), then:

  1. Info and Init: worker 0 offers the initial values (the first Init wins);
  2. Pull at clock 0 by both workers: the start barrier holds each until both have asked;
  3. worker 1 pushes a gradient computed on version 0: applied at once, staleness 0, version 1;
  4. worker 0 pushes its gradient, also computed on version 0: the shard is at version 1 now,
     so its staleness is 1 (async applies it anyway); version 2;
  5. worker 1 pulls again, in fp16 this time: half the bytes, values rounded to fp16.

Every header field printed is a field of protos/psgd/v1/parameter_server.proto.

    python examples/03_push_pull_by_hand.py
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec, optim
from psgd.core.config import OptimConfig
from psgd.core.consistency import make_policy
from psgd.core.errors import ExchangeError
from psgd.ps import server
from psgd.ps.shard import Shard, ShardOptions
from psgd.ps.transport import Transport, make_transport

LR = 0.1
WORKERS = 2


def header(worker: int, clock: int, base_version: int, n: int) -> pb.TensorHeader:
    """The first message of a Push or Init stream: who sends, for which clock, computed on which version."""
    return pb.TensorHeader(worker_id=worker, clock=clock, base_version=base_version, dtype=pb.FP32, shard=0,
                           num_elements=n)


def push(t: Transport, worker: int, clock: int, base_version: int, grad: torch.Tensor) -> pb.PushReply:
    """One Push of a whole gradient to shard 0; prints what was sent and the shard's reply."""
    print(f"worker {worker} Push  clock {clock}, base_version {base_version}, {grad.tolist()} "
          f"({grad.numel() * codec.itemsize('fp32')} bytes)", end="")
    (reply,) = t.push([0], lambda k: header(worker, clock, base_version, grad.numel()),
                      lambda k: codec.encode(grad, "fp32"))  # raw little-endian bytes, ~1 MiB frames
    print(f" -> version {reply.version}, applied {reply.applied}, staleness {reply.staleness}")
    return reply


def pull(t: Transport, worker: int, clock: int, out: torch.Tensor, dtype: int = pb.FP32) -> tuple[pb.PullHeader, str]:
    """One Pull; returns its header and a line that says what came back (printed by the caller,
    in worker order, since the two clock-0 pulls run in threads)."""
    request = pb.PullRequest(worker_id=worker, clock=clock, dtype=dtype, shard=0)
    ((head, nbytes),) = t.pull([0], lambda k: request, lambda k: out)  # writes straight into `out`
    return head, (f"worker {worker} Pull  clock {clock} as {pb.WireDType.Name(dtype)} -> version {head.version}, "
                  f"clock gap {head.clock_gap}, {nbytes} bytes: {[round(v, 4) for v in out.tolist()]}")


def main() -> None:
    policy = make_policy("async", WORKERS, None, budget=20, start_barrier=True)  # 20 gradients, then done
    sgd = functools.partial(optim.build, cfg=OptimConfig(lr=LR, momentum=0.0))  # built over the first Init
    shard = Shard(0, policy, sgd, ShardOptions(mode="async"))
    srv = server.start(shard)  # 127.0.0.1, port 0: any free port
    address = f"127.0.0.1:{srv.port}"
    wire = [make_transport("grpc", [address], timeout=30.0) for _ in range(WORKERS)]  # one per worker
    try:
        info = wire[0].info([0])[0]
        print(f"shard at {address}: shard {info.shard} of {info.num_shards}, mode {info.mode}, "
              f"{info.num_workers} workers, initialised {info.initialized}")

        start = torch.tensor([1.0, 2.0, 3.0, 4.0])
        (init,) = wire[0].init([0], lambda k: header(0, 0, 0, start.numel()), lambda k: codec.encode(start, "fp32"))
        print(f"worker 0 Init  {start.tolist()} -> version {init.version}, "
              f"initialised by this call {init.initialized_by_caller}")

        # Clock 0: the start barrier holds each worker's first pull until both asked, so the two
        # pulls must be in flight together: one thread each, as two worker processes would be.
        params = [torch.empty(4), torch.empty(4)]
        with ThreadPoolExecutor(2) as pool:
            heads = []
            for head, line in pool.map(lambda w: pull(wire[w], w, 0, params[w]), (0, 1)):
                print(line)
                heads.append(head)
        assert [h.version for h in heads] == [0, 0]

        g1, g0 = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 2.0, 3.0])
        r1 = push(wire[1], 1, 0, heads[1].version, g1)
        r0 = push(wire[0], 0, 0, heads[0].version, g0)
        assert (r1.version, r1.staleness) == (1, 0), "the first gradient finds the version it was computed on"
        assert (r0.version, r0.staleness) == (2, 1), "the second was computed on v0 and applied to v1: 1 stale"

        try:  # the shard checks the protocol before it touches anything: a clock is pushed once
            push(wire[0], 0, 0, 0, g0)
        except ExchangeError as e:
            print(f" -> refused, nothing changed: {e}")
        else:
            raise AssertionError("the shard took a second push for the same clock")

        fresh = torch.empty(4)
        head, line = pull(wire[1], 1, 1, fresh, dtype=pb.FP16)
        print(line)
        expected = start - LR * g1 - LR * g0  # async: both gradients applied, each a plain SGD step
        print(f"by hand: {start.tolist()} - {LR} x {g1.tolist()} - {LR} x {g0.tolist()} = "
              f"{[round(v, 4) for v in expected.tolist()]}")
        assert head.version == 2
        assert torch.allclose(fresh, expected, atol=2e-3), "fp16 on the wire rounds to ~3 significant digits"
        # The shard keeps fp32 (only the wire was fp16); equal to the sum by hand up to float rounding.
        assert torch.allclose(srv.shard.param, expected, rtol=0, atol=1e-6), "the shard holds the fp32 result"

        stats = srv.shard.stats()  # what psgd run folds into summary.json
        print(f"shard stats: version {stats['version']}, staleness histogram {stats['staleness_hist']}, "
              f"bytes in {stats['bytes_in']}, bytes out {stats['bytes_out']}")
        assert stats["staleness_hist"] == {"0": 1, "1": 1}
    finally:
        for t in wire:
            t.close()
        srv.stop()


if __name__ == "__main__":
    main()
