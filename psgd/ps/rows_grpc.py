"""Sparse pulls and pushes by key over gRPC (`--embeddings rows|hybrid --transport grpc`).

The rows protocol of psgd/ps/rows_tcp.py (its frames, psgd/ps/rowwire.py; its checks and its
`RowRounds`, the same handler) carried by gRPC: one bidirectional stream per worker,
`/psgd.Rows/Session`, each message one frame. What differs from TCP is how a refusal comes back: as
the stream's gRPC status with its message (INVALID_ARGUMENT, UNAUTHENTICATED, DEADLINE_EXCEEDED, ...),
the stores unchanged, and the client opens a new stream for its next request (saying HELLO again
when the run has a token); a worker that sends nothing more within half the server's deadline is gone. A
stream that ends otherwise (the worker gone) is its worker leaving, as a closed TCP connection is.
Messages may be as large as the largest request to the shard (an INIT of
every row it owns), past gRPC's 4 MB default.

`serve(stores, host, port, token, rounds, timeout)` -> a `GrpcRowServer` (`.port`, `.close()`,
`.stores`, `.rounds`, `.stats()`, as rows_tcp's `RowServer`). `connect(address, token, timeout)` -> a
rows_tcp `RowClient` whose frames ride a stream (`StreamSock`). Tests: tests/test_rows_tcp.py runs
its protocol tests over both.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc

from psgd.core.rowrounds import RowRounds
from psgd.core.rowstore import RowStore
from psgd.ps.rows_tcp import RowClient, _Handler
from psgd.ps.rowwire import ERROR, HELLO, PREFIX, Buffered, RowWireError, serving, stats

METHOD = "/psgd.Rows/Session"
MAX_THREADS = 64  # streams served at once (at least; more for a run of more workers): one per worker


class _Pipe(Buffered):
    """A stream, as the TCP handler sees a socket: what it reads comes from the request messages,
    what it writes goes to `out` (a frame, or an ERROR frame's "STATUS: message" to end the stream)."""

    def __init__(self, requests: Iterator[bytes], seen: dict[int, float]) -> None:
        self.requests, self.buf, self.out, self.seen = requests, b"", queue.Queue(), seen
        self.refused = False  # a refusal ended the stream: the worker is not gone (rows_tcp `_Handler`)

    def _fill(self) -> bool:
        try:
            message = next(self.requests)
            if len(message) >= PREFIX.size:  # one frame a message: note when its worker was last heard
                self.seen[PREFIX.unpack_from(message)[1]] = time.monotonic()
            self.buf += message
            return True
        except Exception:  # noqa: BLE001 - the stream ended: closed, cancelled or aborted, EOF all the same
            return False

    def sendall(self, data) -> None:
        data = bytes(data)
        if data[0] == ERROR:
            self.refused = True
            self.out.put(("error", data[PREFIX.size:].decode(errors="replace")))
        else:
            self.out.put(("frame", data))


class GrpcRowServer:
    """One shard's row stores behind `/psgd.Rows/Session` (see the module docstring)."""

    def __init__(self, stores: Sequence[RowStore], host: str, port: int, token: bytes | None,
                 rounds: RowRounds | None = None, timeout: float = 60.0) -> None:
        serving(self, stores, token, rounds, timeout)
        self.seen: dict[int, float] = {}  # worker -> when its last request came (a refused one's return)
        limit = [("grpc.max_receive_message_length", self.max_payload + PREFIX.size + 1024),
                 ("grpc.max_send_message_length", self.max_payload + PREFIX.size + 1024)]
        threads = max(MAX_THREADS, 2 * len(self.rounds.active) + 8)  # a session holds one for its life
        self.server = grpc.server(futures.ThreadPoolExecutor(threads, thread_name_prefix="psgd-rows"), options=limit)
        handler = grpc.stream_stream_rpc_method_handler(self._session)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            METHOD.split("/")[1], {METHOD.split("/")[2]: handler}),))
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.server.start()

    def _session(self, requests: Iterator[bytes], context) -> Iterator[bytes]:
        pipe = _Pipe(requests, self.seen)
        handler = _Handler.__new__(_Handler)  # the TCP handler's logic, on the stream (not a socket)
        handler.request, handler.server = pipe, self

        def run() -> None:
            try:
                handler.handle()
            finally:
                pipe.out.put(None)
                if pipe.refused and getattr(handler, "worker", None) is not None:
                    self._gone_unless_back(handler.worker, time.monotonic())

        threading.Thread(target=run, name="psgd-rows-session", daemon=True).start()
        while (item := pipe.out.get()) is not None:
            kind, data = item
            if kind == "error":
                status, _, message = data.partition(": ")
                context.abort(getattr(grpc.StatusCode, status, grpc.StatusCode.UNKNOWN), message)
            yield data

    def _gone_unless_back(self, worker: int, at: float) -> None:
        """A refusal ended `worker`'s stream: it is gone (as a closed TCP connection is) unless it
        sends again within half the server's deadline, on a new stream (half: a round it holds up is
        let go before the pulls that wait on it reach their own deadline)."""
        def check() -> None:
            if self.seen.get(worker, 0.0) <= at:
                self.rounds.leave(worker)
        timer = threading.Timer(self.timeout / 2, check)
        timer.daemon = True
        timer.start()

    def stats(self) -> list[dict]:
        return stats(self)

    def close(self) -> None:
        self.server.stop(grace=0).wait()


def serve(stores: Sequence[RowStore], host: str = "127.0.0.1", port: int = 0, token: bytes | None = None,
          rounds: RowRounds | None = None, timeout: float = 60.0) -> GrpcRowServer:
    return GrpcRowServer(stores, host, port, token, rounds, timeout)


class StreamSock:
    """The client's end of a session, as RowClient uses a socket: each `sendall` one request message,
    `recv_into` the reply messages' bytes; a stream ended by a status raises it as RowWireError and
    the next request opens another (HELLO first, answered here, when one was said)."""

    def __init__(self, address: str, timeout: float, max_bytes: int = (1 << 31) - 1) -> None:
        limit = [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]
        self.channel = grpc.insecure_channel(address, options=limit)
        self.session = self.channel.stream_stream(METHOD)
        self.timeout, self.hello, self.q, self.replies, self.buf = timeout, None, None, None, b""

    def _open(self) -> None:
        self.q, self.buf, self.inbox = queue.Queue(), b"", queue.Queue()
        self.replies = self.session(iter(self.q.get, None))
        threading.Thread(target=self._pump, args=(self.replies, self.inbox), name="psgd-rows-replies",
                         daemon=True).start()
        if self.hello is not None:
            self.q.put(self.hello)
            self._next()  # its WELCOME, for no caller (or the status that refuses the token)

    @staticmethod
    def _pump(replies, inbox: queue.Queue) -> None:
        """The stream's replies into `inbox` (then None, or the status that ended it): a reply is
        waited for with a deadline there, as a socket's read is."""
        try:
            for reply in replies:
                inbox.put(reply)
            inbox.put(None)
        except grpc.RpcError as e:
            inbox.put(e)

    def _next(self) -> bytes:
        try:
            got = self.inbox.get(timeout=self.timeout)
        except queue.Empty:
            got = None
            self.replies.cancel()
            self._drop()
            raise RowWireError("DEADLINE_EXCEEDED", f"no answer from the row service in {self.timeout:g}s") from None
        if isinstance(got, grpc.RpcError):
            self._drop()
            raise RowWireError(got.code().name, got.details() or "")
        if got is None:
            self._drop()
            raise ConnectionError("the row service closed the stream")
        return got

    def _drop(self) -> None:
        """This stream is over: the next request opens another."""
        self.q.put(None)
        self.q = self.replies = None

    def sendall(self, data) -> None:
        data = bytes(data)
        if self.q is None:
            self._open()  # HELLO first when one was said before: a new stream after a refusal
        if data[0] == HELLO:
            self.hello = data
        self.q.put(data)

    def recv_into(self, view) -> int:
        if not self.buf:
            self.buf = self._next()
        n = min(len(view), len(self.buf))
        view[:n], self.buf = self.buf[:n], self.buf[n:]
        return n

    def close(self) -> None:
        if self.q is not None:
            self.q.put(None)
        self.channel.close()


def connect(address: str, token: bytes | None = None, timeout: float = 60.0) -> RowClient:
    """A RowClient of one shard's row service over gRPC (see the module docstring)."""
    return RowClient(address, token, timeout, sock=StreamSock(address, timeout))
