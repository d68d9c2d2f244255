"""`ShmTransport`, the worker's side of `--transport shm` (psgd/ps/shm/, whose docstring has the
contract): TcpTransport's frames (psgd/ps/tcp_transport.py), each connection's payloads, and on
x86-64 its frames too, in a Segment of its own (psgd/ps/shm/segment.py, bell.py).

It overrides the payload moves of TcpTransport and the `Wire` calls of psgd/ps/transfer.py:
- `push_pull_direct`: the gradient's slices go from the tensor into each segment (narrowed to the
  wire dtype there), the replies' values straight into the parameters, on connections it keeps
  (one lane per shard), without the generic path's per-call objects;
- `lend`: with one shard, a doorbell and fp32, the worker's flat parameters and gradients may live
  in its lane's segment, gradients at its start and parameters at AT, where the shard writes its
  replies: a PushPull then copies nothing on the worker's side, as the floor arm of `psgd bench
  roundtrip` does (psgd/bench/floor.py); the gradient is then free (`on_free`) once the shard says
  it read it (`consumed`), not once it is sent;
- `fits` / `rank`: `choose` takes it wherever every shard is on this host's loopback, /dev/shm is
  there and TLS is not asked for.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from psgd.core import codec
from psgd.ps import auth, wire
from psgd.ps import framing as fr
from psgd.ps.shm import bell
from psgd.ps.shm.bell import spin_now
from psgd.ps.shm.rows import UPGRADES as ROW_UPGRADES
from psgd.ps.shm.rows import connect as row_connect
from psgd.ps.shm.segment import REPLY_SPIN_S, ROOT, Segment, spin_for
from psgd.ps.shm.serve import ATTACH, BELL, UPGRADES
from psgd.ps.tcp_transport import TcpTransport
from psgd.ps.transfer import Events


class ShmTransport(TcpTransport):
    """`--transport shm`: TcpTransport's frames, each connection's payloads in a Segment of its own."""

    name, rank = "shm", 2  # `auto` takes it where it fits, before tcp
    shard_paced = False    # its shard side has no socket to pace: `auto` with --link takes tcp
    upgrades = UPGRADES    # the shard's side: the data-plane ops it adds (psgd/ps/shm/serve.py)
    row_upgrades = ROW_UPGRADES          # the row service's side (psgd/ps/shm/rows.py)
    row_client = staticmethod(row_connect)  # a worker's rows: their frames through a doorbell too

    @classmethod
    def fits(cls, addresses, tls: bool) -> bool:
        """Every shard on this host's loopback (where /dev/shm is shared), /dev/shm there, no TLS."""
        hosts = [a.rsplit(":", 1)[0].strip("[]") for a in addresses]
        return not tls and os.access(ROOT, os.W_OK) and all(auth.is_loopback(h) for h in hosts)

    def __init__(self, addresses: list[str], timeout: float, token: bytes | None = None, tls_ca: str = "") -> None:
        if tls_ca:
            raise ValueError("--transport shm moves bytes through memory on this host: TLS (--tls-ca) has "
                             "nothing to protect there; use --transport tcp")
        super().__init__(addresses, timeout, token, tls_ca)
        self._segments: dict[socket.socket, Segment] = {}
        self._spin_s = 0.0  # set by `info`, once the shards said how many processes the run has
        self._lanes: dict[int, socket.socket] = {}  # `push_pull_direct`'s connections, shard -> socket
        self._replied_at = 0.0
        self._on_consumed = None  # `push_pull_direct`'s on_free, while it awaits the reply of a lent gradient
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
        fr.await_readable(sock, spin_now(self._spin_s))
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

    def push_pull_direct(self, shards, headers, grads, outs, on_sent=None, on_free=None) -> tuple[list, float]:
        """PushPull with the tensors themselves (dense, unpaced: PSClient's fast path), each shard on a
        connection of its own that this transport keeps (a lane). Each gradient slice goes into its
        segment in the wire dtype (narrowed as codec.encode does), each reply's values straight into
        `outs[k]`; `on_free()` then `on_sent()` once every request is out, except for a gradient that
        lies in its segment already (`lend`): that one is free once the shard says it read it, if that
        comes before its reply (else never: the caller frees it). Returns `push_pull`'s replies and the
        perf_counter at which the last reply's header came in. A failure closes the lane."""
        what, k, socks, in_place = "push-pull with", shards[0], [], False
        try:
            for k in shards:
                socks.append(self._lanes.get(k) or self._lane(k, what))
                in_place = self._send_direct(socks[-1], headers[k], grads[k], outs[k])
            if on_free is not None and not in_place:
                on_free()
            if on_sent is not None:
                on_sent()
            self._on_consumed = on_free if in_place and len(shards) == 1 else None
            results = []
            for k, sock in zip(shards, socks, strict=True):
                # Where a worker waits for its shards (py-spy's stack mid-step): here, then the doorbell.
                seg = self._segments[sock]
                head = seg.bell.recv_head(self.timeout, self._on_consumed) if seg.bell else self._recv_head(sock)
                results.append(self._receive_pulled(sock, k, what, headers[k].dtype, outs[k], self._mark, head))
            return results, self._replied_at
        except (fr.FrameError, OSError) as e:
            self._drop_lane(k)
            raise self._failure(k, what, e) from None
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

    def _send_direct(self, sock, header, grad: torch.Tensor, out: torch.Tensor) -> bool:
        """One PushPull request of `grad`; whether `grad` is the segment's own memory (lent)."""
        dtype = wire.DTYPE_NAMES[header.dtype]
        seg = self._segment(sock, max(grad.numel(), out.numel()) * codec.itemsize(dtype))
        n = seg.put_tensor(grad, dtype)
        if seg.bell is not None:
            seg.bell.send(fr.PUSHPULL, header.SerializeToString(), n)
        else:
            fr.send_frame(sock, fr.PUSHPULL, header.SerializeToString(), None, length=n)
        return dtype == "fp32" and seg.region(dtype, 0, 1).data_ptr() == grad.data_ptr()

    def _replied(self, k: int, header) -> None:
        self._replied_at = time.perf_counter()

    def lend(self, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a one-shard worker may keep its flat parameters and gradients (`count` fp32 each):
        its lane's segment, gradients at its start and parameters after them, where the shard writes
        its replies (the shard then reads the gradient where backward wrote it and writes the
        parameters where forward reads them). None with several shards (one flat buffer cannot lie in
        several segments) or no doorbell."""
        if len(self.addresses) != 1 or not bell.available():
            return None
        at = -(-4 * count // 64) * 64
        seg = self._segment(self._lanes.get(0) or self._lane(0, "lend with"), at + 4 * count, reply_at=at)
        return seg.region("fp32", at, count), seg.region("fp32", 0, count)

    def _segment(self, sock: socket.socket, nbytes: int, reply_at: int = 0) -> Segment:
        """This connection's segment, attached (again, bigger) when it cannot hold `nbytes`; a reply's
        payload at byte `reply_at` of a new one (`lend`)."""
        seg = self._segments.get(sock)
        if seg is not None and seg.size >= nbytes:
            return seg
        belled = bell.available()
        new = Segment.create(nbytes, belled)
        new.reply_at = reply_at if belled else 0
        try:  # asked on the connection as it is now: on its socket, or in the old segment's doorbell
            op, name = BELL if belled else ATTACH, new.name.encode()
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
