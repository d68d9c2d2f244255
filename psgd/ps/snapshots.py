"""A shard's pulls and the buffers they lend (the `Lending` part of `psgd.ps.shard.Shard`).

- `pull(worker_id, shard, clock, dtype, timeout)`: the values a `Pulled` carries are lent to every
  pull of that version (read-only: never write into them), and taken back once no `with` block
  holds them: send them inside. fp32 pulls are lent the parameter tensor itself, and an update that
  finds it still lent moves the parameters to a fresh buffer first (copy on write: `_snapshot`,
  `_unshare_params`); other wire dtypes get one converted copy per version.
- A pull waiting for its worker's admission (a scheduled joiner's first) is held for half of
  `timeout` at most, then refused DEADLINE_EXCEEDED ("ask again"), so that a join any time away
  outlasts the deadline as a long poll.
- `home(region, sent)` / `leave_home(region)`: a one-worker shard keeps its parameters in memory
  a transport gives (the worker's segment, where a reply would copy them), and moves them back out
  before that memory goes; a region it lent is never pooled.
- `receive_buffer()`: a reused fp32 buffer of the shard's length to read a push into; `scratch()`:
  the one buffer of a remedy's corrected gradient.
- Scratch buffers (received gradients, pull snapshots) come from per-dtype pools, reused across
  requests: `queue.SimpleQueue`s, thread-safe on their own. Everything else here runs under the
  shard's one lock (`self.lock`, the policy's condition) where its docstring says so.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from psgd.core import codec
from psgd.core.consistency import PolicyError, PullTimeout, PushOutcome
from psgd.core.errors import Code, ShardError


@dataclass(frozen=True)
class Pulled:
    version: int
    done: bool
    wait_s: float                # time the policy held the pull
    clock_gap: int
    values: torch.Tensor | None  # the parameters in the wire dtype (a pool buffer); None when done


@dataclass
class _Slot:
    """One receive buffer lent out (`receive_buffer`): `back` is what returns to the pool after,
    the buffer itself unless the policy kept it and gave back another (or none)."""
    tensor: torch.Tensor
    back: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.back = self.tensor


@dataclass
class _Snapshot:
    """The parameters of one version in one wire dtype, lent to `lent` pulls at the moment."""
    version: int
    values: torch.Tensor
    lent: int
    live: bool = False  # `values` was the parameter tensor when lent (fp32): see `Shard._snapshot`


class Lending:
    """The Shard's pulls, snapshots and buffer pools (the attributes are made by `Shard.__init__`)."""

    @contextlib.contextmanager
    def receive_buffer(self) -> Iterator[torch.Tensor]:
        """An fp32 buffer of the shard's length to receive one push into, back to the pool after
        (or, when the policy kept it as sync's sum, the buffer the policy gave back in its place)."""
        buf = self._borrow(torch.float32)
        with self.lock:
            self._lent += 1
        slot = _Slot(buf)
        self._receiving[id(buf)] = slot  # `push` takes the entry out when it hands `buf` on
        try:
            yield buf
        finally:
            if self._receiving.get(id(buf)) is slot:  # no push took it (a refused or failed one)
                del self._receiving[id(buf)]
            if slot.back is not None:  # the policy has applied, summed or kept it by now
                self._pools[torch.float32].put(slot.back)
            with self.lock:  # back in the pool: a push waiting for its turn may take it (`turn`)
                self._lent -= 1
                self.lock.notify_all()

    @contextlib.contextmanager
    def pull(self, worker_id: int, shard: int, clock: int, dtype: str, timeout: float | None) -> Iterator[Pulled]:
        """Wait for the policy, then a snapshot of the parameters in `dtype` (see the module docstring)."""
        if shard != self.index:
            raise ShardError(Code.INVALID_ARGUMENT, f"pull for shard {shard} sent to shard {self.index}")
        # Waiting for the first Init is part of the start, like the start barrier's hold: it is
        # reported in wait_s with it, so that no worker counts the others' start-up as its pull.
        started = time.perf_counter()
        if not self.ready.wait(timeout):
            raise ShardError(Code.DEADLINE_EXCEEDED, f"shard {self.index} was never initialised")
        held_for_init = time.perf_counter() - started
        lent: list[_Snapshot] = []

        def read() -> torch.Tensor:  # the policy holds the lock here
            snap = self._snapshot(codec.WIRE_DTYPES[dtype])
            lent.append(snap)
            self.bytes_out += snap.values.numel() * snap.values.element_size()
            for remedy in self.remedies:
                remedy.pulled(self, worker_id, snap)
            return snap.values

        # A scheduled joiner's first pull waits for its admission, which may be any time away: it is
        # held for half the deadline at most, then answered DEADLINE_EXCEEDED before the worker's
        # own deadline fires, so that the worker asks again (a long poll: PSClient.wait_admitted).
        try:
            try:
                out = self.policy.pull(worker_id, clock, read, timeout, None if timeout is None else timeout / 2)
            except PullTimeout as e:
                raise ShardError(Code.DEADLINE_EXCEEDED, str(e)) from None
            except PolicyError as e:
                raise ShardError(Code.INVALID_ARGUMENT, str(e)) from None
            yield Pulled(out.version, out.done, out.wait_s + held_for_init, out.clock_gap, out.value)
        finally:
            if lent:
                self._give_back(lent[0])

    @contextlib.contextmanager
    def next_pull(self, pushed: PushOutcome, worker_id: int, shard: int, clock: int, dtype: str,
                  timeout: float | None) -> Iterator[Pulled]:
        """The second half of PushPull: after `pushed` (this worker's push of `clock`), the pull of
        clock + 1, or at once a done Pulled when that push said the budget is spent."""
        if pushed.done:
            yield Pulled(pushed.version, True, 0.0, 0, None)
            return
        with self.pull(worker_id, shard, clock + 1, dtype, timeout) as pulled:
            yield pulled

    def _snapshot(self, dtype: torch.dtype) -> _Snapshot:
        """The current version's parameters in `dtype`, made once per version and lent to every
        pull of it (lock held): in sync the N workers pull the same version.

        fp32 pulls are lent the parameter tensor itself ("live"), no copy; an update that finds it
        still lent first moves the parameters to a fresh buffer (`_apply`, copy on write) and
        leaves the lent one as it was. In sync that never happens (a worker pushes only after its
        whole pull has arrived, so the step's last push finds nothing lent); in async it happens
        only when an update overlaps another worker's pull: either way fewer copies than one per
        version (docs/architecture.md has what each took off a sync step). Other wire dtypes get a
        converted copy."""
        cur = self._current.get(dtype)
        if cur is not None and cur.version == self.policy.version:
            cur.lent += 1
            return cur
        if dtype == self.param.dtype:
            snap = _Snapshot(self.policy.version, self.param.detach(), lent=1, live=True)
        else:
            snap = _Snapshot(self.policy.version, self._borrow(dtype), lent=1)
            snap.values.copy_(self.param.detach())
        self._current[dtype] = snap
        if cur is not None and cur.lent == 0:  # superseded and unsent: reuse its memory
            self._recycle(cur)
        return snap

    def _give_back(self, snap: _Snapshot) -> None:
        """A pull has sent `snap`: once no pull holds it and a newer version replaced it, its
        buffer goes back to the pool (the current one stays, for the next pull of its version)."""
        with self.lock:
            self.release(snap)

    def release(self, snap: _Snapshot) -> None:
        """One holder of `snap` is done with it (lock held); see `_give_back`."""
        snap.lent -= 1
        if snap.lent == 0 and self._current.get(snap.values.dtype) is not snap:
            self._recycle(snap)

    def _recycle(self, snap: _Snapshot) -> None:
        """A snapshot nobody holds any more: its buffer to the pool, unless it is the parameters or
        memory a transport gave them (`home`: not the shard's to reuse)."""
        ptr = snap.values.data_ptr()
        if not (snap.live and (ptr == self.param.data_ptr() or ptr in self._homes)):
            self._pools[snap.values.dtype].put(snap.values)

    # -- a transport's memory as the parameters' home ----------------------------------------------
    _homes: frozenset[int] = frozenset()  # where `home` ever kept the parameters (data pointers)

    def home(self, region: torch.Tensor, sent: torch.Tensor) -> bool:
        """Keep the parameters in `region` from now on, which holds them already (a reply of `sent`,
        the parameters themselves, was just written there): with one worker, the only reader, a reply
        then copies nothing (psgd/ps/shm/serve.py: the worker's lent parameters' region of its
        segment). Whether they moved; the lock is taken here."""
        with self.lock:
            if (self.workers != 1 or self.param is None or sent.data_ptr() != self.param.data_ptr()
                    or region.numel() != self.param.numel() or region.data_ptr() == self.param.data_ptr()
                    or not torch.equal(region, self.param)):  # once a connection: that they are there
                return False
            self._homes = self._homes | {region.data_ptr()}
            self.param = self.opt.param = region
            return True

    def leave_home(self, region: torch.Tensor) -> None:
        """`region` is going away (its connection closed, or a bigger segment replaced it): parameters
        kept there move to a buffer of the shard's own first."""
        with self.lock:
            if self.param is not None and self.param.data_ptr() == region.data_ptr():
                fresh = self._borrow(self.param.dtype)
                fresh.copy_(self.param.detach())
                self.param = self.opt.param = fresh

    def _unshare_params(self) -> None:
        """Before an update (lock held): if a pull still holds the parameters themselves, move them
        to a fresh buffer, so that the update does not change what that pull is sending."""
        cur = self._current.get(self.param.dtype)
        if cur is not None and cur.live and cur.lent > 0 and cur.values.data_ptr() == self.param.data_ptr():
            fresh = self._borrow(self.param.dtype)
            fresh.copy_(self.param.detach())
            self.param = self.opt.param = fresh
            self.copies_on_write += 1

    def _borrow(self, dtype: torch.dtype) -> torch.Tensor:
        try:
            return self._pools[dtype].get_nowait()
        except queue.Empty:
            self.allocated[dtype] = self.allocated.get(dtype, 0) + 1
            return torch.empty(self.num_elements, dtype=dtype)

    def scratch(self) -> torch.Tensor:
        """A remedy's corrected gradient's buffer: one per shard, used under the lock and consumed
        there (async applies at once; the step reads it before the next push can take the lock)."""
        if self._corrected is None:
            self._corrected = torch.empty(self.num_elements)
        return self._corrected
