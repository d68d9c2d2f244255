"""The raw-TCP data plane of one shard (`--transport tcp`): pushes and pulls on plain sockets.

Why it exists: gRPC Python moves a large tensor at about half the rate of a raw loopback socket or
less (`psgd bench transport`, results/bench/); ps-lite and BytePS have transports of their own for
the same reason. Every shard listens here too (a port `Info` reports as `data_port`); Init and Info
stay on gRPC. The frames are psgd/ps/framing.py's, read and sent through a connection's `Frames`; a
transport may upgrade a connection with an op of its own (`upgrades`, given by psgd/ps/server.py from
psgd/ps/transport.py's registry), which replaces that `Frames` with one that moves them its own way.

A thin adapter like the gRPC one (psgd/ps/grpc_server.py): each frame is parsed, handed to the
same transport-free core (psgd/ps/shard.py), and answered; one schema, one set of checks, one
consistency policy, whichever transport carries the bytes. A connection carries one request at
a time; a client keeps a pool of connections per shard.

Errors: a refused request gets an ERROR frame and changes nothing; a push refused before its
payload was read has the payload drained, so the connection stays usable. A frame that cannot be
trusted (unknown op, oversized header, a payload larger than any request of this shard can be)
gets an ERROR and the connection is closed.

Bounds (a slow, silent or hostile client must not take the shard from its workers):
- With a token (psgd/ps/auth.py) the first frame must be HELLO with it; anything else is
  UNAUTHENTICATED and the connection is closed. Nothing reaches the shard before that.
- The whole first frame's head (the HELLO, or without a token the first request's) must arrive
  within `auth_deadline` seconds of connecting (AUTH_DEADLINE_S unless told; TLS's handshake
  included), however its bytes are spaced: a peer that says nothing, or trickles a byte at a time,
  is cut then. Until that frame arrived a connection is pending and counts for nothing.
- At most `max_connections` admitted connections at once (4 per worker + 8: a client keeps a small
  pool per shard); only a connection whose first frame arrived (and, with a token, carried it) is
  admitted or counted, so strangers cannot fill the room; one more is answered RESOURCE_EXHAUSTED
  and closed. Pending connections hold a thread each for at most the deadline (a thread that cannot
  start refuses its connection only: socketserver's handle_error).
- Once admitted, a frame once begun must progress within the run's --rpc-timeout per read; between
  frames a connection may idle (a worker computing). No read or send ever happens with the shard's
  lock held.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import ssl
import threading
import time

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec, sparsify
from psgd.core.errors import Code, ShardError
from psgd.ps import auth, wire
from psgd.ps import framing as fr
from psgd.ps.shard import Shard

AUTH_DEADLINE_S = 5.0  # a connection's whole first frame (HELLO, or a request) must arrive this soon


class DataServer(socketserver.ThreadingTCPServer):
    """The shard's TCP listener: one thread per connection, each running `_Connection.handle`."""

    daemon_threads = False   # stop() joins every connection thread: nothing outlives the server
    request_queue_size = 256  # listen backlog: a burst of connections waits here instead of SYN retries
    block_on_close = True
    allow_reuse_address = False

    def __init__(self, shard: Shard, host: str = "127.0.0.1", token: bytes | None = None,
                 tls: ssl.SSLContext | None = None, upgrades: dict | None = None,
                 auth_deadline: float = AUTH_DEADLINE_S) -> None:
        self.shard = shard
        self.auth_deadline = auth_deadline
        self.token = token
        self.tls = tls
        # op -> upgrade(frames, header, payload_len, server) -> the connection's Frames from now on
        # (it answers the op itself, WELCOME or ERROR): the transports' own ops (psgd/ps/transport.py)
        self.upgrades = upgrades or {}
        self.max_connections = 4 * shard.workers + 8
        self.connections: set[socket.socket] = set()  # admitted: they count against max_connections
        self.pending: set[socket.socket] = set()      # their first frame has not arrived yet
        self.lock = threading.Lock()  # guards connections, pending and stopping
        self.stopping = False
        super().__init__((host, 0), _Connection)
        self.port = self.server_address[1]
        # A short poll interval: shutdown() waits for the serve loop to notice, and that wait is on
        # every run's critical path (the default 0.5 s cost 0.2 s per run on average).
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02},
                                       name=f"psgd-tcp-{shard.index}", daemon=True)
        self.thread.start()

    def get_request(self):
        sock, address = super().get_request()
        if self.tls is None:
            return sock, address
        # The handshake runs in the connection's thread, on its first read (under auth_deadline),
        # never in the accept loop, where one silent client would hold every other.
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def stop(self) -> None:
        """Stop accepting, cut open connections (their threads end), join everything.
        Call after `shard.close()`, so that no pull is still held."""
        self.shutdown()
        with self.lock:
            # A connection accepted just before shutdown() registers itself in setup(), after
            # this: the flag makes it cut itself, so that server_close() never waits on it.
            self.stopping = True
            for conn in self.connections | self.pending:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.server_close()
        self.thread.join()


class _Connection(socketserver.BaseRequestHandler):
    server: DataServer

    def setup(self) -> None:
        # The deadline runs from here: connecting, TLS's handshake and the first frame all fit in it.
        self.deadline = time.monotonic() + self.server.auth_deadline
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.frames = fr.Frames(self.request, self.server.shard.options.rpc_timeout)  # an upgrade replaces it
        with self.server.lock:
            if self.server.stopping:
                with contextlib.suppress(OSError):
                    self.request.shutdown(socket.SHUT_RDWR)  # handle() then reads EOF and returns
            self.server.pending.add(self.request)

    def finish(self) -> None:
        with self.server.lock:
            self.server.connections.discard(self.request)
            self.server.pending.discard(self.request)
        self.frames.close()

    def _admit(self) -> bool:
        """Count this connection against the cap now that its first frame came (False: no room)."""
        with self.server.lock:
            self.server.pending.discard(self.request)
            if len(self.server.connections) >= self.server.max_connections:
                return False
            self.server.connections.add(self.request)
            return True

    def handle(self) -> None:
        trusted = self.server.token is None  # without a token every peer is (loopback runs)
        first = True
        while True:
            try:
                head = self.frames.next_head(self.deadline if first else None)
                if head is None:
                    return
                op, header, payload_len = head
                # Its first frame came whole and in time, with the token if one is needed: only
                # now does it take a place (a wrong token or a request without one is refused below).
                good = op == fr.HELLO and not payload_len and auth.accepts(self.server.token, header)
                if first and (good or (trusted and op != fr.HELLO)) and not self._admit():
                    return self._refuse(f"RESOURCE_EXHAUSTED: shard {self.server.shard.index} has "
                                        f"{self.server.max_connections} connections open already")
                first = False
                if op == fr.HELLO:
                    if payload_len or not auth.accepts(self.server.token, header):
                        return self._refuse("UNAUTHENTICATED: wrong psgd token (--token-file / PSGD_TOKEN)")
                    trusted = True
                    self.frames.send(fr.WELCOME, b"")
                    continue
                if not trusted:
                    return self._refuse("UNAUTHENTICATED: this shard needs a token: send HELLO first "
                                        "(--token-file / PSGD_TOKEN)")
                upgrade = self.server.upgrades.get(op)
                if upgrade is not None:
                    self.frames = upgrade(self.frames, header, payload_len, self.server)
                    continue
                handler = {fr.PUSH: self._push, fr.PULL: self._pull, fr.PUSHPULL: self._push_pull}.get(op)
                if handler is None:
                    raise fr.FrameError(f"unknown frame op {op}")
                if payload_len > self.server.shard.max_payload:  # draining it would let it hold us
                    raise fr.FrameError(f"payload of {payload_len} bytes; no request to this shard has more "
                                        f"than {self.server.shard.max_payload}")
                self.frames.check(payload_len)
                try:
                    handler(header, payload_len)
                except ShardError as e:  # refused before the payload was read: drain it, keep going
                    self.frames.drain(payload_len)
                    self._error(e)
            except fr.FrameError as e:  # the stream cannot be trusted any more: say why, close it
                with contextlib.suppress(OSError):
                    self.frames.send(fr.ERROR, f"INVALID_ARGUMENT: {e}".encode())
                return
            except OSError:  # the worker went away, stalled past its deadline, failed the TLS handshake,
                return       # or the server is stopping (ssl.SSLError is an OSError)

    def _refuse(self, message: str) -> None:
        """An ERROR frame saying why; the caller decides whether the connection stays open (a refused
        request) or closes (handle() returns: no token, no room)."""
        self.frames.send(fr.ERROR, message.encode())

    def _received_push(self, header: bytes, payload_len: int) -> tuple[pb.TensorHeader, object, float]:
        """Read a push's frame and hand it to the shard: (header, PushOutcome, seconds it waited for
        its turn), or (header, None, ...) after answering an ERROR (a refusal once the payload is
        read: nothing left to drain)."""
        shard = self.server.shard
        h = wire.parse_header(pb.TensorHeader, header)
        dtype = wire.dtype_name(h.dtype)
        shard.check_push(h.worker_id, h.shard, h.num_elements, h.sparse_count)
        if h.sparse_count:
            expected = sparsify.wire_bytes(h.sparse_count, dtype)
            what = f"{h.sparse_count} sparse entries (int32 index, {dtype} value)"
        else:
            expected, what = h.num_elements * codec.itemsize(dtype), f"{h.num_elements} {dtype} elements"
        if payload_len != expected:
            raise ShardError(Code.INVALID_ARGUMENT, f"payload of {payload_len} bytes; {what} are {expected}")
        # Before any payload byte is read: an early sync push waits for its turn with its bytes in
        # the socket's buffers and the worker (TCP's flow control), not in the shard's memory.
        waited = shard.turn(h.worker_id, h.clock, shard.options.rpc_timeout)
        pace = _pacer(shard.link_in)
        # A dense gradient the connection holds where it can be read (in memory the worker wrote):
        # no receive buffer lent; the shard's policy copies what it keeps.
        grad = None if h.sparse_count else self.frames.in_place(h.num_elements, dtype, payload_len, pace)
        if grad is not None:
            o = self._hand_over(h, grad, dtype, payload_len)
            if o is not None:
                self.frames.consumed()  # the worker may write there again (before the reply)
            return h, o, waited
        with shard.receive_buffer() as buf:
            try:
                if h.sparse_count:
                    wire.scatter_sparse(self.frames.recv_bytes(payload_len, pace), h, dtype, buf)
                else:
                    self.frames.recv_tensor(buf, dtype, pace)
            except ShardError as e:  # refused once the payload is read: nothing left to drain
                self._error(e)
                return h, None, waited
            return h, self._hand_over(h, buf, dtype, payload_len), waited

    def _hand_over(self, h: pb.TensorHeader, grad, dtype: str, payload_len: int):
        """shard.push of a received gradient: its PushOutcome, or None after answering an ERROR (a
        refusal once the payload is read: nothing left to drain)."""
        try:
            return self.server.shard.push(h.worker_id, h.clock, h.base_version, grad, dtype, payload_len)
        except ShardError as e:
            self._error(e)
            return None

    def _push(self, header: bytes, payload_len: int) -> None:
        _, o, waited = self._received_push(header, payload_len)
        if o is not None:
            self.frames.send(fr.PUSHED, wire.push_reply(o, waited).SerializeToString())

    def _push_pull(self, header: bytes, payload_len: int) -> None:
        h, o, waited = self._received_push(header, payload_len)
        if o is None:
            return
        shard = self.server.shard
        try:
            with shard.next_pull(o, h.worker_id, h.shard, h.clock, wire.dtype_name(h.dtype),
                                 shard.options.rpc_timeout) as p:
                self._send_pulled(p, h.dtype, wire.push_reply(o, waited))
        except ShardError as e:  # the payload is read: answer without draining anything
            self._error(e)

    def _pull(self, header: bytes, payload_len: int) -> None:
        shard = self.server.shard
        if payload_len:
            raise ShardError(Code.INVALID_ARGUMENT, "a pull request carries no payload")
        request = wire.parse_header(pb.PullRequest, header)
        dtype = wire.dtype_name(request.dtype)
        # A frame carries no deadline: the shard's own --rpc-timeout bounds a held pull.
        with shard.pull(request.worker_id, request.shard, request.clock, dtype, shard.options.rpc_timeout) as p:
            self._send_pulled(p, request.dtype)

    def _send_pulled(self, p, dtype_enum: int, pushed: pb.PushReply | None = None) -> None:
        n = 0 if p.values is None else p.values.numel()
        reply = pb.PullHeader(version=p.version, num_elements=n, dtype=dtype_enum, done=p.done,
                              wait_s=p.wait_s, clock_gap=p.clock_gap, pushed=pushed).SerializeToString()
        self.frames.send_values(fr.PULLED, reply, p.values, wire.dtype_name(dtype_enum),
                                _pacer(self.server.shard.link_out))

    def _error(self, e: ShardError) -> None:
        self._refuse(f"{e.code.name}: {e.message}")


def _pacer(pacer):
    """The pacing callback of one message on the shard's NIC (None without --link)."""
    if pacer is None:
        return None
    pacer.start(latency=False)
    return pacer.pace
