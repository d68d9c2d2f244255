"""A worker's view of all K parameter shards: parallel push / pull with deadlines.

Contract (ps-lite's worker API, in Python):
- `PSClient(addresses, worker_id, num_elements, ...)`: one channel per shard; shard k owns
  `sharding.shard_ranges(num_elements, K)[k]` of the flat vector.
- `wait_ready()` blocks (up to the deadline) until every shard answers.
- `init(flat)` offers initial values to every shard (the first worker to call wins).
- `pull(clock, out)` fills `out` with the parameters from all shards in parallel; blocks while
  a shard's consistency policy holds it; returns a `PullResult` (done once the budget is spent).
- `push(clock, grad)` sends each shard its slice in parallel, tagged with the versions the
  last pull returned; returns True when the server says the budget is spent.
All methods block the caller and are not thread-safe (one worker thread drives one client).
Every RPC has `rpc_timeout` as its deadline; failures raise `ExchangeError` with one line.

Copies (see codec.py): a push copies each chunk of the gradient once, into a ready-serialised
frame; a pull writes each received chunk once, straight into `out` (the model's flat buffer).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from psgd import codec
from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.server import CHANNEL_OPTIONS, DTYPE_ENUMS, SERVICE, reuse_freed_memory
from psgd.sharding import shard_ranges
from psgd.worker import StepReport


class ExchangeError(RuntimeError):
    """An RPC failed; the message names the shard and the gRPC status."""


@dataclass
class PullResult:
    done: bool
    versions: list[int]
    wait_s: float        # longest time a policy held this pull (max over shards)
    clock_gap: int
    bytes: int


class PSClient:
    def __init__(self, addresses: list[str], worker_id: int, num_elements: int,
                 wire_dtype: str = "fp32", rpc_timeout: float = 60.0) -> None:
        self.addresses = addresses
        self.worker_id = worker_id
        self.dtype = wire_dtype
        self.timeout = rpc_timeout
        self.ranges = shard_ranges(num_elements, len(addresses))
        reuse_freed_memory()
        self.channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
        self.stubs = [pb_grpc.ParameterShardStub(c) for c in self.channels]
        # The tensor streams with frame-aware (de)serialisers (same messages on the wire).
        self._push_rpc = [c.stream_unary(f"/{SERVICE}/Push", request_serializer=_serialize_chunk,
                                         response_deserializer=pb.PushReply.FromString) for c in self.channels]
        self._init_rpc = [c.stream_unary(f"/{SERVICE}/Init", request_serializer=_serialize_chunk,
                                         response_deserializer=pb.InitReply.FromString) for c in self.channels]
        self._pull_rpc = [c.unary_stream(f"/{SERVICE}/Pull", request_serializer=pb.PullRequest.SerializeToString,
                                         response_deserializer=_parse_pull_chunk) for c in self.channels]
        self.versions = [0] * len(addresses)
        # One thread per shard so the K transfers overlap (gRPC releases the GIL while waiting).
        self.pool = ThreadPoolExecutor(max_workers=len(addresses)) if len(addresses) > 1 else None

    def _map(self, fn, items):
        if self.pool is None:
            return [fn(*i) for i in items]
        return list(self.pool.map(lambda i: fn(*i), items))

    def _call(self, k: int, what: str, fn):
        try:
            return fn()
        except grpc.RpcError as e:
            raise ExchangeError(f"{what} shard {k} at {self.addresses[k]}: {e.code().name}: {e.details()}") from None

    def wait_ready(self) -> list[pb.InfoReply]:
        def one(k: int) -> pb.InfoReply:
            return self._call(k, "info from", lambda: self.stubs[k].Info(
                pb.InfoRequest(), timeout=self.timeout, wait_for_ready=True))
        infos = self._map(one, [(k,) for k in range(len(self.stubs))])
        for k, info in enumerate(infos):
            if info.shard != k or info.num_shards != len(self.stubs):
                raise ExchangeError(f"{self.addresses[k]} is shard {info.shard} of {info.num_shards}, "
                                    f"expected shard {k} of {len(self.stubs)}: check the order of --servers")
        return infos

    def _tensor_stream(self, k: int, flat: torch.Tensor, clock: int, base_version: int):
        start, stop = self.ranges[k]
        buf = codec.encode(flat[start:stop], self.dtype)
        yield pb.TensorChunk(header=pb.TensorHeader(
            worker_id=self.worker_id, clock=clock, base_version=base_version, dtype=DTYPE_ENUMS[self.dtype],
            shard=k, num_elements=stop - start))
        yield from codec.frames(buf)

    def init(self, flat: torch.Tensor) -> None:
        """Offer initial values, always as exact fp32 (the wire dtype is for gradients and pulls)."""
        saved, self.dtype = self.dtype, "fp32"
        try:
            self._map(lambda k: self._call(k, "init", lambda: self._init_rpc[k](
                self._tensor_stream(k, flat, 0, 0), timeout=self.timeout)), [(k,) for k in range(len(self.stubs))])
        finally:
            self.dtype = saved

    def pull(self, clock: int, out: torch.Tensor) -> PullResult:
        def one(k: int):
            start, stop = self.ranges[k]

            def rpc():
                stream = self._pull_rpc[k](pb.PullRequest(worker_id=self.worker_id, clock=clock,
                                                          dtype=DTYPE_ENUMS[self.dtype], shard=k),
                                           timeout=self.timeout)
                first = next(stream)
                if isinstance(first, memoryview) or first.WhichOneof("kind") != "header":
                    raise ExchangeError(f"shard {k} did not start its pull stream with a header")
                header = first.header
                if header.done:
                    return header, 0
                if header.num_elements != stop - start:
                    raise ExchangeError(f"shard {k} sent {header.num_elements} elements, expected {stop - start}")
                asm = codec.Assembler(header.num_elements, self.dtype, out=out[start:stop])
                try:
                    for msg in stream:
                        asm.add(msg if isinstance(msg, memoryview) else msg.data)
                    asm.finish()
                except ValueError as e:
                    raise ExchangeError(f"pull from shard {k}: {e}") from None
                return header, asm.received
            return self._call(k, "pull from", rpc)

        results = self._map(one, [(k,) for k in range(len(self.stubs))])
        done = any(h.done for h, _ in results)
        if not done:
            self.versions = [h.version for h, _ in results]
        return PullResult(done=done, versions=list(self.versions), wait_s=max(h.wait_s for h, _ in results),
                          clock_gap=max(h.clock_gap for h, _ in results), bytes=sum(b for _, b in results))

    def push(self, clock: int, grad: torch.Tensor) -> tuple[bool, bool, int]:
        """Send each shard its slice; returns (budget spent, refused by any shard, bytes sent)."""
        grad = grad.detach().to("cpu")
        replies = self._map(lambda k: self._call(k, "push to", lambda: self._push_rpc[k](
            self._tensor_stream(k, grad, clock, self.versions[k]), timeout=self.timeout)),
            [(k,) for k in range(len(self.stubs))])
        sent = sum((stop - start) * codec.itemsize(self.dtype) for start, stop in self.ranges)
        return any(r.done for r in replies), any(r.refused for r in replies), sent

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for c in self.channels:
            c.close()


def _serialize_chunk(message) -> bytes:
    """Push / Init request serialiser: frames from codec.frames go out as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def _parse_pull_chunk(message: bytes):
    """Pull response deserialiser: a data frame as a zero-copy view, anything else parsed."""
    view = codec.data_view(message)
    return view if view is not None else pb.PullChunk.FromString(message)


def wait_for_servers(addresses: list[str], timeout: float) -> None:
    """Block until every address answers Info (used by the launcher and tests)."""
    client = PSClient(addresses, 0, 0, rpc_timeout=timeout)
    try:
        client.wait_ready()
    finally:
        client.close()


class PSExchange:
    """The parameter-server step of the worker loop: pull before compute, push after."""

    def __init__(self, addresses: list[str], wire_dtype: str = "fp32", rpc_timeout: float = 60.0) -> None:
        self.addresses, self.wire_dtype, self.rpc_timeout = addresses, wire_dtype, rpc_timeout
        self.client: PSClient | None = None

    def setup(self, flat, rank: int) -> None:
        self.client = PSClient(self.addresses, rank, flat.params.numel(), self.wire_dtype, self.rpc_timeout)
        self.client.wait_ready()
        if rank == 0:
            self.client.init(flat.params)  # the chief's seeded init becomes the shards' start

    def before_compute(self, clock: int, flat):
        t0 = time.perf_counter()
        r = self.client.pull(clock, self._staging(flat))
        if not r.done and self._host is not flat.params:
            flat.params.copy_(self._host, non_blocking=True)
        elapsed = time.perf_counter() - t0
        return StepReport(done=r.done, pull_s=max(0.0, elapsed - r.wait_s), wait_s=r.wait_s,
                          bytes_pulled=r.bytes, clock_gap=r.clock_gap)

    def after_compute(self, clock: int, flat):
        t0 = time.perf_counter()
        done, refused, sent = self.client.push(clock, flat.grads)
        return StepReport(done=done, counted=not refused, push_s=time.perf_counter() - t0,
                          bytes_pushed=0 if refused else sent)

    def _staging(self, flat) -> torch.Tensor:
        # Pull straight into the model's flat buffer on CPU; through a host buffer on CUDA.
        if not hasattr(self, "_host"):
            on_cpu = flat.params.device.type == "cpu"
            self._host = flat.params if on_cpu else torch.empty_like(flat.params, device="cpu")
        return self._host

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
