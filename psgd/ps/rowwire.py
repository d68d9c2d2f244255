"""The frames of the rows protocol (psgd/ps/rows_tcp.py's docstring has them), what any carrier of
them shares: the prefix and directory layouts and ops, reading and writing a frame on a socket (or
on what stands for one: psgd/ps/rows_grpc.py), `RowWireError` for an ERROR frame, and a row
server's state (`serving`) and STATS answer (`stats`), which the TCP and gRPC servers share."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import torch

from psgd.core.rowrounds import RowRounds
from psgd.core.rows import ID_BYTES
from psgd.core.rowstore import RowStore

PREFIX = struct.Struct("<BIIQ")  # op, worker, entries, payload length
ENTRY = struct.Struct("<IQ")     # table, count
HELLO, PULL, PUSH, STATS, INIT, WELCOME, ROWS, PUSHED, STATS_REPLY, INITED, ERROR = (
    1, 2, 3, 4, 5, 0x81, 0x82, 0x83, 0x84, 0x85, 0xFF)


class RowWireError(RuntimeError):
    """An ERROR frame from the server: `status` (e.g. INVALID_ARGUMENT) and the message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class Buffered:
    """What the row handler and client read of a socket (`recv`, `recv_into`), for a carrier that
    gets whole messages: `_fill()` appends the next to `buf` (False at EOF). rows_grpc.py's stream and
    psgd/ps/shm/rows.py's doorbell."""

    buf = b""

    def _fill(self) -> bool:
        raise NotImplementedError

    def recv(self, n: int, flags: int = 0) -> bytes:
        while len(self.buf) < n and self._fill():
            pass
        got, self.buf = self.buf[:n], self.buf[n:]
        return got

    def recv_into(self, view) -> int:
        if not self.buf and not self._fill():
            return 0
        n = min(len(view), len(self.buf))
        view[:n], self.buf = self.buf[:n], self.buf[n:]
        return n

    def setsockopt(self, *_) -> None:
        pass


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed in the middle of a frame")
        got += k
    return buf


def send_frame(sock: socket.socket, op: int, worker: int, entries: int, *parts: bytes | memoryview) -> int:
    head = PREFIX.pack(op, worker, entries, sum(len(p) for p in parts))
    sock.sendall(b"".join([head, *parts]))  # one write: small requests are the common case
    return len(head) + sum(len(p) for p in parts)


def send_error(sock: socket.socket, message: str) -> None:
    send_frame(sock, ERROR, 0, 0, message.encode())


def drain(sock: socket.socket, n: int) -> None:
    while n:
        n -= len(recv_exact(sock, min(n, 1 << 20)))


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().contiguous().numpy()).cast("B")


def serving(server, stores: Sequence[RowStore], token: bytes | None, rounds: RowRounds | None, timeout: float) -> None:
    """What `_Handler` reads of a row server, set on `server` (this module's, or psgd/ps/rows_grpc.py's)."""
    server.stores, server.token, server.timeout = list(stores), token, timeout
    server.upgrades = {}  # a transport's own ops (op -> fn(sock, payload, server) -> the carrier from then on)
    server.rounds = rounds or RowRounds(server.stores)
    # The largest request: a push of every row of every table, with its ids and directory.
    server.max_payload = sum(len(s.ids) * (ID_BYTES + 4 * s.dim) + ENTRY.size for s in server.stores)


def stats(server) -> list[dict]:
    """STATS' answer: per table its rows, width, bytes and rows each way, and per-row staleness."""
    return [{"rows": len(s.ids), "dim": s.dim, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
             "rows_in": s.bytes_in // (ID_BYTES + 4 * s.dim), "rows_out": s.bytes_out // (ID_BYTES + 4 * s.dim),
             "version": server.rounds.version,
             "staleness": {str(k): v for k, v in sorted(s.clock.histogram.items())}} for s in server.stores]
