"""`--transport shm`'s doorbell: a connection's frames in the segment's last page, not on its socket.

Why: with payloads in shared memory (psgd/ps/shm/) a small model's round trip is still two
loopback TCP messages, and each costs its sender a pass through the kernel's TCP stack and its
receiver a poll loop of syscalls: a large share of a small model's step (measured in
docs/architecture.md, "where the time went", by tools/roundtrip_phases.py). Here a frame's prefix and header
go in a mailbox in memory both processes map, and a counter says a new one is there: when the
reader is awake (spinning, psgd/ps/shm/ `spin_for`) no syscall is made at all. The socket stays,
for what only a socket does: waking a reader that went to sleep, and telling it the peer is gone
(EOF). `psgd bench roundtrip`'s floor-spin arm is this design's bound.

The page, at the end of the segment (so that payloads stay at its start, as on a plain shm
connection): two mailboxes of 2 KiB, one per direction (worker -> shard, shard -> worker). A
mailbox: int64 `seq` (frames written so far), `op`, `header length`, `payload length`, `done` (the
shard's mailbox only: the last request whose payload it reads no more, `consumed`); at byte 64
the reader's `asleep` flag (its own cache line: the reader writes it, the writer reads it); the
header's bytes from byte 128.

    writer: header, op, lengths; then seq += 1; fence; if asleep: one byte on the socket
    reader: spin until seq moves (up to its spin time); else asleep = 1; fence; while seq has not
            moved: wait for a byte on the socket (EOF: the peer is gone); asleep = 0

Ordering: the payload and the mailbox's fields are written before `seq`, and the reader reads `seq`
before them; x86's memory model (TSO) keeps stores in order and loads in order, so a reader that
sees the new `seq` sees the whole frame. That is why the doorbell is used on x86-64 only
(`available()`); elsewhere a shm connection keeps its frames on the socket. The two `fence`s are an
uncontended lock's acquire and release (a locked instruction, a full barrier on x86): without them
a writer's load of `asleep` could pass its store of `seq` while the reader's load of `seq` passed
its store of `asleep`, and both would miss (the classic store-buffer race). A sleeping reader also
looks at `seq` again every SLEEP_CHECK_S whatever happens, so no wake-up can be lost for longer.

A mailbox holds one frame: as on the socket, a connection carries one request at a time and its
reply before the next, so a writer never finds its last frame unread. A header longer than the
mailbox holds (an error's message) is cut to fit; psgd's request headers are far shorter.
"""

from __future__ import annotations

import os
import platform
import select
import socket
import threading
import time

import numpy as np

PAGE_BYTES = 4096
BOX_BYTES = PAGE_BYTES // 2
SEQ, OP, HLEN, PLEN, DONE, ASLEEP = 0, 1, 2, 3, 4, 8  # int64 indices in a mailbox (ASLEEP: byte 64)
HEADER_AT = 128
MAX_HEADER = BOX_BYTES - HEADER_AT
SLEEP_CHECK_S = 0.05  # a sleeping reader's longest wait between two looks at `seq`


def available() -> bool:
    """Whether this CPU keeps stores in order for another core to see (see the module docstring)."""
    return platform.machine().lower() in ("x86_64", "amd64")


_load = {"checked": -1.0, "runnable": 0.0, "crowded": False}


def runnable() -> int:
    """Tasks runnable on this host now (the kernel's count in /proc/loadavg), or 0 where it has none."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return 0


def spin_now(seconds: float) -> float:
    """`seconds` (a connection's `spin_for`), or 0 while this host is crowded: more tasks runnable
    than its cores + 1 (the run's own spinning worker and shard among them), averaged over the last
    few seconds (sampled twice a second, each sample half the average). The run fitting the cores is
    not enough where other work (a second run, a test suite) shares them: each spin then takes a core
    from a process that computes, and a round trip waits for the scheduler instead of a wake-up. The
    instant count, not the one-minute load average: a run that starts after other work has ended
    spins at once, not a minute later."""
    if seconds <= 0:
        return 0.0
    now = time.monotonic()
    if now - _load["checked"] >= 0.5:
        _load["checked"] = now
        _load["runnable"] = 0.5 * _load["runnable"] + 0.5 * runnable()
        _load["crowded"] = _load["runnable"] > len(os.sched_getaffinity(0)) + 1
    return 0.0 if _load["crowded"] else seconds



class Bell:
    """One end of a belled connection: `send` frames into one mailbox, `recv_head` them from the other.

    `page`: the segment's last PAGE_BYTES (a new file's: zeroed), a writable buffer both processes map; `worker`: which
    end this is (the worker writes the first mailbox and reads the second); `spin_s`: how long a
    read spins before it sleeps on `sock`."""

    def __init__(self, page, sock: socket.socket, worker: bool, spin_s: float) -> None:
        u8 = np.frombuffer(page, dtype=np.uint8, count=PAGE_BYTES)
        boxes = [u8[:BOX_BYTES], u8[BOX_BYTES:]]
        out, inn = boxes if worker else boxes[::-1]
        self._out, self._out_hdr = out.view(np.int64), out[HEADER_AT:]
        self._in, self._in_hdr = inn.view(np.int64), inn[HEADER_AT:]
        self.sock, self.spin_s = sock, spin_s
        # Counted from 0, not read from the page: the peer may ring before this end is made.
        self._sent = self._seen = 0
        self._fence_lock = threading.Lock()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def _fence(self) -> None:
        with self._fence_lock:
            pass

    def send(self, op: int, header: bytes, length: int) -> None:
        """One frame: `op`, `header`, and a payload of `length` bytes already in the segment."""
        n = min(len(header), MAX_HEADER)
        box = self._out
        if n:
            self._out_hdr[:n] = np.frombuffer(header, dtype=np.uint8, count=n)
        box[OP], box[HLEN], box[PLEN] = op, n, length
        self._sent += 1
        box[SEQ] = self._sent
        self._fence()
        if box[ASLEEP]:
            self.sock.send(b"\x01")

    def consumed(self) -> None:
        """The shard's word that it reads the last request's payload no more (before its reply: the
        worker may then reuse that memory, `recv_head`'s `on_consumed`)."""
        box = self._out
        box[DONE] = self._seen
        self._fence()
        if box[ASLEEP]:
            self.sock.send(b"\x02")

    def recv_head(self, timeout: float | None = None, on_consumed=None) -> tuple[int, bytes, int] | None:
        """(op, header, payload length) of the next frame; None when the peer closed the socket.
        TimeoutError after `timeout` s without one (None: wait as long as it takes). `on_consumed()`
        is called once if the peer says `consumed` of this end's last frame while it is awaited.
        Spins up to `spin_s`, then sleeps on the socket (one function: the stack a waiting worker shows)."""
        box = self._in
        spin_end = time.perf_counter() + spin_now(self.spin_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        asleep = False
        try:
            while box[SEQ] == self._seen:
                if on_consumed is not None and box[DONE] == self._sent:
                    on_consumed()
                    on_consumed = None
                    continue
                if not asleep:
                    if time.perf_counter() < spin_end:
                        continue
                    asleep = True  # say so, then look at `seq` once more before the first sleep
                    box[ASLEEP] = 1
                    self._fence()
                    continue
                wait = SLEEP_CHECK_S if deadline is None else min(SLEEP_CHECK_S, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError("no frame within the deadline")
                if self._poller.poll(wait * 1000) and not self.sock.recv(64) and box[SEQ] == self._seen:
                    return None  # EOF (a frame written before the close is still read)
        finally:
            if asleep:
                box[ASLEEP] = 0
        self._seen += 1
        n = min(max(int(box[HLEN]), 0), MAX_HEADER)  # the peer's word: never past the mailbox
        return int(box[OP]), self._in_hdr[:n].tobytes(), int(box[PLEN])
