"""`--transport shm`: the TCP data plane's frames, with their payloads (and on x86-64 the frames
themselves) in shared memory.

Why: on one host a push's bytes need not cross the kernel's TCP stack at all. A 316 kB gradient
takes about 0.15 ms each way on loopback TCP (psgd bench transport: about 2 GB/s for a raw
socket), as long as a small MLP's whole step; a copy into memory both processes map is a memcpy.
BytePS moves tensors between the co-located processes of a machine the same way.

The contract, per data-plane connection (psgd/ps/framing.py's frames, two more ops):

    ATTACH  the name of a file in /dev/shm the worker created  ->  WELCOME, or ERROR and nothing changes
    BELL    the same, optionally "NAME@AT"                     ->  as ATTACH; then the doorbell

After a WELCOME every frame on that connection carries its payload in the segment instead of on
the socket: the prefix still says how many bytes, and they are at the segment's start (a reply's at
byte AT when BELL named one). A request's payload is read in full before its reply is written, so
one region can serve both ways. The worker sizes the segment for the larger of a request's payload
and its expected reply, and attaches a bigger one when a request needs more. It unlinks the file as
soon as the shard mapped it: both processes hold the memory, nothing is left in /dev/shm when either
dies. After BELL's WELCOME the frames' prefixes and headers go through the segment's last page too
(psgd/ps/bell.py, x86-64 only): the socket is left to wake a peer that sleeps and to say EOF. The
segment's mapping and its bounds are psgd/ps/segment.py's.

The worker's side, `ShmTransport` (a `TcpTransport`, psgd/ps/tcp_transport.py, whose payload moves
it overrides), has two fast paths for the common case of one worker step, PushPull (dense, unpaced):
- `push_pull_direct`: the gradient's slices go from the tensor into each segment (narrowed to the
  wire dtype there), the replies' values straight into the parameters, on connections it keeps
  (one lane per shard), without the generic path's per-call objects;
- `home`: with one shard and fp32, the worker's flat parameters and gradients (models.FlatParams)
  move into its lane's segment, gradients at its start and parameters at AT, where the shard
  writes its replies: a PushPull then copies nothing on the worker's side, as the floor arm of
  `psgd bench roundtrip` does (psgd/bench/floor.py). The worker then zeroes its gradient before
  the next backward, not while the shard reads it.
The shard's side is psgd/ps/tcp_server.py, with segment.py's `SegmentFrames`.
"""

from __future__ import annotations

import socket
import time

import torch

from psgd.core import codec
from psgd.ps import bell, wire
from psgd.ps import framing as fr
from psgd.ps.segment import (  # noqa: F401 - the
    PUSH_SPIN_S,
    REPLY_SPIN_S,
    ROOT,
    Segment,
    refused,
    serve_attach,
    spin_for,  # shm API, one import
)
from psgd.ps.tcp_transport import TcpTransport
from psgd.ps.transfer import Events


class ShmTransport(TcpTransport):
    """`--transport shm`: TcpTransport's frames, each connection's payloads in a Segment of its own."""

    def __init__(self, addresses: list[str], timeout: float, token: bytes | None = None, tls_ca: str = "") -> None:
        if tls_ca:
            raise ValueError("--transport shm moves bytes through memory on this host: TLS (--tls-ca) has "
                             "nothing to protect there; use --transport tcp")
        super().__init__(addresses, timeout, token, tls_ca)
        self._segments: dict[socket.socket, Segment] = {}
        self._spin_s = 0.0  # set by `info`, once the shards said how many processes the run has
        self._lanes: dict[int, socket.socket] = {}  # `push_pull_direct`'s connections, shard -> socket
        self._replied_at = 0.0
        self._on_consumed = None  # `push_pull_direct`'s, while it awaits the reply
        self._mark = Events(replied=self._replied)

    def info(self, shards):
        infos = super().info(shards)
        if infos:
            self._spin_s = spin_for(infos[0].num_workers + infos[0].num_shards, REPLY_SPIN_S)
        return infos

    def _recv_head(self, sock):
        seg = self._segments.get(sock)
        if seg is not None and seg.bell is not None:
            return seg.bell.recv_head(self.timeout, self._on_consumed)
        fr.await_readable(sock, self._spin_s)
        return fr.recv_head(sock)

    def _send(self, sock, op: int, header: bytes, payload=None, on_chunk=None, reply_bytes: int = 0) -> None:
        size = 0 if payload is None else len(payload)
        seg = self._segment(sock, max(size, reply_bytes))
        if size:
            seg.put(payload)
            if on_chunk:
                on_chunk(size)
        if seg.bell is not None:
            seg.bell.send(op, header, size)
        else:
            fr.send_frame(sock, op, header, None, length=size)

    def _recv_tensor(self, sock, out: torch.Tensor, dtype: str, on_chunk=None) -> int:
        seg = self._segments[sock]
        n = seg.get_tensor(out, dtype, seg.reply_at)
        if on_chunk:
            on_chunk(n, out.numel())
        return n

    def push_pull_direct(self, shards, headers, grads, outs, on_sent=None, on_consumed=None) -> tuple[list, float]:
        """PushPull with the tensors themselves (dense, unpaced: PSClient's fast path), each shard on a
        connection of its own that this transport keeps (a lane). Each gradient slice goes into its
        segment in the wire dtype (narrowed as codec.encode does), each reply's values straight into
        `outs[k]`; `on_sent()` once every request is out; with one shard, `on_consumed()` once the
        shard says it reads the gradient no more, if that comes before its reply (a homed worker
        zeroes its gradient there: `home`). Returns `push_pull`'s replies and the perf_counter at
        which the last reply's header came in. A failure closes the lane."""
        what = "push-pull with"
        k = shards[0]
        try:
            socks = []
            for k in shards:
                socks.append(self._lanes.get(k) or self._lane(k, what))
                self._guarded(k, what, lambda sock, k: self._send_direct(sock, headers[k], grads[k], outs[k]),
                              socks[-1])
            if on_sent is not None:
                on_sent()
            self._on_consumed = on_consumed if len(shards) == 1 else None
            return [self._guarded(k, what, lambda sock, k: self._receive_pulled(sock, k, what, headers[k].dtype,
                                                                                outs[k], self._mark), sock)
                    for k, sock in zip(shards, socks, strict=True)], self._replied_at
        except BaseException:
            self._drop_lane(k)
            raise
        finally:
            self._on_consumed = None

    def _lane(self, k: int, what: str) -> socket.socket:
        sock = self._lanes[k] = self._checkout(k, what)
        return sock

    def _drop_lane(self, k: int) -> None:
        sock = self._lanes.pop(k, None)
        if sock is not None:
            self._checkin(k, sock, ok=False)

    def _send_direct(self, sock, header, grad: torch.Tensor, out: torch.Tensor) -> None:
        dtype = wire.DTYPE_NAMES[header.dtype]
        seg = self._segment(sock, max(grad.numel(), out.numel()) * codec.itemsize(dtype))
        n = seg.put_tensor(grad, dtype)
        if seg.bell is not None:
            return seg.bell.send(fr.PUSHPULL, header.SerializeToString(), n)
        fr.send_frame(sock, fr.PUSHPULL, header.SerializeToString(), None, length=n)

    def _replied(self, k: int, header) -> None:
        self._replied_at = time.perf_counter()

    def home(self, flat) -> bool:
        """Move a one-shard worker's flat parameters and gradients (models.FlatParams) into its lane's
        segment, gradients at its start and parameters after them, where the shard writes its replies:
        then a PushPull copies nothing on the worker's side (the shard reads the gradient where
        backward wrote it and writes the parameters where forward reads them). False, nothing
        moved, with several shards (one flat buffer cannot lie in several segments) or no doorbell."""
        if len(self.addresses) != 1 or not bell.available():
            return False
        n = flat.params.numel()
        at = -(-4 * n // 64) * 64
        seg = self._segment(self._lanes.get(0) or self._lane(0, "home with"), at + 4 * n, reply_at=at)
        flat.rehome(seg.region("fp32", at, n), seg.region("fp32", 0, n))
        return True

    def _segment(self, sock: socket.socket, nbytes: int, reply_at: int = 0) -> Segment:
        """This connection's segment, attached (again, bigger) when it cannot hold `nbytes`; a reply's
        payload at byte `reply_at` of a new one (`home`)."""
        seg = self._segments.get(sock)
        if seg is not None and seg.size >= nbytes:
            return seg
        belled = bell.available()
        new = Segment.create(nbytes, belled)
        new.reply_at = reply_at if belled else 0
        try:  # asked on the connection as it is now: on its socket, or in the old segment's doorbell
            op, name = fr.BELL if belled else fr.ATTACH, new.name.encode()
            if new.reply_at:
                name += b"@%d" % new.reply_at
            if seg is not None and seg.bell is not None:
                seg.bell.send(op, name, 0)
            else:
                fr.send_frame(sock, op, name)
            head = self._recv_head(sock)
        finally:
            new.unlink()  # mapped by the shard now, or refused: either way no file stays behind
        if head is None or head[0] != fr.WELCOME:
            new.close()
            why = "the connection closed" if head is None else head[1].decode(errors="replace")
            raise fr.FrameError(f"the shard did not map shared memory: {why}")
        if belled:
            new.ring(sock, worker=True, spin_s=self._spin_s)
        with self._lock:
            old, self._segments[sock] = self._segments.get(sock), new
        if old is not None:
            old.close()
        return new

    def close(self) -> None:
        for k in list(self._lanes):
            self._drop_lane(k)
        super().close()

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            seg = self._segments.pop(sock, None)
        if seg is not None:
            seg.close()
        super()._discard(sock)
