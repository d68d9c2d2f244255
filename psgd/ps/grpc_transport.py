"""`GrpcTransport`: every byte of a worker's pushes and pulls on gRPC (one channel per shard).

The `Transport` protocol of psgd/ps/transport.py, on the service of
protos/psgd/v1/parameter_server.proto: client-streaming Push / Init and server-streaming Pull of
~1 MiB frames (psgd/ps/wire.py serialises them), one thread per shard (gRPC releases the GIL
while waiting). PushPull is one bidirectional call per shard kept open for the run
(`_RunStream`): each step queues its push's frames, built in the calling thread and queued at once
(one shard's gradient in frames, held until gRPC has sent them), and reads exactly one pull's
reply; a `_Watchdog` cancels a step that runs past the transport's deadline (gRPC's deadlines are
per call), and a failed step's call is dropped and the next step opens a new one. Every failure is
an `ExchangeError` with one line that names the shard and the status. psgd/ps/tcp_transport.py
uses one of these as its control plane (Info, Init, Leave, Join).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.core import codec, sparsify
from psgd.core.errors import ExchangeError
from psgd.ps import grpc_auth, tls, wire
from psgd.ps.transfer import NO_EVENTS, Events, Wire, check_pull_header


class GrpcTransport(Wire):
    """Every byte on gRPC; one channel per shard (see the module docstring)."""

    name = "grpc"  # never chosen by `auto` (rank 0): what gRPC Python costs, by name

    def __init__(self, addresses: list[str], timeout: float, token: bytes | None = None, tls_ca: str = "") -> None:
        self.addresses, self.timeout = addresses, timeout
        credentials = tls.channel_credentials(tls_ca) if tls_ca else None
        # gRPC retries a refused TLS handshake until the deadline, and then says only that.
        self.hint = (" (with --tls-ca: also what a shard shows whose certificate that CA did not sign, or "
                     "that serves no TLS)") if tls_ca else ""
        self.channels = [grpc_auth.channel(a, wire.CHANNEL_OPTIONS, token, credentials) for a in addresses]
        self._info = [pb_grpc.ParameterShardStub(c).Info for c in self.channels]
        self._leave = [pb_grpc.ParameterShardStub(c).Leave for c in self.channels]
        self._join = [pb_grpc.ParameterShardStub(c).Join for c in self.channels]
        chunk = wire.serialize_frame
        # The tensor streams with frame-aware (de)serialisers (the same messages on the wire).
        self._push = [c.stream_unary(f"/{wire.SERVICE}/Push", request_serializer=chunk,
                                     response_deserializer=pb.PushReply.FromString) for c in self.channels]
        self._init = [c.stream_unary(f"/{wire.SERVICE}/Init", request_serializer=chunk,
                                     response_deserializer=pb.InitReply.FromString) for c in self.channels]
        self._pull = [c.unary_stream(f"/{wire.SERVICE}/Pull", request_serializer=pb.PullRequest.SerializeToString,
                                     response_deserializer=wire.frame_parser(pb.PullChunk)) for c in self.channels]
        self._push_pull = [c.stream_stream(f"/{wire.SERVICE}/PushPull", request_serializer=chunk,
                                           response_deserializer=wire.frame_parser(pb.PullChunk))
                           for c in self.channels]
        self._streams: list[_RunStream | None] = [None] * len(addresses)
        self._watch = _Watchdog(timeout)
        self.pool = ThreadPoolExecutor(max_workers=len(addresses)) if len(addresses) > 1 else None

    def fan_out(self, what: str, shards: Sequence[int], fn: Callable[[int], object]) -> list:
        """fn(k) for every shard, in parallel on the pool; gRPC errors become ExchangeError."""
        def one(k: int):
            try:
                return fn(k)
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
                if code == grpc.StatusCode.CANCELLED and self._watch.fired(k):
                    code, details = grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout:g}s"
                hint = self.hint if code == grpc.StatusCode.DEADLINE_EXCEEDED else ""
                raise ExchangeError(f"{what} shard {k} at {self.addresses[k]}: {code.name}: {details}{hint}",
                                    code.name) from None
        if self.pool is None or len(shards) == 1:
            return [one(k) for k in shards]
        return list(self.pool.map(one, shards))

    def info(self, shards):
        return self.fan_out("info from", shards, lambda k: self._info[k](
            pb.InfoRequest(), timeout=self.timeout, wait_for_ready=True))

    def leave(self, shards, worker_id):
        return self.fan_out("leave", shards, lambda k: self._leave[k](
            pb.LeaveRequest(worker_id=worker_id, shard=k), timeout=self.timeout))

    def join(self, shard, request):
        return self.fan_out("join", [shard], lambda k: self._join[k](request, timeout=self.timeout))[0]

    def init(self, shards, header_of, payload_of):
        return self.fan_out("init", shards, lambda k: self._init[k](
            _stream(k, header_of(k), payload_of(k), NO_EVENTS), timeout=self.timeout))

    def push(self, shards, header_of, payload_of, events=NO_EVENTS):
        def one(k: int) -> pb.PushReply:
            reply = self._push[k](_stream(k, header_of(k), payload_of(k), events), timeout=self.timeout)
            if events.replied:
                events.replied(k, reply)
            return reply
        return self.fan_out("push to", shards, one)

    def pull(self, shards, request_of, out_of, events=NO_EVENTS):
        return self.fan_out("pull from", shards, lambda k: self._pull_one(k, request_of(k), out_of(k), events))

    def push_pull(self, shards, header_of, payload_of, out_of, events=NO_EVENTS):
        def one(k: int):
            header = header_of(k)
            stream = self._streams[k]
            if stream is None:
                stream = self._streams[k] = _RunStream(self._push_pull[k])
            self._watch.arm(k, stream.call)
            try:
                for item in _stream(k, header, payload_of(k), events):
                    stream.requests.put(item)  # frames are built here: the payload is free once queued
                if events.delivered:
                    events.delivered(k)
                return self._read_pull(k, stream.call, header.dtype, out_of(k), events)
            except BaseException:
                self._streams[k] = None  # mid-message: the call cannot carry another step
                stream.close(cancel=True)
                raise
            finally:
                if self._watch.disarm(k) and self._streams[k] is stream:
                    self._streams[k] = None  # cancelled just as its step ended: the next opens a new call
        return self.fan_out("push-pull with", shards, one)

    def _pull_one(self, k: int, request: pb.PullRequest, out: torch.Tensor, events: Events):
        if events.sending:
            events.sending(k)
        return self._read_pull(k, self._pull[k](request, timeout=self.timeout), request.dtype, out, events)

    def _read_pull(self, k: int, stream, dtype: int, out: torch.Tensor, events: Events):
        """A pull's reply stream (Pull or PushPull): the header, then the values into `out`."""
        first = next(stream)
        if isinstance(first, memoryview) or first.WhichOneof("kind") != "header":
            raise ExchangeError(f"shard {k} did not start its pull stream with a header")
        header = first.header
        if events.replied:
            events.replied(k, header)
        if not check_pull_header(k, header, out):
            return header, 0
        asm = codec.Assembler(header.num_elements, wire.DTYPE_NAMES[dtype], out=out)
        try:
            # Exactly the announced bytes: on the run-long PushPull call the next step's reply follows.
            while asm.received < asm.expected and (msg := next(stream, None)) is not None:
                data = msg if isinstance(msg, memoryview) else msg.data
                asm.add(data)
                if events.received:
                    events.received(k, len(data), asm.elements)
            asm.finish()
        except ValueError as e:
            raise ExchangeError(f"pull from shard {k}: {e}") from None
        return header, asm.received

    def close(self) -> None:
        """End the PushPull calls (the shards see the end of their request streams), close the
        channels (which cancels any RPC still in flight), then join the pool. Idempotent."""
        for k, stream in enumerate(self._streams):
            if stream is not None:
                self._streams[k] = None
                stream.close()
        self._watch.close()
        for c in self.channels:
            c.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True)


_END = object()


class _RunStream:
    """One shard's PushPull call, open for the run: `requests` feeds its request stream (gRPC's
    own thread sends them as flow control allows), and `call` iterates the replies."""

    def __init__(self, method) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = method(iter(self.requests.get, _END))  # no deadline: the watchdog times each step

    def close(self, cancel: bool = False) -> None:
        self.requests.put(_END)  # half-close: the shard's handler sees the end and returns
        if cancel:
            self.call.cancel()


class _Watchdog:
    """Cancels a run-long call whose step has run past the deadline. gRPC's deadlines are per
    call, so each step is armed here instead; a thread checks every quarter of the timeout (a step
    fails between 1 and 1.25 timeouts late), not per step: a wake-up per step would cost more than
    the call it saves."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.cond = threading.Condition()
        self.armed: dict[int, tuple[float, grpc.Call]] = {}
        self._fired: set[int] = set()
        self.thread: threading.Thread | None = None
        self.closed = False

    def arm(self, k: int, call) -> None:
        with self.cond:
            self._fired.discard(k)
            self.armed[k] = (time.monotonic() + self.timeout, call)
            if self.thread is None and not self.closed:
                self.thread = threading.Thread(target=self._run, name="psgd-deadlines", daemon=True)
                self.thread.start()

    def disarm(self, k: int) -> bool:
        """The step of shard k is over; True when the watchdog had cancelled its call."""
        with self.cond:
            self.armed.pop(k, None)
            return k in self._fired

    def fired(self, k: int) -> bool:
        with self.cond:
            return k in self._fired

    def _run(self) -> None:
        with self.cond:
            while not self.closed:
                now = time.monotonic()
                for k, (deadline, call) in list(self.armed.items()):
                    if now >= deadline:
                        del self.armed[k]
                        self._fired.add(k)
                        call.cancel()
                self.cond.wait(self.timeout / 4)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()


def _stream(k: int, header: pb.TensorHeader, payload: memoryview | sparsify.Sparse, events: Events):
    """A Push / Init request stream: the header, then ~1 MiB frames of the payload (SparseChunks of
    a sparse one)."""
    if events.sending:
        events.sending(k)
    yield pb.TensorChunk(header=header)
    if isinstance(payload, sparsify.Sparse):
        for indices, values in payload.pieces():
            if events.sent:
                events.sent(k, len(indices) + len(values))
            yield pb.TensorChunk(sparse=pb.SparseChunk(indices=bytes(indices), values=bytes(values)))
    else:
        for frame in codec.frames(payload):
            if events.sent:
                events.sent(k, len(frame))
            yield frame
