"""The raw-TCP data plane (`--transport tcp`): tensors on plain sockets, gRPC for everything else.

Why it exists: even with pre-built frames, gRPC Python moves a 64 MiB tensor at about 0.4x
(push) and 0.55x (pull) of a raw loopback socket, and one small push + pull costs several unary
round trips (`psgd bench transport` measures both). ps-lite and BytePS move tensors on a
transport of their own (ZeroMQ, RDMA) for the same reason; this is that transport, written to
be read. Every shard server listens here too (on the gRPC server's host, a port of its own
that `Info` reports as `data_port`); Init and Info stay on gRPC.

Wire format, one frame per message in both directions, little-endian:

    op: u8 | header length: u32 | payload length: u64 | header | payload

    PUSH  TensorHeader + the gradient's bytes in the wire dtype  ->  PUSHED  PushReply
    PULL  PullRequest                                            ->  PULLED  PullHeader + the values' bytes
    any request                                                  ->  ERROR   "STATUS_NAME: message" (UTF-8)

The headers are the .proto's own messages, and the server runs the same core as the gRPC
servicer (`ShardServicer.check_header / push_received / pull_values`): one schema, one set of
checks, one consistency policy, whichever transport carries the bytes. A connection carries one
request at a time; a client keeps a small pool of connections per shard, so an overlapped push
and pull (psgd/ps/overlap.py) each get one. `push` / `pull` to K shards of at most ROUND_MAX_BYTES
each send every request from the calling thread before reading any reply (one round trip, no
thread hand-offs); larger shards get a thread each, so that the K copies use several cores.

Copies: a payload goes from the tensor's memory to the socket (`sendmsg` of a memoryview) and
from the socket straight into the destination tensor (`recv_into`): the kernel's copy is the only
one, besides the pull's snapshot under the lock (ShardServicer) and fp16 / bf16 widening.

Errors: a refused request gets an ERROR frame and changes nothing; a push refused before its
payload was read has the payload drained, so the connection stays usable. A frame that cannot be
trusted (unknown op, oversized header) gets an ERROR and the connection is closed. The client
raises `ExchangeError` with one line in every case, as it does for gRPC.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
from collections.abc import Callable

import grpc
import torch
from google.protobuf.message import DecodeError

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec
from psgd.core.link import Pacer
from psgd.ps.client import ExchangeError, PSClient
from psgd.ps.server import DTYPE_ENUMS, DTYPE_NAMES, ShardError, ShardServicer

PREFIX = struct.Struct("<BIQ")  # op, header length, payload length
PUSH, PULL, PUSHED, PULLED, ERROR = 1, 2, 0x81, 0x82, 0xFF
MAX_HEADER = 1 << 16            # our headers are < 100 bytes; anything bigger is not a psgd peer
CHUNK = codec.CHUNK_BYTES       # the unit of pacing (--link) and of progress (--overlap)
ROUND_MAX_BYTES = 1 << 20       # shards up to this size: one round from the caller's thread (see _bulk)


class FrameError(Exception):
    """A frame that cannot come from a psgd peer; the connection is closed."""


# -- framing (both ends) -------------------------------------------------------------------------
def send_frame(sock: socket.socket, op: int, header: bytes, payload: memoryview | None = None,
               pacer: Pacer | None = None) -> None:
    """One frame. Without a pacer, prefix + header + payload leave in one `sendmsg` call (one
    syscall for a small message, no copy of a large one); with one, the payload goes out in
    CHUNK pieces, each paced to the emulated link."""
    payload = payload if payload is not None else memoryview(b"")
    head = PREFIX.pack(op, len(header), len(payload)) + header
    if pacer is None:
        _sendmsg_all(sock, [head, payload])
        return
    sock.sendall(head)
    for start in range(0, len(payload), CHUNK):
        piece = payload[start:start + CHUNK]
        pacer.pace(len(piece))
        sock.sendall(piece)


def _sendmsg_all(sock: socket.socket, parts: list) -> None:
    sent = sock.sendmsg(parts)
    for part in parts:  # a large payload may leave in several calls: send what is left
        if sent >= len(part):
            sent -= len(part)
            continue
        sock.sendall(memoryview(part)[sent:])
        sent = 0


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ConnectionError when the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed in the middle of a frame")
        got += n


def recv_head(sock: socket.socket) -> tuple[int, bytes, int] | None:
    """(op, header bytes, payload length) of the next frame; None when the peer closed cleanly."""
    prefix = bytearray(PREFIX.size)
    n = sock.recv_into(prefix)
    if n == 0:
        return None
    recv_exact(sock, memoryview(prefix)[n:])
    op, header_len, payload_len = PREFIX.unpack(prefix)
    if header_len > MAX_HEADER:
        raise FrameError(f"frame header of {header_len} bytes (at most {MAX_HEADER}): not a psgd peer")
    header = bytearray(header_len)
    recv_exact(sock, memoryview(header))
    return op, bytes(header), payload_len


def recv_tensor(sock: socket.socket, out: torch.Tensor, dtype: str, pacer: Pacer | None = None,
                on_progress: Callable[[int], None] | None = None) -> int:
    """Receive `out.numel()` elements in the wire dtype into the fp32 tensor `out`; returns bytes.

    fp32 lands straight in `out`'s memory; fp16 / bf16 pass through a 1 MiB scratch and are
    widened into place (exactly, as torch's cast). `on_progress(elements)` after each chunk.
    """
    width = codec.itemsize(dtype)
    nbytes = out.numel() * width
    if width == 4:
        dest = memoryview(out.numpy()).cast("B")
        step = CHUNK if (pacer or on_progress) else max(nbytes, 1)
        for start in range(0, nbytes, step):
            stop = min(start + step, nbytes)
            recv_exact(sock, dest[start:stop])
            if pacer:
                pacer.pace(stop - start)
            if on_progress:
                on_progress(stop // 4)
        return nbytes
    scratch = torch.empty(CHUNK // width, dtype=codec.WIRE_DTYPES[dtype])
    raw = memoryview(scratch.view(torch.int16).numpy()).cast("B")
    for start in range(0, nbytes, CHUNK):
        stop = min(start + CHUNK, nbytes)
        recv_exact(sock, raw[:stop - start])
        if pacer:
            pacer.pace(stop - start)
        out[start // width:stop // width].copy_(scratch[:(stop - start) // width])
        if on_progress:
            on_progress(stop // width)
    return nbytes


def _drain(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, CHUNK)))
    while nbytes:
        step = min(nbytes, len(scratch))
        recv_exact(sock, scratch[:step])
        nbytes -= step


# -- server ----------------------------------------------------------------------------------------
class DataServer(socketserver.ThreadingTCPServer):
    """The shard's TCP listener: one thread per connection, each running `_Connection.handle`."""

    daemon_threads = False   # stop() joins every connection thread: nothing outlives the server
    block_on_close = True
    allow_reuse_address = False

    def __init__(self, servicer: ShardServicer, host: str = "127.0.0.1") -> None:
        self.servicer = servicer
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()  # guards connections and stopping
        self.stopping = False
        super().__init__((host, 0), _Connection)
        self.port = self.server_address[1]
        # A short poll interval: shutdown() waits for the serve loop to notice, and that wait is on
        # every run's critical path (the default 0.5 s cost 0.2 s per run on average).
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02},
                                       name=f"psgd-tcp-{servicer.shard}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop accepting, cut open connections (their threads end), join everything.
        Call after `policy.close()`, so that no pull is still held."""
        self.shutdown()
        with self.lock:
            # A connection accepted just before shutdown() registers itself in setup(), after
            # this: the flag makes it cut itself, so that server_close() never waits on it.
            self.stopping = True
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.server_close()
        self.thread.join()


class _Connection(socketserver.BaseRequestHandler):
    server: DataServer

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.lock:
            if self.server.stopping:
                with contextlib.suppress(OSError):
                    self.request.shutdown(socket.SHUT_RDWR)  # handle() then reads EOF and returns
            self.server.connections.add(self.request)

    def finish(self) -> None:
        with self.server.lock:
            self.server.connections.discard(self.request)

    def handle(self) -> None:
        sock = self.request
        while True:
            try:
                head = recv_head(sock)
                if head is None:
                    return
                op, header, payload_len = head
                if op == PUSH:
                    self._push(header, payload_len)
                elif op == PULL:
                    self._pull(header, payload_len)
                else:
                    raise FrameError(f"unknown frame op {op}")
            except FrameError as e:  # the stream cannot be trusted any more: say why, close it
                with contextlib.suppress(OSError):
                    send_frame(sock, ERROR, f"INVALID_ARGUMENT: {e}".encode())
                return
            except OSError:  # the worker went away (or the server is stopping)
                return

    def _refuse(self, e: ShardError, unread: int) -> None:
        _drain(self.request, unread)
        send_frame(self.request, ERROR, f"{e.code.name}: {e.message}".encode())

    def _push(self, header: bytes, payload_len: int) -> None:
        shard = self.server.servicer
        try:
            h = _parse(pb.TensorHeader, header)
            n = shard.require_ready()
            dtype = shard.check_header(h, n)
            expected = n * codec.itemsize(dtype)
            if payload_len != expected:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"payload of {payload_len} bytes; {n} {dtype} elements are {expected}")
        except ShardError as e:
            self._refuse(e, payload_len)
            return
        buf = shard.borrow(torch.float32)
        try:
            if shard.link_in:
                shard.link_in.start(latency=False)
            recv_tensor(self.request, buf, dtype, shard.link_in)
            try:
                reply = shard.push_received(h, buf)
            except ShardError as e:
                self._refuse(e, 0)
                return
        finally:
            shard.release(buf)  # the policy has applied, summed or cloned the gradient by now
        send_frame(self.request, PUSHED, reply.SerializeToString())

    def _pull(self, header: bytes, payload_len: int) -> None:
        shard = self.server.servicer
        try:
            if payload_len:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "a pull request carries no payload")
            request = _parse(pb.PullRequest, header)
            # A frame carries no deadline: the shard's own --rpc-timeout bounds a held pull.
            reply, snap = shard.pull_values(request, shard.cfg.rpc_timeout)
        except ShardError as e:
            self._refuse(e, payload_len)
            return
        if snap is None:
            send_frame(self.request, PULLED, reply.SerializeToString())
            return
        try:
            if shard.link_out:
                shard.link_out.start(latency=False)
            payload = codec.encode(snap, DTYPE_NAMES[request.dtype])  # a view of the snapshot: no copy
            send_frame(self.request, PULLED, reply.SerializeToString(), payload, shard.link_out)
        finally:
            shard.release(snap)


def _parse(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise ShardError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"malformed {message_type.DESCRIPTOR.name} in a frame header") from None


# -- client ----------------------------------------------------------------------------------------
class TcpClient(PSClient):
    """`PSClient` whose pushes and pulls travel on the shards' TCP data planes.

    Same methods, same contract, same results; `init` and `wait_ready` stay on gRPC, and
    `wait_ready` (called first, or on the first push / pull) learns each shard's data port.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        k = len(self.addresses)
        self._data: list[tuple[str, int] | None] = [None] * k
        self._idle: list[list[socket.socket]] = [[] for _ in range(k)]
        self._lock = threading.Lock()

    def wait_ready(self):
        infos = super().wait_ready()
        for k, info in enumerate(infos):
            if not info.data_port:
                raise ExchangeError(f"shard {k} at {self.addresses[k]} has no TCP data plane "
                                    "(an older psgd server?): use --transport grpc")
            host = self.addresses[k].rsplit(":", 1)[0].strip("[]")
            self._data[k] = (host, info.data_port)
        return infos

    @contextlib.contextmanager
    def _connection(self, k: int, what: str):
        """A connection to shard k's data plane, from the pool or new; one line on any failure."""
        where = f"{what} shard {k} at {self.addresses[k]}"
        if self._data[k] is None:
            self.wait_ready()
        with self._lock:
            sock = self._idle[k].pop() if self._idle[k] else None
        try:
            if sock is None:
                sock = socket.create_connection(self._data[k], timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield sock
        except ExchangeError:
            _close(sock)
            raise
        except FrameError as e:
            _close(sock)
            raise ExchangeError(f"{where}: {e}") from None
        except TimeoutError:
            _close(sock)
            raise ExchangeError(f"{where}: DEADLINE_EXCEEDED: no answer within {self.timeout:g}s") from None
        except OSError as e:
            _close(sock)
            raise ExchangeError(f"{where}: UNAVAILABLE: {e}") from None
        except BaseException:
            _close(sock)
            raise
        else:
            with self._lock:
                self._idle[k].append(sock)

    def _reply(self, sock: socket.socket, k: int, what: str, expected_op: int) -> tuple[bytes, int]:
        head = recv_head(sock)
        if head is None:
            raise ConnectionError("the shard closed the connection")
        op, header, payload_len = head
        if op == ERROR:
            raise ExchangeError(f"{what} shard {k} at {self.addresses[k]}: {header.decode(errors='replace')}")
        if op != expected_op:
            raise ExchangeError(f"{what} shard {k} at {self.addresses[k]}: unexpected frame op {op}")
        return header, payload_len

    # Each request is two halves, a send and a receive, so that `push` and `pull` can send to every
    # shard before reading any reply (one round trip for K shards, no thread hand-offs), while the
    # one-shard calls (start_push / start_pull of --overlap) simply do both halves in a row.
    def _send_push(self, sock: socket.socket, k: int, clock: int, grad: torch.Tensor) -> None:
        start, stop = self.ranges[k]
        header = pb.TensorHeader(worker_id=self.worker_id, clock=clock, base_version=self.versions[k],
                                 dtype=DTYPE_ENUMS[self.dtype], shard=k, num_elements=stop - start)
        if self.send:
            self.send.start()
        send_frame(sock, PUSH, header.SerializeToString(), codec.encode(grad[start:stop], self.dtype), self.send)

    def _recv_push(self, sock: socket.socket, k: int) -> pb.PushReply:
        body, _ = self._reply(sock, k, "push to", PUSHED)
        if self.recv:
            self.recv.start()  # the reply's way back
        return pb.PushReply.FromString(body)

    def _send_pull(self, sock: socket.socket, k: int, clock: int) -> None:
        if self.send:
            self.send.start()  # the request's way out
        request = pb.PullRequest(worker_id=self.worker_id, clock=clock, dtype=DTYPE_ENUMS[self.dtype], shard=k)
        send_frame(sock, PULL, request.SerializeToString())

    def _recv_pull(self, sock: socket.socket, k: int, out: torch.Tensor, on_header=None, on_progress=None):
        start, stop = self.ranges[k]
        body, payload_len = self._reply(sock, k, "pull from", PULLED)
        header = pb.PullHeader.FromString(body)
        # On an error below the payload is left unread: the connection is closed, not reused.
        if self._pull_header_in(k, header, on_header):
            return header, 0
        if payload_len != (stop - start) * codec.itemsize(self.dtype):
            raise ExchangeError(f"shard {k} sent {payload_len} bytes for {stop - start} {self.dtype} elements")
        progress = (lambda n: on_progress(k, n)) if on_progress else None
        return header, recv_tensor(sock, out[start:stop], self.dtype, self.recv, progress)

    def _round(self, what: str, send, receive) -> list:
        """send(sock, k) to every shard, then receive(sock, k) from every shard, in this thread."""
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(self._connection(k, what)) for k in range(len(self.addresses))]
            for k, sock in enumerate(socks):
                send(sock, k)
            return [receive(sock, k) for k, sock in enumerate(socks)]

    def push_one(self, k: int, clock: int, grad: torch.Tensor) -> pb.PushReply:
        with self._connection(k, "push to") as sock:
            self._send_push(sock, k, clock, grad)
            return self._recv_push(sock, k)

    def _pull_one(self, k: int, clock: int, out: torch.Tensor, on_header=None, on_progress=None):
        with self._connection(k, "pull from") as sock:
            self._send_pull(sock, k, clock)
            return self._recv_pull(sock, k, out, on_header, on_progress)

    def _bulk(self) -> bool:
        """Large shards go one thread each (the K copies run on several cores); small ones in one
        round from this thread, where a thread hand-off would cost more than the copy it spreads."""
        per_shard = max(stop - start for start, stop in self.ranges) * codec.itemsize(self.dtype)
        return self.pool is not None and per_shard > ROUND_MAX_BYTES

    def push(self, clock: int, grad: torch.Tensor) -> tuple[bool, bool, int]:
        if self._bulk():
            return super().push(clock, grad)
        grad = grad.detach().to("cpu")
        replies = self._round("push to", lambda sock, k: self._send_push(sock, k, clock, grad), self._recv_push)
        return self.push_outcome(replies)

    def pull(self, clock: int, out: torch.Tensor):
        if self._bulk():
            return super().pull(clock, out)
        results = self._round("pull from", lambda sock, k: self._send_pull(sock, k, clock),
                              lambda sock, k: self._recv_pull(sock, k, out))
        return self._pull_result(results)

    def close(self) -> None:
        with self._lock:
            for idle in self._idle:
                for sock in idle:
                    _close(sock)
                idle.clear()
        super().close()


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
