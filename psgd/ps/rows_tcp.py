"""Sparse pulls and pushes by key over TCP: a shard's row stores served, and a worker's view of them.

A service of its own beside the dense shard (its own port), so that the dense planes stay as they
are: it serves the `RowStore`s of one shard (psgd/core/rowstore.py, one per embedding table) and
moves only the rows named. One request may name several tables (a worker asks each shard once per
step for all its tables). Frames, little-endian, both directions:

    op: u8 | worker: u32 | entries: u32 | payload length: u64 | payload

    HELLO   payload: the token                               -> WELCOME (first, when the server has one)
    PULL    directory, then each entry's int64 ids           -> ROWS: each entry's rows, fp32 (count x dim)
    PUSH    directory, then each entry's ids and fp32 rows   -> PUSHED (empty: the shard keeps the staleness)
    INIT    as PUSH, the ids every row the shard owns         -> INITED (the stores' first rows; later ones ignored)
    STATS                                                    -> STATS: JSON per table: rows, dim, bytes,
                                                                the per-row staleness histogram
    any request                                              -> ERROR "STATUS: message" (UTF-8)

The directory is `entries` pairs (table: u32, count: u64). Checks, before any store changes: 1 to
(tables served) entries of distinct tables that exist and a payload of exactly the length the
directory says (INVALID_ARGUMENT, the rest drained, the connection kept); a payload longer than
any request to this shard can carry (the connection closed: draining 2^63 announced bytes would
hold its thread for ever); then every entry's store checks (psgd/core/rowstore.py: out of range,
another shard's row, duplicates, a row not pulled) before the first entry is applied. A refused
request changes nothing. When a pull and a push are answered is the `RowRounds`' business
(psgd/core/rowrounds.py: sync, async or SSP for the rows; async when none is given); a pull it holds
past the server's `timeout` is answered DEADLINE_EXCEEDED; a connection that closes is its worker
leaving (a sync round waits for it no longer). Bytes per request: a 17-byte prefix each way, 12 per entry, 8 per id,
4 x dim per row.

`serve(stores, host, port, token, rounds, timeout, upgrades)` -> a `RowServer` (`.port`, `.close()`);
`upgrades` (op -> fn(sock, payload, server) -> the carrier of that connection's frames from then on)
are a transport's own ops (psgd/ps/transport.py `row_upgrades`: shm's ATTACH). `RowClient(address,
token, timeout, sock)`: one connection (or `sock`, another carrier of the frames: rows_grpc.py), for
one thread; `start_pull` / `finish_pull` and `start_push` /
`finish_push` (send to every shard, then read every answer: the shards work at once), `init`, `stats`.
Tests: tests/test_rows_tcp.py.
"""

from __future__ import annotations

import hmac
import json
import socket
import socketserver
import threading
from collections.abc import Sequence

import numpy as np
import torch

from psgd.core.rowrounds import RowRounds
from psgd.core.rows import ID_BYTES
from psgd.core.rowstore import RowError, RowStore
from psgd.ps.rowwire import (
    ENTRY,
    ERROR,
    HELLO,
    INIT,
    INITED,
    PREFIX,
    PULL,
    PUSH,
    PUSHED,
    ROWS,
    STATS,
    STATS_REPLY,
    WELCOME,
    RowWireError,
    as_bytes,
    drain,
    recv_exact,
    send_error,
    send_frame,
    serving,
    stats,
)

__all__ = ["ENTRY", "ERROR", "PREFIX", "PULL", "PUSH", "RowClient", "RowServer", "RowWireError", "serve"]


class _Handler(socketserver.BaseRequestHandler):
    server: RowServer

    def handle(self) -> None:
        sock, srv = self.request, self.server
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        authed, self.worker = srv.token is None, None
        try:
            while True:
                head = sock.recv(PREFIX.size, socket.MSG_WAITALL)
                if len(head) < PREFIX.size:
                    return  # closed (cleanly, or in the middle of a prefix)
                op, worker, entries, length = PREFIX.unpack(head)
                if length > srv.max_payload:
                    return send_error(sock, f"INVALID_ARGUMENT: a payload of {length} bytes is more than any request "
                                        "to this shard carries; closing")
                if op == HELLO:
                    authed = srv.token is None or hmac.compare_digest(bytes(recv_exact(sock, length)), srv.token)
                    if not authed:
                        return send_error(sock, "UNAUTHENTICATED: wrong token")
                    send_frame(sock, WELCOME, 0, 0)
                elif not authed:
                    return send_error(sock, "UNAUTHENTICATED: send HELLO with the run's token first")
                elif op == STATS:
                    drain(sock, length)
                    send_frame(sock, STATS_REPLY, 0, 0, json.dumps(srv.stats()).encode())
                elif op in (PULL, PUSH, INIT):
                    self.worker = worker if op != INIT else self.worker
                    self._request(sock, op, worker, entries, length)
                elif op in srv.upgrades:  # a transport's own carrier from now on (shm: psgd/ps/shm/rows.py)
                    sock = srv.upgrades[op](sock, bytes(recv_exact(sock, length)), srv)
                else:
                    drain(sock, length)
                    send_error(sock, f"UNIMPLEMENTED: op {op}")
        except ConnectionError:
            return
        finally:
            # A closed connection is its worker leaving; a gRPC stream that a refusal ended is not
            # (psgd/ps/rows_grpc.py: the worker's next request opens another).
            if self.worker is not None and not getattr(sock, "refused", False):
                srv.rounds.leave(self.worker)

    def _directory(self, sock, op: int, entries: int, length: int) -> list[tuple[int, int]] | str:
        """The request's (table, count) pairs, or what is wrong with them (the payload then drained)."""
        stores = self.server.stores
        if not 1 <= entries <= len(stores) or length < entries * ENTRY.size:
            drain(sock, length)
            return f"a request names 1 to {len(stores)} tables, got {entries} in {length} bytes"
        raw = recv_exact(sock, entries * ENTRY.size)
        pairs = [ENTRY.unpack_from(raw, i * ENTRY.size) for i in range(entries)]
        rest = length - len(raw)
        tables = [t for t, _ in pairs]
        if any(t >= len(stores) for t in tables) or len(set(tables)) != len(tables):
            drain(sock, rest)
            return f"tables {tables}: each must be distinct and below {len(stores)} (the tables this shard serves)"
        want = sum(n * (ID_BYTES + (4 * stores[t].dim if op != PULL else 0)) for t, n in pairs)
        if rest != want:
            drain(sock, rest)
            return f"the directory's {sum(n for _, n in pairs)} rows need {want} bytes after it, got {rest}"
        return pairs

    def _request(self, sock, op: int, worker: int, entries: int, length: int) -> None:
        stores = self.server.stores
        pairs = self._directory(sock, op, entries, length)
        if isinstance(pairs, str):
            return send_error(sock, f"INVALID_ARGUMENT: {pairs}")
        payload, at, checked = recv_exact(sock, length - entries * ENTRY.size), 0, []
        try:
            for t, n in pairs:
                ids = torch.from_numpy(np.frombuffer(payload, dtype="<i8", count=n, offset=at).copy())
                at += n * ID_BYTES
                if op == PULL:
                    checked.append(stores[t].check_pull(worker, ids))
                    continue
                dim = stores[t].dim
                grads = torch.from_numpy(np.frombuffer(payload, dtype="<f4", count=n * dim, offset=at).copy())
                at += n * dim * 4
                if op == INIT:
                    checked.append((ids, grads.view(n, dim)))
                    continue
                checked.append(stores[t].check_push(worker, ids, grads.view(n, dim), n))
            if op == INIT:
                self.server.rounds.init([(t, ids, v) for (t, _), (ids, v) in zip(pairs, checked, strict=True)])
                return send_frame(sock, INITED, worker, entries)
        except RowError as e:
            return send_error(sock, f"INVALID_ARGUMENT: {e}")
        tagged = [(t, c) for (t, _), c in zip(pairs, checked, strict=True)]
        if op == PUSH:
            self.server.rounds.push(worker, tagged)
            return send_frame(sock, PUSHED, worker, entries)
        out = self.server.rounds.pull(worker, tagged, self.server.timeout)
        if out is None:
            return send_error(sock, f"DEADLINE_EXCEEDED: worker {worker}'s pull was held {self.server.timeout:g}s")
        send_frame(sock, ROWS, worker, entries, *(as_bytes(r) for r in out))


class RowServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, stores: Sequence[RowStore], host: str, port: int, token: bytes | None,
                 rounds: RowRounds | None = None, timeout: float = 60.0, upgrades: dict | None = None) -> None:
        serving(self, stores, token, rounds, timeout)
        self.upgrades = dict(upgrades or {})
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="psgd-rows", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def stats(self) -> list[dict]:
        return stats(self)

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def serve(stores: Sequence[RowStore], host: str = "127.0.0.1", port: int = 0, token: bytes | None = None,
          rounds: RowRounds | None = None, timeout: float = 60.0, upgrades: dict | None = None) -> RowServer:
    return RowServer(stores, host, port, token, rounds, timeout, upgrades)


class RowClient:
    """One connection to one shard's row service; blocking, for one thread. `dims`: each table's
    width, asked of the shard once (STATS)."""

    def __init__(self, address: str, token: bytes | None = None, timeout: float = 60.0, sock=None) -> None:
        if sock is None:
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock  # a TCP socket, or what carries the same frames another way (rows_grpc.py)
        # What this client put on the wire and got: bytes, requests, directory entries.
        self.bytes_sent = self.bytes_received = self.requests = self.entries = 0
        if token is not None:
            self._send(HELLO, 0, 0, token)
            self._answer()
        self.dims = [s["dim"] for s in self.stats()]

    def _send(self, op: int, worker: int, entries: int, *parts) -> None:
        self.bytes_sent += send_frame(self.sock, op, worker, entries, *parts)
        self.requests += 1
        self.entries += entries

    def _answer(self) -> bytearray:
        op, _, _, length = PREFIX.unpack(recv_exact(self.sock, PREFIX.size))
        payload = recv_exact(self.sock, length)
        self.bytes_received += PREFIX.size + length
        if op == ERROR:
            status, _, message = payload.decode(errors="replace").partition(": ")
            raise RowWireError(status, message)
        return payload

    def start_pull(self, worker: int, requests: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[int, int]]:
        """Send a pull of (table, ids) entries; `finish_pull` with what this returns reads the rows."""
        pairs = [(t, len(ids)) for t, ids in requests]
        self._send(PULL, worker, len(pairs), b"".join(ENTRY.pack(t, n) for t, n in pairs),
                   *(as_bytes(ids.to(torch.int64)) for _, ids in requests))
        return pairs

    def finish_pull(self, pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
        flat = torch.from_numpy(np.frombuffer(self._answer(), dtype="<f4").copy())
        sizes = [n * self.dims[t] for t, n in pairs]
        return [part.view(n, self.dims[t]) for part, (t, n) in zip(flat.split(sizes), pairs, strict=True)]

    def start_push(self, worker: int, requests: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Send a push of (table, ids, summed gradient rows) entries; `finish_push` reads the answer."""
        parts: list = [b"".join(ENTRY.pack(t, len(ids)) for t, ids, _ in requests)]
        for _, ids, grads in requests:
            parts += [as_bytes(ids.to(torch.int64)), as_bytes(grads.float())]
        self._send(PUSH, worker, len(requests), *parts)

    def finish_push(self) -> None:
        self._answer()

    def init(self, worker: int, requests: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Offer the shard its rows of each table: (table, every id it owns, their rows)."""
        parts: list = [b"".join(ENTRY.pack(t, len(ids)) for t, ids, _ in requests)]
        for _, ids, values in requests:
            parts += [as_bytes(ids.to(torch.int64)), as_bytes(values.float())]
        self._send(INIT, worker, len(requests), *parts)
        self._answer()

    def pull(self, worker: int, requests: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        return self.finish_pull(self.start_pull(worker, requests))

    def push(self, worker: int, requests: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self.start_push(worker, requests)
        self.finish_push()

    def stats(self) -> list[dict]:
        self._send(STATS, 0, 0)
        return json.loads(self._answer())

    def close(self) -> None:
        self.sock.close()
