"""A worker's view of all K parameter shards: parallel push / pull with deadlines.

Contract (ps-lite's worker API, in Python):
- `PSClient(addresses, worker_id, num_elements, ...)`: one channel per shard; shard k owns
  `sharding.shard_ranges(num_elements, K)[k]` of the flat vector.
- `wait_ready()` blocks (up to the deadline) until every shard answers.
- `init(flat)` offers initial values to every shard (the first worker to call wins).
- `pull(clock, out)` fills `out` with the parameters from all shards in parallel; blocks while
  a shard's consistency policy holds it; returns a `PullResult` (done once the budget is spent).
  `start_pull(clock, out)` does the same in the background and returns a `PullStreams` to wait
  on: for the headers, for a range of `out`, or for the result (psgd/ps/overlap.py uses it).
- `push(clock, grad)` sends each shard its slice in parallel, tagged with the versions the
  last pull returned; `start_push(k, clock, grad)` sends one shard's slice in the background
  (a Future of its reply). Both read `grad` while sending: do not change it until they return.
All methods but those of `PullStreams` are for one thread (one worker thread drives one client);
they block the caller unless named start_*. Every RPC has `rpc_timeout` as its deadline;
failures raise `ExchangeError` with one line.

Copies (see codec.py): a push copies each chunk of the gradient once, into a ready-serialised
frame; a pull writes each received chunk once, straight into `out` (the model's flat buffer).
With a `link` (psgd/core/link.py, `--link`) every stream is paced to that emulated wire.
`make_client("tcp", ...)` gives `tcp.TcpClient`, this class with push and pull moved to the
shards' raw-socket data planes (`--transport tcp`); everything above holds for it too.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.core import codec, localsgd
from psgd.core import link as link_mod
from psgd.core.config import OptimConfig
from psgd.core.sharding import shard_ranges
from psgd.ps.server import CHANNEL_OPTIONS, DTYPE_ENUMS, SERVICE, reuse_freed_memory
from psgd.train.worker import StepReport


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
                 wire_dtype: str = "fp32", rpc_timeout: float = 60.0, link: link_mod.Link | None = None) -> None:
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
        # Full duplex: sends and receives are paced apart, each shared by the K streams.
        self.send = link_mod.Pacer(link) if link else None
        self.recv = link_mod.Pacer(link) if link else None
        # One thread per shard so the K transfers overlap (gRPC releases the GIL while waiting);
        # start_pull / start_push run on a second pool, so K pulls and K pushes fit at once.
        k = len(addresses)
        self.pool = ThreadPoolExecutor(max_workers=k) if k > 1 else None
        self.background = ThreadPoolExecutor(max_workers=2 * k, thread_name_prefix="psgd-exchange")

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

    def _tensor_stream(self, k: int, flat: torch.Tensor, clock: int, base_version: int, paced: bool = True):
        start, stop = self.ranges[k]
        buf = codec.encode(flat[start:stop], self.dtype)
        pacer = self.send if paced else None
        if pacer:
            pacer.start()
        yield pb.TensorChunk(header=pb.TensorHeader(
            worker_id=self.worker_id, clock=clock, base_version=base_version, dtype=DTYPE_ENUMS[self.dtype],
            shard=k, num_elements=stop - start))
        for frame in codec.frames(buf):
            if pacer:
                pacer.pace(len(frame))
            yield frame

    def init(self, flat: torch.Tensor) -> None:
        """Offer initial values, always as exact fp32 (the wire dtype is for gradients and pulls)."""
        saved, self.dtype = self.dtype, "fp32"
        try:
            self._map(lambda k: self._call(k, "init", lambda: self._init_rpc[k](
                self._tensor_stream(k, flat, 0, 0, paced=False), timeout=self.timeout)),
                [(k,) for k in range(len(self.stubs))])
        finally:
            self.dtype = saved

    def _pull_one(self, k: int, clock: int, out: torch.Tensor, on_header=None, on_progress=None):
        """One shard's pull into out[range]; returns (header, bytes received)."""
        start, stop = self.ranges[k]
        if self.send:
            self.send.start()  # the request's way out
        stream = self._pull_rpc[k](pb.PullRequest(worker_id=self.worker_id, clock=clock,
                                                  dtype=DTYPE_ENUMS[self.dtype], shard=k), timeout=self.timeout)
        first = next(stream)
        if isinstance(first, memoryview) or first.WhichOneof("kind") != "header":
            raise ExchangeError(f"shard {k} did not start its pull stream with a header")
        header = first.header
        if self._pull_header_in(k, header, on_header):
            return header, 0
        asm = codec.Assembler(header.num_elements, self.dtype, out=out[start:stop])
        try:
            for msg in stream:
                data = msg if isinstance(msg, memoryview) else msg.data
                if self.recv:
                    self.recv.pace(len(data))
                asm.add(data)
                if on_progress:
                    on_progress(k, asm.elements)
            asm.finish()
        except ValueError as e:
            raise ExchangeError(f"pull from shard {k}: {e}") from None
        return header, asm.received

    def _pull_header_in(self, k: int, header: pb.PullHeader, on_header=None) -> bool:
        """A pull's header arrived (both transports): True when the run is done and no data follows."""
        if self.recv:
            self.recv.start()  # the reply's way back
        if on_header:
            on_header(k, header)
        if header.done:
            return True
        start, stop = self.ranges[k]
        if header.num_elements != stop - start:
            raise ExchangeError(f"shard {k} sent {header.num_elements} elements, expected {stop - start}")
        return False

    def _pull_result(self, results: list) -> PullResult:
        done = any(h.done for h, _ in results)
        if not done:
            self.versions = [h.version for h, _ in results]
        return PullResult(done=done, versions=list(self.versions), wait_s=max(h.wait_s for h, _ in results),
                          clock_gap=max(h.clock_gap for h, _ in results), bytes=sum(b for _, b in results))

    def pull(self, clock: int, out: torch.Tensor) -> PullResult:
        results = self._map(lambda k: self._call(k, "pull from", lambda: self._pull_one(k, clock, out)),
                            [(k,) for k in range(len(self.stubs))])
        return self._pull_result(results)

    def start_pull(self, clock: int, out: torch.Tensor) -> PullStreams:
        return PullStreams(self, clock, out)

    def push_one(self, k: int, clock: int, grad: torch.Tensor) -> pb.PushReply:
        reply = self._call(k, "push to", lambda: self._push_rpc[k](
            self._tensor_stream(k, grad, clock, self.versions[k]), timeout=self.timeout))
        if self.recv:
            self.recv.start()  # the reply's way back
        return reply

    def start_push(self, k: int, clock: int, grad: torch.Tensor) -> Future:
        return self.background.submit(self.push_one, k, clock, grad)

    def push(self, clock: int, grad: torch.Tensor) -> tuple[bool, bool, int]:
        """Send each shard its slice; returns (budget spent, refused by any shard, bytes sent)."""
        grad = grad.detach().to("cpu")
        replies = self._map(lambda k: self.push_one(k, clock, grad), [(k,) for k in range(len(self.stubs))])
        return self.push_outcome(replies)

    def push_outcome(self, replies: list[pb.PushReply]) -> tuple[bool, bool, int]:
        sent = sum((stop - start) * codec.itemsize(self.dtype) for start, stop in self.ranges)
        return any(r.done for r in replies), any(r.refused for r in replies), sent

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.background.shutdown(wait=True)
        for c in self.channels:
            c.close()


class PullStreams:
    """A pull in flight (`PSClient.start_pull`): K streams fill `out` in the background.

    Thread-safe: `cond` guards `headers`, `filled` (elements of each shard written so far) and
    `error`; the stream threads notify it on every chunk.
    """

    def __init__(self, client: PSClient, clock: int, out: torch.Tensor) -> None:
        self.client = client
        self.cond = threading.Condition()
        k = len(client.ranges)
        self.headers: list = [None] * k
        self.filled = [0] * k
        self.error: BaseException | None = None
        self.futures = [client.background.submit(self._run, i, clock, out) for i in range(k)]

    def _run(self, k: int, clock: int, out: torch.Tensor):
        try:
            return self.client._call(k, "pull from", lambda: self.client._pull_one(
                k, clock, out, self._on_header, self._on_progress))
        except BaseException as e:
            with self.cond:
                self.error = e
                self.cond.notify_all()
            raise

    def _on_header(self, k: int, header) -> None:
        with self.cond:
            self.headers[k] = header
            self.cond.notify_all()

    def _on_progress(self, k: int, elements: int) -> None:
        with self.cond:
            self.filled[k] = elements
            self.cond.notify_all()

    def _wait(self, ready) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or ready(), self.client.timeout)
            if self.error is not None:
                raise self.error
            if not ready():
                raise ExchangeError(f"pull still incomplete after the {self.client.timeout:.0f}s deadline")

    def wait_headers(self) -> list:
        """Block until every shard's header arrived (the policy released the pull)."""
        self._wait(lambda: all(h is not None for h in self.headers))
        return list(self.headers)

    def wait_range(self, start: int, stop: int) -> None:
        """Block until out[start:stop] holds the pulled values (or a shard said done)."""
        need = []
        for k, (a, b) in enumerate(self.client.ranges):
            if a < stop and start < b:
                need.append((k, min(stop, b) - a))
        self._wait(lambda: all(self.filled[k] >= n or (self.headers[k] is not None and self.headers[k].done)
                               for k, n in need))

    def result(self) -> PullResult:
        return self.client._pull_result([f.result() for f in self.futures])


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


def make_client(transport: str, *args, **kwargs) -> PSClient:
    """A PSClient for `--transport grpc`, or its TCP data-plane subclass for `tcp` (psgd/ps/tcp.py)."""
    if transport == "tcp":
        from psgd.ps.tcp import TcpClient  # noqa: PLC0415 - tcp builds on this module

        return TcpClient(*args, **kwargs)
    assert transport == "grpc", f"unknown transport {transport!r}"
    return PSClient(*args, **kwargs)


class PSExchange:
    """The parameter-server step of the worker loop: pull before compute, push after.

    With `overlap` (psgd/ps/overlap.py) the pull streams in while the batch loads and forward
    runs, and each shard's push starts as soon as backward has produced its gradients; `watch`
    (called by the worker loop with the model) installs the hooks that does this. With `link`
    ("1gbit,200us", psgd/core/link.py) every stream is paced to that emulated wire. `transport`
    "tcp" moves the tensors on the shards' raw-TCP data planes (psgd/ps/tcp.py) instead of gRPC.
    With `local_steps` H > 1 (local SGD, sync mode, psgd/core/localsgd.py) the worker steps its own
    replica with a local optimizer (`optim`), pulls only at the start of each round of H steps
    and pushes the delta w_pulled - w_local at its end; pull and push carry the round as clock.
    """

    def __init__(self, addresses: list[str], wire_dtype: str = "fp32", rpc_timeout: float = 60.0,
                 link: str = "", overlap: bool = False, accumulate: int = 1, transport: str = "grpc",
                 local_steps: int = 1, optim: OptimConfig | None = None) -> None:
        if local_steps > 1 and overlap:
            raise ValueError("--overlap pushes gradients during backward, --local-steps pushes a model delta every "
                             "H steps: use one or the other")
        self.addresses, self.wire_dtype, self.rpc_timeout = addresses, wire_dtype, rpc_timeout
        self.link, self.overlap, self.accumulate = link_mod.parse(link), overlap, accumulate
        self.transport = transport
        self.local_steps, self.optim = local_steps, optim or OptimConfig()
        self.client: PSClient | None = None
        self._overlap = None
        self._local: localsgd.ReplicaOptimizer | None = None

    @classmethod
    def from_config(cls, cfg, addresses: list[str]) -> PSExchange:
        return cls(addresses, cfg.wire_dtype, cfg.rpc_timeout, cfg.link, cfg.overlap, cfg.accumulate, cfg.transport,
                   cfg.local_steps, cfg.optim)

    def setup(self, flat, rank: int) -> None:
        self.client = make_client(self.transport, self.addresses, rank, flat.params.numel(), self.wire_dtype,
                                  self.rpc_timeout, self.link)
        self.client.wait_ready()
        if rank == 0:
            self.client.init(flat.params)  # the chief's seeded init becomes the shards' start
        if self.local_steps > 1:
            self._local = localsgd.ReplicaOptimizer(flat.params, flat.grads, self.optim)
            self._pulled = torch.empty_like(flat.params)  # w_pulled of the round (the delta's base)
            self._delta = torch.empty_like(flat.params)

    def watch(self, model, flat) -> None:
        if self.overlap:
            from psgd.ps.overlap import Overlap  # noqa: PLC0415 - overlap imports this module

            self._overlap = Overlap(model, flat, self.client, self._staging(flat), self.accumulate)

    def before_compute(self, clock: int, flat):
        if self._overlap is not None:
            return self._overlap.before_compute(clock)
        if clock % self.local_steps:
            return StepReport()  # local SGD, inside a round: the replica trains on its own
        t0 = time.perf_counter()
        # The shards count rounds: without local SGD a round is one step and this is the clock.
        r = self.client.pull(clock // self.local_steps, self._staging(flat))
        if not r.done and self._host is not flat.params:
            flat.params.copy_(self._host, non_blocking=True)
        if not r.done and self._local is not None:
            self._pulled.copy_(flat.params)
        elapsed = time.perf_counter() - t0
        return StepReport(done=r.done, pull_s=max(0.0, elapsed - r.wait_s), wait_s=r.wait_s,
                          bytes_pulled=r.bytes, clock_gap=r.clock_gap)

    def after_compute(self, clock: int, flat):
        if self._overlap is not None:
            return self._overlap.after_compute(clock)
        local_s = 0.0
        pushed = flat.grads
        if self._local is not None:
            # Local SGD: step this replica; at the end of a round push its delta from the pulled
            # model (the shards apply w - mean(delta), the replicas' average: psgd/core/localsgd.py).
            t0 = time.perf_counter()
            self._local.step(clock)
            local_s = time.perf_counter() - t0
            if (clock + 1) % self.local_steps:
                return StepReport(compute_s=local_s)
            pushed = torch.sub(self._pulled, flat.params, out=self._delta)
        t0 = time.perf_counter()
        done, refused, sent = self.client.push(clock // self.local_steps, pushed)
        return StepReport(done=done, counted=not refused, push_s=time.perf_counter() - t0,
                          bytes_pushed=0 if refused else sent, compute_s=local_s)

    def _staging(self, flat) -> torch.Tensor:
        # Pull straight into the model's flat buffer on CPU; through a host buffer on CUDA.
        if not hasattr(self, "_host"):
            on_cpu = flat.params.device.type == "cpu"
            self._host = flat.params if on_cpu else torch.empty_like(flat.params, device="cpu")
        return self._host

    def close(self) -> None:
        if self._overlap is not None:
            self._overlap.close()
        if self.client is not None:
            self.client.close()
