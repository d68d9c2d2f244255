"""A /dev/shm segment that a worker and a shard both map (`--transport shm`, psgd/ps/shm/).

`Segment.create(nbytes)` (the worker's side) makes one private to this user; `Segment.attach(name,
max_bytes)` (the shard's, through psgd/ps/shm/serve.py `serve_attach`) maps the one a worker named,
within bounds: a psgd name (`psgd-PID-HEX`, nothing else under /dev/shm), at most the largest payload
any request to this shard can carry rounded to a page (serve.py unlinks its name once it takes it).
`sweep()` (which `create` runs first) removes the files of makers that no longer run. A belled
segment (psgd/ps/shm/bell.py) has one more page at its end, its doorbell's. `spin_for` says whether
a run's processes fit this host's cores, so that a waiting side may spin instead of sleeping.
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
from psgd.ps.shm import bell

ROOT = "/dev/shm"
# Spin-then-block (psgd/ps/shm/bell.py, or framing.py `await_readable` without a doorbell): how long each
# side of a shm connection polls before it sleeps, when the run's processes fit this host's cores
# (`spin_for`: then the spinning core is its own). The worker waits for a reply (the shard's update),
# the shard for the next push (the worker's step); a spin long enough to cover both for the models
# psgd ships (docs/architecture.md has the measured waits), and longer waits end in a blocking read.
REPLY_SPIN_S = 0.02
PUSH_SPIN_S = 0.02
NAME = re.compile(r"psgd-\d+-[0-9a-f]{16}")
PAGE = mmap.PAGESIZE


class Segment:
    """One mapped file of /dev/shm: `u8`, its bytes as a numpy array, and `t`, the same as a tensor.
    `size`: the bytes a payload may take. A belled segment's last page is its doorbell's
    (psgd/ps/shm/bell.py: `page`, and `bell` once a connection rings it), after those bytes."""

    def __init__(self, name: str, fd: int, size: int, belled: bool = False) -> None:
        self.name, self.size = name, size - (bell.PAGE_BYTES if belled else 0)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.page = self.u8[self.size:] if belled else None
        self.bell: bell.Bell | None = None
        self.reply_at = 0  # where a reply's payload goes (BELL's "name@AT"; 0: where the request's was)
        self.t = torch.from_numpy(self.u8)
        # The segment as each wire dtype, made once: a slice and a view per request cost ~5 us more.
        self.views = {name: self.t.view(dt) for name, dt in codec.WIRE_DTYPES.items()}
        self._regions: dict[tuple, torch.Tensor] = {}  # `region`'s views

    @classmethod
    def create(cls, nbytes: int, belled: bool = False) -> Segment:
        """A new segment for payloads of at least `nbytes` (a worker's), private to this user (mode 0600)."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE) + (bell.PAGE_BYTES if belled else 0)
        sweep()
        name = f"psgd-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(os.path.join(ROOT, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(os.path.join(ROOT, name))
            raise
        return cls(name, fd, size, belled)

    @classmethod
    def attach(cls, name: str, max_bytes: int, belled: bool = False) -> Segment:
        """Map the segment a worker named (a shard's side); ValueError says why it will not."""
        if not NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a psgd segment name")
        try:
            fd = os.open(os.path.join(ROOT, name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise ValueError(f"cannot open {ROOT}/{name}: {e.strerror} (is the shard on another host?)") from None
        size, page = os.fstat(fd).st_size, bell.PAGE_BYTES if belled else 0
        if not page < size <= max_bytes + PAGE + page:
            os.close(fd)
            raise ValueError(f"a segment of {size} bytes; this shard's largest payload is {max_bytes}")
        return cls(name, fd, size, belled)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(ROOT, self.name))

    def put(self, payload) -> None:
        """Copy `payload` (bytes-like) to the segment's start."""
        src = np.frombuffer(payload, dtype=np.uint8)
        self.u8[:len(src)] = src

    def region(self, dtype: str, at: int, count: int) -> torch.Tensor:
        """`count` elements of wire dtype `dtype` from byte `at` (a multiple of its size)."""
        key = (dtype, at, count)
        view = self._regions.get(key)
        if view is None:  # made once: a tensor slice costs ~4 us, as much as a 78k-element step's copy
            i = at // codec.itemsize(dtype)
            view = self._regions[key] = self.views[dtype][i:i + count]
        return view

    def put_tensor(self, values: torch.Tensor, dtype: str, at: int = 0) -> int:
        """Write fp32 `values` at byte `at` in wire dtype `dtype` (narrowed as codec.encode does);
        returns bytes. Values that are that region already (a worker's buffers lent here,
        psgd/ps/shm/transport.py `lend`) are not copied. A segment too small for them (a worker that sized it
        wrong) is the request's error."""
        n = values.numel() * codec.itemsize(dtype)
        if at + n > self.size:
            raise ShardError(Code.INVALID_ARGUMENT, f"a reply of {n} bytes at {at} into a {self.size}-byte segment")
        dst = self.region(dtype, at, values.numel())
        if dst.data_ptr() != values.data_ptr():
            dst.copy_(values.reshape(-1))
        return n

    def get_tensor(self, out: torch.Tensor, dtype: str, at: int = 0) -> int:
        """Fill fp32 `out` from the `out.numel()` elements in wire dtype `dtype` at byte `at` (no copy
        when `out` is that region); returns bytes."""
        src = self.region(dtype, at, out.numel())
        if src.data_ptr() != out.data_ptr():
            out.view(-1).copy_(src)
        return out.numel() * codec.itemsize(dtype)

    def get_bytes(self, nbytes: int) -> bytearray:
        return bytearray(self.u8[:nbytes].tobytes())

    def ring(self, sock: socket.socket, worker: bool, spin_s: float) -> None:
        """From now on this connection's frames go through the doorbell (psgd/ps/shm/bell.py)."""
        self.bell = bell.Bell(self.page, sock, worker, spin_s)

    def close(self) -> None:
        # The views first: an mmap with views exported cannot close.
        self.u8 = self.t = self.views = self.page = self.bell = self._regions = None
        with contextlib.suppress(BufferError):
            self.mm.close()


def sweep() -> list[str]:
    """Remove the segments whose maker has exited (psgd-PID-... of a PID that no longer runs), this
    user's only; the names removed. Why: between `create` and the shard's `attach` the file has a
    name, and a worker killed in that moment (SIGKILL: no cleanup runs) leaves it in /dev/shm. Each
    new segment sweeps first, so such a file lives until the next shm worker on this host starts.
    Assumes the processes that share this /dev/shm share one pid namespace (a run's do)."""
    gone = []
    for n in os.listdir(ROOT):
        if NAME.fullmatch(n) and not os.path.exists(f"/proc/{n.split('-')[1]}"):  # its maker has exited
            with contextlib.suppress(OSError):  # another worker's sweep took it first, or not ours
                if os.stat(os.path.join(ROOT, n), follow_symlinks=False).st_uid == os.getuid():
                    os.unlink(os.path.join(ROOT, n))
                    gone.append(n)
    return gone


def spin_for(processes: int, seconds: float) -> float:
    """`seconds` when `processes` (a run's workers and shards, all on this host) fit the cores
    this process may use, else 0: never spin where a spinning process would take a core from one
    that computes."""
    return seconds if processes <= len(os.sched_getaffinity(0)) else 0.0
