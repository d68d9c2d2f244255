"""Rows over shared memory (`--embeddings rows|hybrid` on `--transport shm`): the rows protocol's
frames (psgd/ps/rowwire.py) through a segment's doorbell instead of the row service's socket.

Why: a step's row requests are small (a few KiB), so what they cost on loopback TCP is the kernel's
passes, not the copies; through the doorbell (bell.py) a waiting worker sees its reply with no
syscall at all, as the dense plane's belled connections do.

The contract, per row connection (psgd/ps/rows_tcp.py's frames, one more op):

    ATTACH  payload: the name of a belled segment in /dev/shm the worker made  ->  WELCOME, or ERROR
            and the connection as it was (the dense plane's bounds and rules: serve.py `serve_attach`)

The worker connects over TCP as before (HELLO with the token, STATS for the tables' widths), then
sends ATTACH; the WELCOME comes the way the request went. From then on each frame's 17-byte prefix
is the doorbell's header and its payload lies at the segment's start; the socket wakes a reader
that sleeps and says EOF. A reader copies a frame's payload out as it takes it, so a request and its
reply share one region. The worker knows every reply's size before it asks (ROWS: count x width x 4;
the others are empty but STATS), and attaches a larger segment first (ATTACH through the current
one) when a frame needs more than it has, up to the largest the service maps (its largest request,
a push of every row it holds, or MIN_SEGMENT); a frame beyond that is refused on the worker's side
and a reply that still does not fit (a STATS of more than MIN_SEGMENT bytes) is answered
RESOURCE_EXHAUSTED, both as RowWireError. The worker's wait for a reply spins first (the
shard answers within microseconds); the shard's wait for the next request sleeps at once: its thread
shares the shard process's GIL with the dense plane's (serve.py `push_spin`).

`connect(address, token, timeout)` -> a rows_tcp `RowClient` whose frames ride the doorbell;
`UPGRADES` ({ATTACH: `upgrade`}), the row service's side, handed to it by psgd/ps/transport.py
`row_upgrades`. Tests: tests/test_rows_tcp.py runs its protocol tests over this wire too.
"""

from __future__ import annotations

import numpy as np

from psgd.core.rows import ID_BYTES
from psgd.ps.rows_tcp import RowClient
from psgd.ps.rowwire import ENTRY, ERROR, PREFIX, PULL, WELCOME, Buffered, RowWireError, send_error, send_frame
from psgd.ps.shm.segment import REPLY_SPIN_S, Segment, spin_for
from psgd.ps.shm.serve import serve_attach

ATTACH = 6
MIN_SEGMENT = 64 << 10  # a STATS answer fits (a few hundred bytes per table)


class BellSock(Buffered):
    """One end of a belled row connection, as rows_tcp's handler and client see a socket: `sendall`
    one whole frame, `recv` / `recv_into` its bytes. `raw`: the TCP socket beneath (wake-ups, EOF)."""

    def __init__(self, segment: Segment, raw, worker: bool, spin_s: float, timeout: float | None) -> None:
        self.segment, self.raw, self.timeout, self.buf, self.worker = segment, raw, timeout, b"", worker
        segment.ring(raw, worker, spin_s)
        self.refused = False

    def sendall(self, data) -> None:
        frame = memoryview(data).cast("B")
        op, worker, entries, length = PREFIX.unpack_from(frame)
        if length > self.segment.size:
            why = f"a frame of {length} bytes for a {self.segment.size}-byte segment"
            if self.worker:
                raise RowWireError("RESOURCE_EXHAUSTED", f"{why}: more than any request to this shard carries")
            if op != ERROR:
                return send_error(self, f"RESOURCE_EXHAUSTED: {why}")
            frame, length = frame[:PREFIX.size + self.segment.size], self.segment.size  # a long message, cut
        self.segment.u8[:length] = np.frombuffer(frame, dtype=np.uint8, count=length, offset=PREFIX.size)
        head = PREFIX.pack(op, worker, entries, length)
        self.segment.bell.send(op, head, length)

    def _fill(self) -> bool:
        got = self.segment.bell.recv_head(self.timeout)
        if got is None:
            return False  # EOF: the peer closed its socket
        _, head, length = got
        self.buf += head + self.segment.u8[:length].tobytes()
        return True

    def close(self) -> None:
        self.segment.close()
        self.raw.close()


def upgrade(sock, name: bytes, server):
    """The row service's side of ATTACH on `sock` (the TCP socket, or a belled one): the connection's
    carrier from now on, or `sock` itself after an ERROR."""
    raw = getattr(sock, "raw", sock)
    try:
        segment = serve_attach(raw, name, False, max(server.max_payload, MIN_SEGMENT), belled=True)
    except ValueError as e:
        send_error(sock, str(e))
        return sock
    send_frame(sock, WELCOME, 0, 0)
    if isinstance(sock, BellSock):
        sock.segment.close()
    return BellSock(segment, raw, worker=False, spin_s=0.0, timeout=None)


UPGRADES = {ATTACH: upgrade}


class ShmRowClient(RowClient):
    """A `RowClient` whose frames, after its set-up over TCP, ride a doorbell (the module docstring)."""

    def __init__(self, address: str, token: bytes | None = None, timeout: float = 60.0, processes: int = 2) -> None:
        super().__init__(address, token, timeout)
        # The wait for a reply spins where the run's processes (workers and shards) fit the cores.
        self.timeout, self.spin_s = timeout, spin_for(processes, REPLY_SPIN_S)
        # The largest segment the service maps (`upgrade`): its largest request, a push of every row.
        self.limit = max(MIN_SEGMENT, sum(s["rows"] * (ID_BYTES + 4 * s["dim"]) + ENTRY.size for s in self.stats()))
        self._attach(MIN_SEGMENT)

    def _attach(self, nbytes: int) -> None:
        segment = Segment.create(nbytes, belled=True)
        try:
            self._send(ATTACH, 0, 0, segment.name.encode())
            self._answer()
        except (OSError, RowWireError):
            segment.unlink()
            segment.close()
            raise
        segment.unlink()  # both sides hold the memory now
        old = self.sock
        self.sock = BellSock(segment, getattr(old, "raw", old), worker=True, spin_s=self.spin_s, timeout=self.timeout)
        if isinstance(old, BellSock):
            old.segment.close()

    def _send(self, op: int, worker: int, entries: int, *parts) -> None:
        need = sum(len(p) for p in parts)
        if op == PULL and entries:  # the answer: each entry's rows, count x width x 4 bytes
            directory = memoryview(parts[0]).cast("B")
            pairs = [ENTRY.unpack_from(directory, i * ENTRY.size) for i in range(entries)]
            need = max(need, sum(n * self.dims[t] * 4 for t, n in pairs if t < len(self.dims)))
        if isinstance(self.sock, BellSock) and self.sock.segment.size < need <= self.limit:
            self._attach(min(max(need, 2 * self.sock.segment.size), self.limit))
        super()._send(op, worker, entries, *parts)

    def close(self) -> None:
        self.sock.close()


def connect(address: str, token: bytes | None = None, timeout: float = 60.0, processes: int = 2) -> ShmRowClient:
    return ShmRowClient(address, token, timeout, processes)
