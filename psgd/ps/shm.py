"""`--transport shm`: the TCP data plane's frames, with their payloads in shared memory.

Why: on one host a push's bytes need not cross the kernel's TCP stack at all. A 316 kB gradient
takes about 0.15 ms each way on loopback TCP (psgd bench transport: about 2 GB/s for a raw
socket), as long as a small MLP's whole step; a copy into memory both processes map is a memcpy.
BytePS moves tensors between the co-located processes of a machine the same way. What stays on
the socket is everything else: the frames' prefixes and headers, their order, the errors, and the
wake-ups (a blocking read is the cheapest way for one process to wait for another).

The contract, per data-plane connection (psgd/ps/framing.py's frames, one more op):

    ATTACH  the name of a file in /dev/shm the worker created  ->  WELCOME, or ERROR and nothing changes

After a WELCOME every frame on that connection carries its payload in the segment instead of on
the socket: the prefix still says how many bytes, and they are at the segment's start. A request's
payload is read in full before its reply is written, so one region serves both ways. The worker
sizes the segment for the larger of a request's payload and its expected reply, and attaches a
bigger one when a request needs more. It unlinks the file as soon as the shard mapped it: both
processes hold the memory, nothing is left in /dev/shm when either dies.

Bounds: a shard maps a segment only for a loopback peer that is not on TLS (shared memory would
bypass what TLS protects), named as a worker names one (`psgd-PID-HEX`, nothing else under
/dev/shm), and at most the largest payload any request to this shard can carry, rounded to a page.
A worker's --transport shm to a shard on another host is refused with one line.

`ShmTransport` is the worker's side (a `TcpTransport`, psgd/ps/tcp_transport.py, whose payload
moves it overrides); psgd/ps/tcp_server.py holds a `Segment` per connection for the shard's side.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import socket

import numpy as np
import torch

from psgd.core import codec
from psgd.core.errors import Code, ShardError
from psgd.ps import auth
from psgd.ps import framing as fr
from psgd.ps.tcp_transport import TcpTransport

ROOT = "/dev/shm"
# Spin-then-block (psgd/ps/framing.py `await_readable`): how long each side of a shm connection
# polls before it sleeps, when the run's processes fit this host's cores (`spin_for`). The worker
# waits for a reply (the shard's update: ~0.3 ms for a small model); the shard for the next push
# (the worker's step: 1.2 ms for the 256-wide MLP here); longer waits end in a blocking read.
REPLY_SPIN_S = 0.002
PUSH_SPIN_S = 0.003
NAME = re.compile(r"psgd-\d+-[0-9a-f]{16}")
PAGE = mmap.PAGESIZE


class Segment:
    """One mapped file of /dev/shm: `u8`, its bytes as a numpy array, and `t`, the same as a tensor."""

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name, self.size = name, size
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.t = torch.from_numpy(self.u8)
        # The segment as each wire dtype, made once: a slice and a view per request cost ~5 us more.
        self.views = {name: self.t.view(dt) for name, dt in codec.WIRE_DTYPES.items()}

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new segment of at least `nbytes` (a worker's), private to this user (mode 0600)."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        name = f"psgd-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(os.path.join(ROOT, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(os.path.join(ROOT, name))
            raise
        return cls(name, fd, size)

    @classmethod
    def attach(cls, name: str, max_bytes: int) -> Segment:
        """Map the segment a worker named (a shard's side); ValueError says why it will not."""
        if not NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a psgd segment name")
        try:
            fd = os.open(os.path.join(ROOT, name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise ValueError(f"cannot open {ROOT}/{name}: {e.strerror} (is the shard on another host?)") from None
        size = os.fstat(fd).st_size
        if not 0 < size <= max_bytes + PAGE:
            os.close(fd)
            raise ValueError(f"a segment of {size} bytes; this shard's largest payload is {max_bytes}")
        return cls(name, fd, size)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(ROOT, self.name))

    def put(self, payload) -> None:
        """Copy `payload` (bytes-like) to the segment's start."""
        src = np.frombuffer(payload, dtype=np.uint8)
        self.u8[:len(src)] = src

    def put_tensor(self, values: torch.Tensor, dtype: str) -> int:
        """Write fp32 `values` in wire dtype `dtype` (narrowed as codec.encode does); returns bytes.
        A segment too small for them (a worker that sized it wrong) is the request's error."""
        n = values.numel() * codec.itemsize(dtype)
        if n > self.size:
            raise ShardError(Code.INVALID_ARGUMENT, f"a reply of {n} bytes into a {self.size}-byte segment")
        self.views[dtype][:values.numel()].copy_(values.reshape(-1))
        return n

    def get_tensor(self, out: torch.Tensor, dtype: str) -> int:
        """Fill fp32 `out` from the segment's `out.numel()` elements in wire dtype `dtype`; returns bytes."""
        out.view(-1).copy_(self.views[dtype][:out.numel()])
        return out.numel() * codec.itemsize(dtype)

    def get_bytes(self, nbytes: int) -> bytearray:
        return bytearray(self.u8[:nbytes].tobytes())

    def close(self) -> None:
        self.u8 = self.t = self.views = None  # the views first: an mmap with views exported cannot close
        with contextlib.suppress(BufferError):
            self.mm.close()


def spin_for(processes: int, seconds: float) -> float:
    """`seconds` when `processes` (a run's workers and shards, all on this host) fit the cores
    this process may use, else 0: never spin where a spinning process would take a core from one
    that computes."""
    return seconds if processes <= len(os.sched_getaffinity(0)) else 0.0


def loopback(sock: socket.socket) -> bool:
    """Whether the connection's peer is on this host's loopback (where /dev/shm is shared)."""
    try:
        host = sock.getpeername()[0]
    except OSError:
        return False
    return auth.is_loopback(host.removeprefix("::ffff:"))  # an IPv4 peer of a dual-stack socket


class ShmTransport(TcpTransport):
    """`--transport shm`: TcpTransport's frames, each connection's payloads in a Segment of its own."""

    def __init__(self, addresses: list[str], timeout: float, token: bytes | None = None, tls_ca: str = "") -> None:
        if tls_ca:
            raise ValueError("--transport shm moves bytes through memory on this host: TLS (--tls-ca) has "
                             "nothing to protect there; use --transport tcp")
        super().__init__(addresses, timeout, token, tls_ca)
        self._segments: dict[socket.socket, Segment] = {}
        self._spin_s = 0.0  # set by `info`, once the shards said how many processes the run has

    def info(self, shards):
        infos = super().info(shards)
        if infos:
            self._spin_s = spin_for(infos[0].num_workers + infos[0].num_shards, REPLY_SPIN_S)
        return infos

    def _reply(self, sock, k: int, what: str, expected_op: int) -> tuple[bytes, int]:
        fr.await_readable(sock, self._spin_s)
        return super()._reply(sock, k, what, expected_op)

    def _send(self, sock, op: int, header: bytes, payload=None, on_chunk=None, reply_bytes: int = 0) -> None:
        size = 0 if payload is None else len(payload)
        seg = self._segment(sock, max(size, reply_bytes))
        if size:
            seg.put(payload)
            if on_chunk:
                on_chunk(size)
        fr.send_frame(sock, op, header, None, length=size)

    def _recv_tensor(self, sock, out: torch.Tensor, dtype: str, on_chunk=None) -> int:
        n = self._segments[sock].get_tensor(out, dtype)
        if on_chunk:
            on_chunk(n, out.numel())
        return n

    def _segment(self, sock: socket.socket, nbytes: int) -> Segment:
        """This connection's segment, attached (again, bigger) when it cannot hold `nbytes`."""
        seg = self._segments.get(sock)
        if seg is not None and seg.size >= nbytes:
            return seg
        new = Segment.create(nbytes)
        try:
            fr.send_frame(sock, fr.ATTACH, new.name.encode())
            head = fr.recv_head(sock)
        finally:
            new.unlink()  # mapped by the shard now, or refused: either way no file stays behind
        if head is None or head[0] != fr.WELCOME:
            new.close()
            why = "the connection closed" if head is None else head[1].decode(errors="replace")
            raise fr.FrameError(f"the shard did not map shared memory: {why}")
        with self._lock:
            old, self._segments[sock] = self._segments.get(sock), new
        if old is not None:
            old.close()
        return new

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            seg = self._segments.pop(sock, None)
        if seg is not None:
            seg.close()
        super()._discard(sock)


def serve_attach(sock: socket.socket, header: bytes, tls: bool, max_bytes: int) -> Segment:
    """A shard's side of ATTACH: the segment the header names, mapped; ValueError("STATUS: why") if not."""
    why = refused(sock, tls)
    if why is not None:
        raise ValueError(why)
    try:
        return Segment.attach(header.decode(errors="replace"), max_bytes)
    except ValueError as e:
        raise ValueError(f"FAILED_PRECONDITION: {e}") from None


def refused(sock: socket.socket, tls: bool) -> str | None:
    """Why a shard will not map a segment for this connection, or None."""
    if tls:
        return "FAILED_PRECONDITION: shared memory would bypass TLS: use --transport tcp"
    if not loopback(sock):
        return "FAILED_PRECONDITION: --transport shm needs the worker on the shard's host (a loopback peer)"
    return None

