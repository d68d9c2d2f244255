"""How a worker's pushes and pulls reach the shards: one small protocol, three implementations.

`Transport` is what `PSClient` (psgd/ps/client.py) talks to. Every call takes the list of shard
indices it is for (all K for a step's push / pull, one for --overlap's per-shard streams) and
fans out to them itself, the way that suits its wire; every failure is an `ExchangeError` with
one line that names the shard and the status.

    info(shards)                                        -> [InfoReply]   (waits for the shard to be up)
    init(shards, header_of, payload_of)                 -> [InitReply]
    push(shards, header_of, payload_of, events)         -> [PushReply]
    pull(shards, request_of, out_of, events)            -> [(PullHeader, bytes received)]
    push_pull(shards, header_of, payload_of, out_of, events) -> [(PullHeader, bytes received)]
                                                  (a push of clock c answered by the pull of c + 1;
                                                   each header's `pushed` is the push's reply)
    leave(shards, worker_id)                            -> [LeaveReply]  (this worker has finished)
    join(shard, request)                                -> JoinReply     (take a slot in a running job)

`header_of(k)` / `request_of(k)` build shard k's .proto header, `payload_of(k)` its bytes in the
wire dtype (or a `sparsify.Sparse` for a sparse push, --topk: SparseChunks on gRPC, its indices
then its values in the TCP frame), `out_of(k)` the fp32 slice its pulled values land in (written in place: no copy).
`Events` lets a caller follow a transfer chunk by chunk: the emulated link paces there, and
--overlap's forward hooks wait on a pull's progress.

- `GrpcTransport`: client-streaming Push / server-streaming Pull of ~1 MiB frames, one thread
  per shard (gRPC releases the GIL while waiting). PushPull is one bidirectional call per shard
  kept open for the run (`_RunStream`): each step queues its push's frames, built in the calling
  thread and queued at once (one shard's gradient in frames, held until gRPC has sent them),
  and reads exactly one pull's reply; a `_Watchdog` cancels a step that runs past the
  transport's deadline (gRPC's deadlines are per call), and a failed step's call is dropped and
  the next step opens a new one.
- `TcpTransport`: the shards' raw-socket data planes (psgd/ps/framing.py; gRPC still does Info,
  Init and Leave); unpaced shards of at most ROUND_MAX_BYTES in one round from the calling thread (send
  every request, then read every reply: no thread hand-offs), larger or paced ones a thread each.
- `PacedTransport(inner, link)`: `--link`, a wrapper that paces any transport's traffic to an
  emulated wire (psgd/core/link.py): one pacer for sends and one for receives, shared by the K
  streams as one NIC is; each message pays the latency once, each chunk its bytes / bandwidth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.core import codec, sparsify
from psgd.core import link as link_mod
from psgd.core.errors import ExchangeError
from psgd.ps import auth, tls, wire
from psgd.ps import framing as fr

ROUND_MAX_BYTES = 1 << 20  # TCP: shards up to this size go in one round from the caller's thread


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


class Transport(Protocol):
    addresses: list[str]

    def info(self, shards: Sequence[int]) -> list[pb.InfoReply]: ...
    def init(self, shards: Sequence[int], header_of, payload_of) -> list[pb.InitReply]: ...
    def push(self, shards: Sequence[int], header_of, payload_of, events: Events = NO_EVENTS) -> list[pb.PushReply]: ...
    def pull(self, shards: Sequence[int], request_of, out_of, events: Events = NO_EVENTS) -> list[tuple]: ...
    def push_pull(self, shards: Sequence[int], header_of, payload_of, out_of,
                  events: Events = NO_EVENTS) -> list[tuple]: ...
    def leave(self, shards: Sequence[int], worker_id: int) -> list[pb.LeaveReply]: ...
    def join(self, shard: int, request: pb.JoinRequest) -> pb.JoinReply: ...
    def close(self) -> None: ...


def check_pull_header(k: int, header: pb.PullHeader, out: torch.Tensor) -> bool:
    """A pull's header (both transports): True when values follow, False when the run is done."""
    if header.done:
        return False
    if header.num_elements != out.numel():
        raise ExchangeError(f"shard {k} sent {header.num_elements} elements, expected {out.numel()}")
    return True


class GrpcTransport:
    """Every byte on gRPC; one channel per shard (see the module docstring)."""

    def __init__(self, addresses: list[str], timeout: float, token: bytes | None = None, tls_ca: str = "") -> None:
        self.addresses, self.timeout = addresses, timeout
        credentials = tls.channel_credentials(tls_ca) if tls_ca else None
        # gRPC retries a refused TLS handshake until the deadline, and then says only that.
        self.hint = (" (with --tls-ca: also what a shard shows whose certificate that CA did not sign, or "
                     "that serves no TLS)") if tls_ca else ""
        self.channels = [auth.channel(a, wire.CHANNEL_OPTIONS, token, credentials) for a in addresses]
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


def _flat(payload: memoryview | sparsify.Sparse) -> memoryview:
    """A push's payload as the TCP frame carries it (a sparse one: every index, then every value)."""
    return memoryview(payload.payload()) if isinstance(payload, sparsify.Sparse) else payload


class TcpTransport:
    """Pushes and pulls on the shards' raw-TCP data planes; Info, Init and Leave on gRPC (`control`).

    A pool of idle connections per shard: a request takes one (or opens one) and gives it back
    when its reply was read in full; a connection that failed mid-frame is closed, never reused.
    """

    def __init__(self, addresses: list[str], timeout: float, token: bytes | None = None, tls_ca: str = "") -> None:
        self.addresses, self.timeout, self.token = addresses, timeout, token
        self.control = GrpcTransport(addresses, timeout, token, tls_ca)
        self.tls = tls.client_context(tls_ca) if tls_ca else None
        self._data: list[tuple[str, int] | None] = [None] * len(addresses)
        self._idle: list[list[socket.socket]] = [[] for _ in addresses]
        self._busy: set[socket.socket] = set()  # connections a call is using now
        self._lock = threading.Lock()  # guards _idle, _busy and _data

    def info(self, shards):
        infos = self.control.info(shards)
        for k, info in zip(shards, infos, strict=True):
            if not info.data_port:
                raise ExchangeError(f"shard {k} at {self.addresses[k]} has no TCP data plane "
                                    "(an older psgd server?): use --transport grpc")
            with self._lock:
                self._data[k] = (self.addresses[k].rsplit(":", 1)[0].strip("[]"), info.data_port)
        return infos

    def init(self, shards, header_of, payload_of):
        return self.control.init(shards, header_of, payload_of)

    def leave(self, shards, worker_id):
        return self.control.leave(shards, worker_id)

    def join(self, shard, request):
        return self.control.join(shard, request)

    def push(self, shards, header_of, payload_of, events=NO_EVENTS):
        payloads = {k: _flat(payload_of(k)) for k in shards}  # each slice encoded once (a view for fp32)

        def send(sock, k):
            if events.sending:
                events.sending(k)
            sent = events.sent
            fr.send_frame(sock, fr.PUSH, header_of(k).SerializeToString(), payloads[k],
                          sent and (lambda n: sent(k, n)))

        def receive(sock, k):
            body, _ = self._reply(sock, k, "push to", fr.PUSHED)
            reply = pb.PushReply.FromString(body)
            if events.replied:
                events.replied(k, reply)
            return reply
        largest = max(len(b) for b in payloads.values())
        return self._exchange("push to", shards, send, receive, largest, events)

    def pull(self, shards, request_of, out_of, events=NO_EVENTS):
        outs = {k: out_of(k) for k in shards}  # each slice taken once (tensor slicing costs ~5 us)
        requests = {k: request_of(k) for k in shards}

        def send(sock, k):
            if events.sending:
                events.sending(k)
            fr.send_frame(sock, fr.PULL, requests[k].SerializeToString())

        def receive(sock, k):
            return self._receive_pulled(sock, k, "pull from", requests[k].dtype, outs[k], events)
        width = codec.itemsize(wire.DTYPE_NAMES[requests[shards[0]].dtype])
        return self._exchange("pull from", shards, send, receive, max(o.numel() for o in outs.values()) * width,
                              events)

    def push_pull(self, shards, header_of, payload_of, out_of, events=NO_EVENTS):
        payloads = {k: _flat(payload_of(k)) for k in shards}
        headers = {k: header_of(k) for k in shards}
        outs = {k: out_of(k) for k in shards}

        def send(sock, k):
            if events.sending:
                events.sending(k)
            sent = events.sent
            fr.send_frame(sock, fr.PUSHPULL, headers[k].SerializeToString(), payloads[k],
                          sent and (lambda n: sent(k, n)))
            if events.delivered:
                events.delivered(k)

        def receive(sock, k):
            return self._receive_pulled(sock, k, "push-pull with", headers[k].dtype, outs[k], events)
        largest = max(len(b) for b in payloads.values())
        return self._exchange("push-pull with", shards, send, receive, largest, events)

    def _receive_pulled(self, sock: socket.socket, k: int, what: str, dtype_enum: int, out: torch.Tensor,
                        events: Events) -> tuple:
        """A PULLED frame (a Pull's or a PushPull's reply): its header, then the values into `out`."""
        dtype = wire.DTYPE_NAMES[dtype_enum]
        body, payload_len = self._reply(sock, k, what, fr.PULLED)
        header = pb.PullHeader.FromString(body)
        if events.replied:
            events.replied(k, header)
        # On an error below the payload is left unread: the connection is closed, not reused.
        if not check_pull_header(k, header, out):
            return header, 0
        if header.dtype != dtype_enum or payload_len != out.numel() * codec.itemsize(dtype):
            raise ExchangeError(f"shard {k} sent {payload_len} bytes of wire dtype {header.dtype} for "
                                f"{out.numel()} {dtype} elements")
        got = events.received
        return header, fr.recv_tensor(sock, out, dtype, got and (lambda n, e: got(k, n, e)))

    def _exchange(self, what: str, shards, send, receive, largest: int, events: Events) -> list:
        """send(sock, k) then receive(sock, k) for every shard. Small unpaced ones in one round from
        this thread (send every request, then read every reply), where a thread hand-off would cost
        more than the copy it spreads; large ones, and paced ones (their latencies must elapse side
        by side, as on K real links), on the control transport's pool, one thread each."""
        def one(k):
            with self._connection(k, what) as sock:
                self._guarded(k, what, send, sock)
                return self._guarded(k, what, receive, sock)
        paced = events.sending is not None or events.replied is not None
        if len(shards) > 1 and self.control.pool is not None and (largest > ROUND_MAX_BYTES or paced):
            return list(self.control.pool.map(one, shards))
        if len(shards) == 1:
            return [one(shards[0])]
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(self._connection(k, what)) for k in shards]
            for k, sock in zip(shards, socks, strict=True):
                self._guarded(k, what, send, sock)
            return [self._guarded(k, what, receive, sock) for k, sock in zip(shards, socks, strict=True)]

    def _guarded(self, k: int, what: str, fn, sock: socket.socket):
        """fn(sock, k); a socket or framing failure becomes one line that names shard k."""
        where = f"{what} shard {k} at {self.addresses[k]}"
        try:
            return fn(sock, k)
        except fr.FrameError as e:
            raise ExchangeError(f"{where}: {e}") from None
        except TimeoutError:
            raise ExchangeError(f"{where}: DEADLINE_EXCEEDED: no answer within {self.timeout:g}s",
                                "DEADLINE_EXCEEDED") from None
        except OSError as e:
            raise ExchangeError(f"{where}: UNAVAILABLE: {e}", "UNAVAILABLE") from None

    @contextlib.contextmanager
    def _connection(self, k: int, what: str):
        """A connection to shard k's data plane, from the pool or new. It goes back to the pool
        only when the request and its reply completed; on any failure it is closed."""
        if self._data[k] is None:
            self.info([k])
        with self._lock:
            sock = self._idle[k].pop() if self._idle[k] else None
        if sock is None:
            try:
                sock = socket.create_connection(self._data[k], timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.tls is not None:  # verifies the shard's certificate and its address
                    sock = self.tls.wrap_socket(sock, server_hostname=self._data[k][0])
            except OSError as e:
                raise ExchangeError(f"{what} shard {k} at {self.addresses[k]}: UNAVAILABLE: {e}",
                                    "UNAVAILABLE") from None
            if self.token is not None:  # a new connection says who it is first (psgd/ps/auth.py)
                self._guarded(k, what, lambda s, _: self._hello(s, k, what), sock)
        with self._lock:
            self._busy.add(sock)
        try:
            yield sock
        except BaseException:
            with self._lock:
                self._busy.discard(sock)
            _close(sock)
            raise
        with self._lock:
            self._busy.discard(sock)
            self._idle[k].append(sock)

    def _hello(self, sock: socket.socket, k: int, what: str) -> None:
        try:
            fr.send_frame(sock, fr.HELLO, self.token)
            self._reply(sock, k, what, fr.WELCOME)
        except BaseException:
            _close(sock)
            raise

    def _reply(self, sock: socket.socket, k: int, what: str, expected_op: int) -> tuple[bytes, int]:
        head = fr.recv_head(sock)
        if head is None:
            raise ConnectionError("the shard closed the connection")
        op, header, payload_len = head
        if op == fr.ERROR:  # "STATUS_NAME: message" (psgd/ps/framing.py)
            text = header.decode(errors="replace")
            raise ExchangeError(f"{what} shard {k} at {self.addresses[k]}: {text}", text.partition(":")[0])
        if op != expected_op:
            raise ExchangeError(f"{what} shard {k} at {self.addresses[k]}: unexpected frame op {op}")
        return header, payload_len

    def close(self) -> None:
        """Close idle connections, cut those in use (their calls end now), close the control channels."""
        with self._lock:
            for idle in self._idle:
                for sock in idle:
                    _close(sock)
                idle.clear()
            for sock in self._busy:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self.control.close()


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()


class PacedTransport:
    """`inner`, with its traffic paced to an emulated link (--link; see the module docstring).

    Full duplex: sends and receives are paced apart. A push pays the latency on its way out and
    its reply on the way back; a pull likewise; every payload chunk waits for its bytes /
    bandwidth on the shared wire. A message takes max(loopback time, emulated time).
    """

    def __init__(self, inner: Transport, link: link_mod.Link) -> None:
        self.inner, self.addresses = inner, inner.addresses
        self.send, self.recv = link_mod.Pacer(link), link_mod.Pacer(link)
        self._events = Events(sending=lambda k: self.send.start(), sent=lambda k, n: self.send.pace(n),
                              replied=lambda k, _: self.recv.start(), received=lambda k, n, e: self.recv.pace(n))

    def info(self, shards):
        return self.inner.info(shards)

    def init(self, shards, header_of, payload_of):
        return self.inner.init(shards, header_of, payload_of)  # set-up, not training traffic: unpaced

    def push_pull(self, shards, header_of, payload_of, out_of, events=NO_EVENTS):
        return self.inner.push_pull(shards, header_of, payload_of, out_of, chain(self._events, events))

    def leave(self, shards, worker_id):
        return self.inner.leave(shards, worker_id)  # the end, not training traffic: unpaced

    def join(self, shard, request):
        return self.inner.join(shard, request)  # set-up: unpaced

    def push(self, shards, header_of, payload_of, events=NO_EVENTS):
        return self.inner.push(shards, header_of, payload_of, chain(self._events, events))

    def pull(self, shards, request_of, out_of, events=NO_EVENTS):
        return self.inner.pull(shards, request_of, out_of, chain(self._events, events))

    def close(self) -> None:
        self.inner.close()


def make_transport(name: str, addresses: list[str], timeout: float, link: link_mod.Link | None = None,
                   token: bytes | None = None, tls_ca: str = "") -> Transport:
    """`--transport grpc | tcp`, paced when `link` is given, every request carrying `token` if given,
    over TLS that trusts the CA in `tls_ca` if given."""
    if name not in ("grpc", "tcp"):
        raise ValueError(f"unknown transport {name!r}; choose grpc or tcp")
    kind = TcpTransport if name == "tcp" else GrpcTransport
    inner = kind(addresses, timeout, token, tls_ca)
    return PacedTransport(inner, link) if link else inner
