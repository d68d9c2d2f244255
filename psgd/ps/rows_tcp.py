"""Sparse pulls and pushes by key over TCP: a shard's row stores served, and a worker's view of them.

A service of its own beside the dense shard (its own port), so that the dense planes stay as they
are: it serves the `RowStore`s of one shard (psgd/core/rowstore.py, one per embedding table) and
moves only the rows named. Frames, little-endian, both directions:

    op: u8 | table: u32 | worker: u32 | count: u64 | payload length: u64 | payload

    HELLO   payload: the token                    -> WELCOME (the first frame when the server has one)
    PULL    count int64 ids                       -> ROWS: count x dim fp32 rows
    PUSH    count int64 ids, count x dim fp32     -> PUSHED (empty: the shard keeps the staleness, STATS)
    STATS   (table: any)                          -> STATS: JSON, per table: share, bytes, staleness histogram
    any request                                   -> ERROR "STATUS: message" (UTF-8)

Checks, before the store sees anything: a table that does not exist, a payload whose length is not
what `count` says (INVALID_ARGUMENT, the payload drained, the connection kept); a payload longer
than any request to this shard can carry (the connection closed: draining 2^63 announced bytes would
hold its thread for ever); then the store's own (psgd/core/rowstore.py: out of range, another
shard's row, duplicates, a row not pulled: INVALID_ARGUMENT). A refused request changes nothing.
Bytes on the wire per request: a prefix of 25 each way, 8 per id, 4 x dim per row.

`serve(stores, host, port, token)` -> a `RowServer` (`.port`, `.close()`); `RowClient(address,
token)` -> `pull`, `push`, `stats`, `close`, one connection, for one thread. `RemoteStore(client,
table, partition, dim)` has a `RowStore`'s pull / push, so psgd/train/rowtrain.py's `SparseRows`
drives local and remote stores alike. Tests: tests/test_rows_tcp.py.
"""

from __future__ import annotations

import hmac
import json
import socket
import socketserver
import struct
import threading
from collections.abc import Sequence

import numpy as np
import torch

from psgd.core.rows import ID_BYTES, RowPartition
from psgd.core.rowstore import RowError, RowStore

PREFIX = struct.Struct("<BIIQQ")  # op, table, worker, count, payload length
HELLO, PULL, PUSH, STATS, WELCOME, ROWS, PUSHED, STATS_REPLY, ERROR = 1, 2, 3, 4, 0x81, 0x82, 0x83, 0x84, 0xFF


class RowWireError(Exception):
    """An ERROR frame from the server: `status` (e.g. INVALID_ARGUMENT) and the message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed in the middle of a frame")
        got += k
    return buf


def _send(sock: socket.socket, op: int, table: int, worker: int, count: int, *parts: bytes | memoryview) -> None:
    sock.sendmsg([PREFIX.pack(op, table, worker, count, sum(len(p) for p in parts)), *parts])


def _drain(sock: socket.socket, n: int) -> None:
    while n:
        n -= len(_recv_exact(sock, min(n, 1 << 20)))


class _Handler(socketserver.BaseRequestHandler):
    server: RowServer

    def handle(self) -> None:
        sock, srv = self.request, self.server
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        authed = srv.token is None
        while True:
            try:
                head = sock.recv(PREFIX.size, socket.MSG_WAITALL)
                if len(head) < PREFIX.size:
                    return  # closed (cleanly, or in the middle of a prefix)
                op, table, worker, count, length = PREFIX.unpack(head)
                if length > srv.max_payload:
                    _send(sock, ERROR, 0, 0, 0, f"INVALID_ARGUMENT: a payload of {length} bytes is more than any "
                                                "request to this shard carries; closing".encode())
                    return
                if op == HELLO:
                    authed = srv.token is None or hmac.compare_digest(bytes(_recv_exact(sock, length)), srv.token)
                    if not authed:
                        _send(sock, ERROR, 0, 0, 0, b"UNAUTHENTICATED: wrong token")
                        return
                    _send(sock, WELCOME, 0, 0, 0)
                elif not authed:
                    _send(sock, ERROR, 0, 0, 0, b"UNAUTHENTICATED: send HELLO with the run's token first")
                    return
                else:
                    self._request(sock, op, table, worker, count, length)
            except ConnectionError:
                return

    def _request(self, sock: socket.socket, op: int, table: int, worker: int, count: int, length: int) -> None:
        stores = self.server.stores
        if op == STATS:
            _drain(sock, length)
            _send(sock, STATS_REPLY, 0, 0, 0, json.dumps(self.server.stats()).encode())
            return
        problem = None
        if op not in (PULL, PUSH):
            problem = f"UNIMPLEMENTED: op {op}"
        elif table >= len(stores):
            problem = f"INVALID_ARGUMENT: table {table} does not exist (this shard serves {len(stores)})"
        else:
            dim = stores[table].dim
            want = count * ID_BYTES + (count * dim * 4 if op == PUSH else 0)
            if length != want:
                problem = f"INVALID_ARGUMENT: {count} rows need a payload of {want} bytes, got {length}"
        if problem:
            _drain(sock, length)
            _send(sock, ERROR, 0, 0, 0, problem.encode())
            return
        payload = _recv_exact(sock, length)
        ids = torch.from_numpy(np.frombuffer(payload, dtype="<i8", count=count).copy())
        try:
            if op == PULL:
                got = stores[table].pull(worker, ids)
                _send(sock, ROWS, table, worker, count, memoryview(got.numpy()).cast("B"))
            else:
                grads = torch.from_numpy(np.frombuffer(payload, dtype="<f4", offset=count * ID_BYTES).copy())
                stores[table].push(worker, ids, grads.view(count, dim), count)
                _send(sock, PUSHED, table, worker, count)
        except RowError as e:
            _send(sock, ERROR, 0, 0, 0, f"INVALID_ARGUMENT: {e}".encode())


class RowServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, stores: Sequence[RowStore], host: str, port: int, token: bytes | None) -> None:
        self.stores, self.token = list(stores), token
        # The largest request: a push of every row of the widest table, with its ids.
        self.max_payload = max((len(s.ids) * (ID_BYTES + 4 * s.dim) for s in self.stores), default=0)
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="psgd-rows", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def stats(self) -> list[dict]:
        return [{"rows": len(s.ids), "dim": s.dim, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
                 "staleness": {str(k): v for k, v in sorted(s.clock.histogram.items())}} for s in self.stores]

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def serve(stores: Sequence[RowStore], host: str = "127.0.0.1", port: int = 0, token: bytes | None = None) -> RowServer:
    return RowServer(stores, host, port, token)


class RowClient:
    """One connection to one shard's row service. Blocking; for one thread."""

    def __init__(self, address: str, token: bytes | None = None, timeout: float = 60.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.bytes_sent = self.bytes_received = self.requests = 0  # what this client put on the wire and got
        if token is not None:
            self._call(HELLO, 0, 0, 0, token)

    def _call(self, op: int, table: int, worker: int, count: int, *parts) -> tuple[int, bytearray]:
        _send(self.sock, op, table, worker, count, *parts)
        self.bytes_sent += PREFIX.size + sum(len(p) for p in parts)
        self.requests += 1
        rop, _, _, _, length = PREFIX.unpack(_recv_exact(self.sock, PREFIX.size))
        payload = _recv_exact(self.sock, length)
        self.bytes_received += PREFIX.size + length
        if rop == ERROR:
            status, _, message = payload.decode(errors="replace").partition(": ")
            raise RowWireError(status, message)
        return rop, payload

    def pull(self, table: int, worker: int, ids: torch.Tensor, dim: int) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        _, payload = self._call(PULL, table, worker, len(ids), memoryview(ids.numpy()).cast("B"))
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").copy()).view(len(ids), dim)

    def push(self, table: int, worker: int, ids: torch.Tensor, grads: torch.Tensor, count: int | None = None
             ) -> None:
        """Apply one summed gradient per row; the per-row staleness stays on the shard (`stats`)."""
        ids, grads = ids.to(torch.int64).contiguous(), grads.float().contiguous()
        self._call(PUSH, table, worker, len(ids) if count is None else count,
                   memoryview(ids.numpy()).cast("B"), memoryview(grads.numpy()).cast("B"))

    def stats(self) -> list[dict]:
        return json.loads(self._call(STATS, 0, 0, 0)[1])

    def close(self) -> None:
        self.sock.close()


class RemoteStore:
    """A shard's store of one table, reached through a `RowClient` (the interface SparseRows uses)."""

    def __init__(self, client: RowClient, table: int, partition: RowPartition, dim: int) -> None:
        self.client, self.table, self.partition, self.dim = client, table, partition, dim

    def pull(self, worker: int, ids: torch.Tensor) -> torch.Tensor:
        return self.client.pull(self.table, worker, ids, self.dim)

    def push(self, worker: int, ids: torch.Tensor, grads: torch.Tensor, count: int) -> torch.Tensor:
        """As RowStore.push, but the staleness is counted on the shard only: an empty tensor here."""
        self.client.push(self.table, worker, ids, grads, count)
        return torch.empty(0, dtype=torch.int64)
