"""The raw-TCP data plane's wire format (`--transport tcp`), both ends.

One frame per message in both directions, little-endian:

    op: u8 | header length: u32 | payload length: u64 | header | payload

    PUSH  TensorHeader + the gradient's bytes in the wire dtype  ->  PUSHED  PushReply
          (sparse, header.sparse_count > 0: the int32 indices, then the values)
    PULL  PullRequest                                            ->  PULLED  PullHeader + the values' bytes
    PUSHPULL  as PUSH                                            ->  PULLED  of the next clock, PullHeader.pushed set
    HELLO  the token (auth.py), the first frame of a connection   ->  WELCOME (empty)
    ops 5..127: a transport's upgrade of the connection (its `upgrades`, psgd/ps/transport.py): after
          its WELCOME the connection's frames move the way that transport says (`Frames`, below)
    any request                                                  ->  ERROR   "STATUS_NAME: message" (UTF-8)

The headers are the .proto's own messages. Copies: a payload goes from the tensor's memory to
the socket (`sendmsg` of a memoryview) and from the socket straight into the destination tensor
(`recv_into`): the kernel's copy is the only one, besides fp16 / bf16 widening. `on_chunk(n)`
callbacks (the emulated link's pacing, --overlap's progress) see the payload in CHUNK pieces.

`Frames(sock, rpc_timeout)` is a shard's connection as psgd/ps/tcp_server.py reads and answers it:
its frames and payloads on the socket. A transport that upgrades a connection (an op of its own)
hands the server a subclass that moves them elsewhere (shared memory: psgd/ps/shm/serve.py).
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections.abc import Callable

import torch

from psgd.core import codec

PREFIX = struct.Struct("<BIQ")  # op, header length, payload length
PUSH, PULL, PUSHPULL, HELLO, PUSHED, PULLED, WELCOME, ERROR = 1, 2, 3, 4, 0x81, 0x82, 0x84, 0xFF
MAX_HEADER = 1 << 16            # our headers are < 100 bytes; anything bigger is not a psgd peer
CHUNK = codec.CHUNK_BYTES       # the unit of pacing (--link) and of progress (--overlap)


class FrameError(Exception):
    """A frame that cannot come from a psgd peer; the connection is closed."""


def send_frame(sock: socket.socket, op: int, header: bytes, payload: memoryview | None = None,
               on_chunk: Callable[[int], None] | None = None, length: int | None = None) -> None:
    """One frame. Without `on_chunk`, prefix + header + payload leave in one `sendmsg` call (one
    syscall for a small message, no copy of a large one); with it, the payload goes out in CHUNK
    pieces, `on_chunk(bytes)` called before each (the emulated link paces there). `length`
    without a payload: a payload of that many bytes that is in shared memory, not on the socket."""
    payload = payload if payload is not None else memoryview(b"")
    head = PREFIX.pack(op, len(header), len(payload) if length is None else length) + header
    if on_chunk is None:
        _sendmsg_all(sock, [head, payload])
        return
    sock.sendall(head)
    for start in range(0, len(payload), CHUNK):
        piece = payload[start:start + CHUNK]
        on_chunk(len(piece))
        sock.sendall(piece)


def _sendmsg_all(sock: socket.socket, parts: list) -> None:
    if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg: the record layer copies anyway
        for part in parts:
            sock.sendall(part)
        return
    sent = sock.sendmsg(parts)
    for part in parts:  # a large payload may leave in several calls: send what is left
        if sent >= len(part):
            sent -= len(part)
            continue
        sock.sendall(memoryview(part)[sent:])
        sent = 0


def await_readable(sock: socket.socket, seconds: float) -> None:
    """Spin up to `seconds` polling `sock` for input without sleeping; the caller's blocking read
    follows either way (spin, then block).

    Why: a process that sleeps in a read is woken by the kernel when its peer writes, and that
    wake-up, twice per round trip, costs as much as the whole push of a small model (a raw socket
    ping-pong, measured in docs/architecture.md). Only
    for peers on this host whose processes fit its cores (psgd/ps/shm/): a spinning process must
    not take a core from one that computes."""
    if seconds <= 0:
        return
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    end = time.perf_counter() + seconds
    while not poller.poll(0) and time.perf_counter() < end:
        pass


def _by(sock: socket.socket, deadline: float | None) -> None:
    """Give the next read what is left of `deadline` (time.monotonic()); TimeoutError once none is."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the frame did not arrive by its deadline")
    sock.settimeout(left)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket; ConnectionError when the peer closes first. With `deadline`
    (time.monotonic()) the whole of `view` must arrive by then, however the reads are spaced."""
    got = 0
    while got < len(view):
        _by(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed in the middle of a frame")
        got += n


def recv_head(sock: socket.socket, started: Callable[[], None] | None = None,
              deadline: float | None = None) -> tuple[int, bytes, int] | None:
    """(op, header bytes, payload length) of the next frame; None when the peer closed cleanly.
    `started()` is called once the frame's first bytes arrived (a server tightens its read
    deadline there: waiting for a frame may take long, a frame once begun may not). With
    `deadline` (time.monotonic()) the whole head must arrive by then: a peer trickling a byte at a
    time gets no more time than a silent one."""
    prefix = bytearray(PREFIX.size)
    _by(sock, deadline)
    n = sock.recv_into(prefix)
    if n == 0:
        return None
    if started is not None:
        started()
    recv_exact(sock, memoryview(prefix)[n:], deadline)
    op, header_len, payload_len = PREFIX.unpack(prefix)
    if header_len > MAX_HEADER:
        raise FrameError(f"frame header of {header_len} bytes (at most {MAX_HEADER}): not a psgd peer")
    header = bytearray(header_len)
    recv_exact(sock, memoryview(header), deadline)
    return op, bytes(header), payload_len


def recv_tensor(sock: socket.socket, out: torch.Tensor, dtype: str,
                on_chunk: Callable[[int, int], None] | None = None) -> int:
    """Receive `out.numel()` elements in the wire dtype into the fp32 tensor `out`; returns bytes.

    fp32 lands straight in `out`'s memory; fp16 / bf16 pass through a 1 MiB scratch and are
    widened into place (exactly, as torch's cast). `on_chunk(bytes, elements so far)` after
    each CHUNK (the emulated link paces there, --overlap follows the progress).
    """
    width = codec.itemsize(dtype)
    nbytes = out.numel() * width
    if width == 4:
        dest = memoryview(out.numpy()).cast("B")
        step = CHUNK if on_chunk else max(nbytes, 1)
        for start in range(0, nbytes, step):
            stop = min(start + step, nbytes)
            recv_exact(sock, dest[start:stop])
            if on_chunk:
                on_chunk(stop - start, stop // 4)
        return nbytes
    scratch = torch.empty(CHUNK // width, dtype=codec.WIRE_DTYPES[dtype])
    raw = memoryview(scratch.view(torch.int16).numpy()).cast("B")
    for start in range(0, nbytes, CHUNK):
        stop = min(start + CHUNK, nbytes)
        recv_exact(sock, raw[:stop - start])
        out[start // width:stop // width].copy_(scratch[:(stop - start) // width])
        if on_chunk:
            on_chunk(stop - start, stop // width)
    return nbytes


def recv_bytes(sock: socket.socket, nbytes: int, on_chunk: Callable[[int], None] | None = None) -> bytearray:
    """Receive an `nbytes` payload as it is (a sparse push's indices and values); `on_chunk(bytes)`
    after each CHUNK, as `recv_tensor`'s."""
    out = bytearray(nbytes)
    view = memoryview(out)
    for start in range(0, nbytes, CHUNK):
        stop = min(start + CHUNK, nbytes)
        recv_exact(sock, view[start:stop])
        if on_chunk:
            on_chunk(stop - start)
    return out


def drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop `nbytes` (a refused push's payload), so that the connection stays usable."""
    scratch = memoryview(bytearray(min(nbytes, CHUNK)))
    while nbytes:
        step = min(nbytes, len(scratch))
        recv_exact(sock, scratch[:step])
        nbytes -= step


class Frames:
    """A shard's side of one data-plane connection: how its frames come in and its payloads move.

    `next_head(deadline)`: the next frame's (op, header, payload length), None at EOF; with a
    `deadline` (time.monotonic(): a connection's first frame) the whole head must arrive by then,
    without one a frame once begun must progress within `rpc_timeout` (between frames a worker may
    compute); `send`:
    one frame; `send_values`: a reply with fp32 values in a wire dtype; `in_place`: a push's dense
    gradient where it lies (None here: it is still in the socket); `recv_tensor` / `recv_bytes`:
    a payload into a buffer / as bytes; `drain`: drop a refused payload; `consumed`: the shard reads
    the last payload no more; `check(payload_len)`: FrameError for a payload this connection cannot
    carry; `close`: what the connection holds (not the socket: its server closes that)."""

    def __init__(self, sock: socket.socket, rpc_timeout: float) -> None:
        self.sock, self.rpc_timeout = sock, rpc_timeout

    def next_head(self, deadline: float | None) -> tuple[int, bytes, int] | None:
        sock = self.sock
        if deadline is not None:
            head = recv_head(sock, deadline=deadline)
            sock.settimeout(self.rpc_timeout)  # its payload, if any, reads as any frame's
            return head
        sock.settimeout(None)
        return recv_head(sock, lambda: sock.settimeout(self.rpc_timeout))

    def send(self, op: int, header: bytes, payload: memoryview | None = None, on_chunk=None) -> None:
        send_frame(self.sock, op, header, payload, on_chunk)

    def send_values(self, op: int, header: bytes, values: torch.Tensor | None, dtype: str, pace=None) -> None:
        self.send(op, header, None if values is None else codec.encode(values, dtype), pace)  # encode: a view

    def in_place(self, count: int, dtype: str, payload_len: int, pace=None) -> torch.Tensor | None:
        return None

    def recv_tensor(self, out: torch.Tensor, dtype: str, pace=None) -> None:
        recv_tensor(self.sock, out, dtype, pace and (lambda n, _: pace(n)))

    def recv_bytes(self, nbytes: int, pace=None) -> bytearray:
        return recv_bytes(self.sock, nbytes, pace)

    def drain(self, nbytes: int) -> None:
        drain(self.sock, nbytes)

    def consumed(self) -> None:
        pass

    def check(self, payload_len: int) -> None:
        pass

    def close(self) -> None:
        pass
