"""`TcpTransport`: a worker's pushes and pulls on the shards' raw-TCP data planes.

The `Transport` protocol of psgd/ps/transport.py on the frames of psgd/ps/framing.py; gRPC
(a `GrpcTransport`, `control`) still does Info, Init, Leave and Join. Unpaced shards of at most
ROUND_MAX_BYTES go in one round from the calling thread (send every request, then read every
reply: no thread hand-offs), larger or paced ones a thread each. A sparse push (--topk) sends its
indices then its values in the frame. A pool of idle connections per shard; a connection that
failed mid-frame is closed, never reused. Every failure is an `ExchangeError` with one line that
names the shard and the status.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec, sparsify
from psgd.core.errors import ExchangeError
from psgd.ps import framing as fr
from psgd.ps import tls, wire
from psgd.ps.grpc_transport import GrpcTransport
from psgd.ps.transfer import NO_EVENTS, Events, Wire, check_pull_header

ROUND_MAX_BYTES = 1 << 20  # TCP: shards up to this size go in one round from the caller's thread


def _flat(payload: memoryview | sparsify.Sparse) -> memoryview:
    """A push's payload as the TCP frame carries it (a sparse one: every index, then every value)."""
    return memoryview(payload.payload()) if isinstance(payload, sparsify.Sparse) else payload


class TcpTransport(Wire):
    """Pushes and pulls on the shards' raw-TCP data planes; Info, Init and Leave on gRPC (`control`).

    A pool of idle connections per shard: a request takes one (or opens one) and gives it back
    when its reply was read in full; a connection that failed mid-frame is closed, never reused.
    """

    name, rank = "tcp", 1  # `auto`'s choice wherever a faster one does not fit (shards on other hosts)
    shard_paced = True     # its shards pace their side of --link (psgd/ps/tcp_server.py): `auto` takes it then

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
            self._send(sock, fr.PUSH, header_of(k).SerializeToString(), payloads[k], sent and (lambda n: sent(k, n)))

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
        width = codec.itemsize(wire.DTYPE_NAMES[requests[shards[0]].dtype])

        def send(sock, k):
            if events.sending:
                events.sending(k)
            self._send(sock, fr.PULL, requests[k].SerializeToString(), reply_bytes=outs[k].numel() * width)

        def receive(sock, k):
            return self._receive_pulled(sock, k, "pull from", requests[k].dtype, outs[k], events)
        return self._exchange("pull from", shards, send, receive, max(o.numel() for o in outs.values()) * width,
                              events)

    def push_pull(self, shards, header_of, payload_of, out_of, events=NO_EVENTS):
        payloads = {k: _flat(payload_of(k)) for k in shards}
        headers = {k: header_of(k) for k in shards}
        outs = {k: out_of(k) for k in shards}
        width = codec.itemsize(wire.DTYPE_NAMES[headers[shards[0]].dtype])

        def send(sock, k):
            if events.sending:
                events.sending(k)
            sent = events.sent
            self._send(sock, fr.PUSHPULL, headers[k].SerializeToString(), payloads[k], sent and (lambda n: sent(k, n)),
                       outs[k].numel() * width)
            if events.delivered:
                events.delivered(k)

        def receive(sock, k):
            return self._receive_pulled(sock, k, "push-pull with", headers[k].dtype, outs[k], events)
        largest = max(len(b) for b in payloads.values())
        return self._exchange("push-pull with", shards, send, receive, largest, events)

    def _receive_pulled(self, sock: socket.socket, k: int, what: str, dtype_enum: int, out: torch.Tensor,
                        events: Events, head=None) -> tuple:
        """A PULLED frame (a Pull's or a PushPull's reply): its header, then the values into `out`
        (`head`: the frame's head, when the caller read it already)."""
        dtype = wire.DTYPE_NAMES[dtype_enum]
        body, payload_len = self._reply(sock, k, what, fr.PULLED, head)
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
        return header, self._recv_tensor(sock, out, dtype, got and (lambda n, e: got(k, n, e)))

    # How a payload moves (a subclass may move it elsewhere: psgd/ps/shm/transport.py).
    def _send(self, sock, op: int, header: bytes, payload=None, on_chunk=None, reply_bytes: int = 0) -> None:
        """One request frame; `reply_bytes`: the payload its reply will bring (unused on the socket)."""
        fr.send_frame(sock, op, header, payload, on_chunk)

    def _recv_tensor(self, sock, out: torch.Tensor, dtype: str, on_chunk=None) -> int:
        return fr.recv_tensor(sock, out, dtype, on_chunk)

    def _discard(self, sock: socket.socket) -> None:
        """Close a connection for good (failed, or the transport closing)."""
        _close(sock)

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
        try:
            return fn(sock, k)
        except (fr.FrameError, OSError) as e:
            raise self._failure(k, what, e) from None

    def _failure(self, k: int, what: str, e: Exception) -> ExchangeError:
        """A socket or framing failure with shard k, as one line that names it."""
        where = f"{what} shard {k} at {self.addresses[k]}"
        if isinstance(e, fr.FrameError):
            return ExchangeError(f"{where}: {e}")
        if isinstance(e, TimeoutError):
            return ExchangeError(f"{where}: DEADLINE_EXCEEDED: no answer within {self.timeout:g}s", "DEADLINE_EXCEEDED")
        return ExchangeError(f"{where}: UNAVAILABLE: {e}", "UNAVAILABLE")

    @contextlib.contextmanager
    def _connection(self, k: int, what: str):
        """A connection to shard k's data plane, from the pool or new. It goes back to the pool
        only when the request and its reply completed; on any failure it is closed."""
        sock = self._checkout(k, what)
        try:
            yield sock
        except BaseException:
            self._checkin(k, sock, ok=False)
            raise
        self._checkin(k, sock, ok=True)

    def _checkout(self, k: int, what: str) -> socket.socket:
        """An idle connection to shard k, or a new one; busy until `_checkin`."""
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
        return sock

    def _checkin(self, k: int, sock: socket.socket, ok: bool) -> None:
        """Back to the pool after a complete request (`ok`), else closed for good."""
        with self._lock:
            self._busy.discard(sock)
            if ok:
                self._idle[k].append(sock)
        if not ok:
            self._discard(sock)

    def _hello(self, sock: socket.socket, k: int, what: str) -> None:
        try:
            fr.send_frame(sock, fr.HELLO, self.token)
            self._reply(sock, k, what, fr.WELCOME)
        except BaseException:
            _close(sock)
            raise

    def _recv_head(self, sock: socket.socket):
        return fr.recv_head(sock)

    def _reply(self, sock: socket.socket, k: int, what: str, expected_op: int, head=None) -> tuple[bytes, int]:
        head = self._recv_head(sock) if head is None else head
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
            idle_socks = [sock for idle in self._idle for sock in idle]
            for idle in self._idle:
                idle.clear()
            for sock in self._busy:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for sock in idle_socks:
            self._discard(sock)  # outside the lock: ShmTransport's takes it
        self.control.close()


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
