"""The shard's side of `--transport shm`: a data-plane connection upgraded to shared memory.

psgd/ps/tcp_server.py serves every connection through a `framing.Frames`; the two ops here
(`UPGRADES`, handed to it by psgd/ps/server.py from the transport registry) replace that with
`SegmentFrames`, which reads and writes the payloads in the segment the worker named, and with
BELL the frames themselves through its doorbell (psgd/ps/shm/bell.py):

    ATTACH  the name of a file in /dev/shm the worker created  ->  WELCOME, or ERROR and nothing changes
    BELL    the same, optionally "NAME@AT"                     ->  as ATTACH; then the doorbell

A segment is mapped only for a loopback peer that is not on TLS, and only within the bounds of
psgd/ps/shm/segment.py `Segment.attach`; a refusal leaves the connection as it was.
"""

from __future__ import annotations

import socket

import torch

from psgd.ps import auth
from psgd.ps import framing as fr
from psgd.ps.shm import bell
from psgd.ps.shm.bell import spin_now
from psgd.ps.shm.segment import PUSH_SPIN_S, Segment, spin_for

ATTACH, BELL = 5, 6  # the ops of framing.py's upgrade range this transport takes


class SegmentFrames(fr.Frames):
    """A connection whose payloads are in `segment` (a request's at its start, a reply's at its
    `reply_at`), and, once it rings (BELL), whose frames go through its doorbell."""

    def __init__(self, sock: socket.socket, rpc_timeout: float, segment: Segment, spin_s: float, shard=None) -> None:
        super().__init__(sock, rpc_timeout)
        self.segment, self.spin_s, self.shard = segment, spin_s, shard
        self.home: torch.Tensor | None = None  # the parameters' region, once the shard keeps them there
        self.homing = shard is not None and shard.workers == 1  # asked once, at the first reply, if at all

    def next_head(self, first_timeout):
        if self.segment.bell is not None:
            return self.segment.bell.recv_head()
        self.sock.settimeout(first_timeout)
        fr.await_readable(self.sock, spin_now(self.spin_s))
        return fr.recv_head(self.sock, lambda: self.sock.settimeout(self.rpc_timeout))

    def send(self, op, header, payload=None, on_chunk=None, length: int = 0) -> None:
        """A frame whose payload (`length` bytes) is in the segment already."""
        if self.segment.bell is not None:
            return self.segment.bell.send(op, header, length)
        fr.send_frame(self.sock, op, header, None, length=length)

    def send_values(self, op, header, values, dtype, pace=None) -> None:
        if values is None:
            return self.send(op, header)
        length = self.segment.put_tensor(values, dtype, self.segment.reply_at)  # no copy once they live there
        if self.homing and dtype == "fp32" and self.segment.reply_at:
            # A one-worker shard keeps its parameters where this reply just put them (the worker's
            # lent region): the next replies copy nothing (psgd/ps/snapshots.py `home`). Asked once.
            self.homing = False
            region = self.segment.region("fp32", self.segment.reply_at, values.numel())
            self.home = region if self.shard.home(region, values) else None
        if pace:
            pace(length)
        self.send(op, header, length=length)

    def in_place(self, count: int, dtype: str, payload_len: int, pace=None) -> torch.Tensor | None:
        """Dense fp32: the gradient where the worker wrote it (it writes there again only after the reply)."""
        if dtype != "fp32":
            return None
        if pace:
            pace(payload_len)
        return self.segment.region("fp32", 0, count)

    def recv_tensor(self, out, dtype, pace=None) -> None:
        n = self.segment.get_tensor(out, dtype)
        if pace:
            pace(n)

    def recv_bytes(self, nbytes, pace=None) -> bytearray:
        if pace:
            pace(nbytes)
        return self.segment.get_bytes(nbytes)

    def drain(self, nbytes: int) -> None:
        pass  # the payload is in the segment: nothing is left on the socket

    def consumed(self) -> None:
        if self.segment.bell is not None:
            self.segment.bell.consumed()  # a worker whose gradient lies in the segment (lent) may zero its gradient now

    def check(self, payload_len: int) -> None:
        if payload_len > self.segment.size:
            raise fr.FrameError(f"payload of {payload_len} bytes in a {self.segment.size}-byte segment")

    def close(self) -> None:
        if self.home is not None:  # the parameters first, out of the memory that is going
            self.shard.leave_home(self.home)
            self.home = None
        self.segment.close()


def upgrade(frames: fr.Frames, header: bytes, payload_len: int, server, belled: bool = False) -> fr.Frames:
    """ATTACH (BELL: `belled`) on a connection: map the segment the worker named, answer the way the
    request came (on the socket, or an old segment's doorbell), and return the connection's frames
    from now on; a refusal is an ERROR and leaves `frames` as they were."""
    if payload_len:
        raise fr.FrameError("an ATTACH frame carries no payload")
    try:
        mapped = serve_attach(frames.sock, header, server.tls is not None, server.shard.max_payload, belled)
    except ValueError as e:
        frames.send(fr.ERROR, str(e).encode())
        return frames
    frames.send(fr.WELCOME, b"")
    frames.close()
    shard = server.shard
    spin_s = push_spin(shard.workers, shard.options.worker_threads, shard.options.num_shards,
                       shard.options.serves_rows)
    if belled:
        mapped.ring(frames.sock, worker=False, spin_s=spin_s)
    return SegmentFrames(frames.sock, frames.rpc_timeout, mapped, spin_s, shard)


def push_spin(workers: int, worker_threads: int, shards: int, rows: bool = False) -> float:
    """How long a shard's wait for the next push spins before it sleeps. With one worker only: one
    connection thread per shard then waits at a time, where N spinning threads would take the GIL
    from the one that serves a push. Not beside a row service (`rows`), whose threads serve the
    worker's row requests while it waits (a Python spin holds the GIL: DLRM's N=1 run at --threads 1
    made 1,450 samples/s, 12,830 over tcp). And only where the worker's threads and the shards fit
    the cores: a lone worker takes every core (psgd/train/threads.py), and a shard spinning on one
    while it computes stalls its OpenMP team at each barrier (an MLP's step 20x slower on 2 cores)."""
    return spin_for(worker_threads + shards, PUSH_SPIN_S) if workers == 1 and not rows else 0.0


UPGRADES = {ATTACH: upgrade, BELL: lambda *a: upgrade(*a, belled=True)}


def serve_attach(sock: socket.socket, header: bytes, tls: bool, max_bytes: int, belled: bool = False) -> Segment:
    """A shard's side of ATTACH (BELL: `belled`): the segment the header names, mapped;
    ValueError("STATUS: why") if not."""
    why = refused(sock, tls)
    if why is None and belled and not bell.available():
        why = "FAILED_PRECONDITION: no shared-memory doorbell on this CPU: use ATTACH"
    if why is not None:
        raise ValueError(why)
    name, _, at = header.decode(errors="replace").partition("@")
    try:
        seg = Segment.attach(name, max_bytes, belled)
    except ValueError as e:
        raise ValueError(f"FAILED_PRECONDITION: {e}") from None
    if at and not (belled and at.isdigit() and int(at) % 64 == 0 and int(at) < seg.size):
        seg.close()
        raise ValueError(f"INVALID_ARGUMENT: a reply offset {at!r} in a {seg.size}-byte segment")
    seg.reply_at = int(at or 0)
    seg.unlink()  # taken: both sides hold the memory now, the name is not needed (the worker unlinks it too)
    return seg


def refused(sock: socket.socket, tls: bool) -> str | None:
    """Why a shard will not map a segment for this connection, or None."""
    if tls:
        return "FAILED_PRECONDITION: shared memory would bypass TLS: use --transport tcp"
    if not loopback(sock):
        return "FAILED_PRECONDITION: --transport shm needs the worker on the shard's host (a loopback peer)"
    return None


def loopback(sock: socket.socket) -> bool:
    """Whether the connection's peer is on this host's loopback (where /dev/shm is shared)."""
    try:
        host = sock.getpeername()[0]
    except OSError:
        return False
    return auth.is_loopback(host.removeprefix("::ffff:"))  # an IPv4 peer of a dual-stack socket
