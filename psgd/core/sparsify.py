"""Sparsified pushes with error feedback (`--topk FRACTION`): send the largest entries, keep the rest.

Top-k sparsification (Stich et al. 2018, "Sparsified SGD with memory"; Lin et al. 2018, "Deep
Gradient Compression") sends, of each shard's slice of the gradient, only the `count(n, fraction)`
entries largest in magnitude, as (index, value) pairs. With error feedback the worker keeps what it
did not send in a residual and adds it to its next gradient, so every coordinate's gradient mass
reaches the server eventually, only later; without it the rest is dropped.

Contract (pure: torch and numpy only, no transport):
- `count(n, fraction)`: entries sent of an n-element slice: fraction x n rounded to the nearest
  whole number, at least 1, at most n (fraction 1 sends every entry).
- `select(x, k)`: the indices of the k largest |x|, strictly increasing. Ties go to the lower
  index, so the choice is the same on every run and machine (torch.topk leaves the order of ties
  unspecified); a NaN counts as the largest, so the server sees it and refuses or skips it as it
  would a dense push's.
- `Sparsifier(ranges, fraction, error_feedback)`: the worker's side, for the K shard ranges of its
  flat gradient. `compress(k, grad_slice, dtype) -> Sparse`. With error feedback it holds the
  residual, one fp32 per parameter (4 bytes x the model's size of worker memory), and does
      acc = residual + grad;  sent = top-k of acc, rounded to the wire dtype;  residual = acc - sent
  where "rounded" is exactly what the server will decode, so the rounding of --wire-dtype fp16 /
  bf16 is fed back too. `sent + residual == acc` holds exactly, element by element, in every wire
  dtype: a value and its rounding to a coarser float are within a factor of 2 of each other, so
  their difference is exact (Sterbenz's lemma) and adding it back gives the value again. Only
  `acc = residual + grad` rounds (one fp32 addition per step, as any accumulation does).
  Concurrent `compress` calls for different shards are safe (their residual slices are disjoint);
  one shard's calls come from one thread at a time.
- Deep Gradient Compression's two fixes (Lin et al. 2018, ICLR, Sec. 3.2 and 3.4), given as a
  `TopK(fraction, error_feedback, momentum, warmup_epochs, pushes_per_epoch)` in place of the
  fraction:
  * momentum correction (`momentum` m > 0; needs error feedback): the worker keeps a velocity
    u = m u + grad and accumulates it, not the gradient, in the residual: acc = residual + u; the
    top-k of acc is sent and both acc (as above) and u are zeroed where sent (their "momentum
    factor masking": the sent coordinates' momentum is not applied a second time). The shards then
    step with plain SGD (momentum 0, psgd/train/assemble.py), so the update is the velocity, as
    momentum SGD's is, only sparse. One more fp32 per parameter on the worker.
  * warm-up (`warmup_epochs` E > 0): push `clock` of epoch e = clock // pushes_per_epoch (< E)
    sends the fraction max(fraction, 0.25^(e+1)) (25%, 6.25%, 1.5625%, ...: the paper's
    exponentially rising sparsity 75%, 93.75%, 98.4375%, ...), then `fraction`. `density(clock)`,
    `count_at(k, clock)`: what push `clock` sends, the same for the header and the payload,
    so a resumed worker sends what it would have.
  The paper's local gradient clipping is not done here (no clipping anywhere in psgd).
- `Sparse(indices, values, dtype)`: one shard's push: int32 indices (shard-local, strictly increasing)
  and values in the wire dtype. `nbytes` = count x (4 + the dtype's size), what crosses the wire;
  `payload()` the TCP data plane's layout (every index, then every value); `pieces()` the gRPC
  stream's SparseChunks (each about CHUNK_BYTES, its indices with their values).
- `Scatter(num_elements, count, dtype, out)`: the receiver. Zeroes `out` (the shard's pooled fp32
  receive buffer), then `add(indices, values)` per chunk checks it and writes its values in place;
  `finish()` checks that `count` entries came and returns `out`, a dense gradient, so every
  consistency policy and the optimizer work unchanged. Anything malformed raises ValueError (the
  shard answers INVALID_ARGUMENT; `out` is scratch, so no state has changed): a chunk whose index
  and value counts differ, indices not strictly increasing (across chunks too: no duplicates, so
  the scatter is well defined and count <= n), an index outside [0, n), more or fewer entries than
  announced.

Why int32 indices, not int64: they are offsets inside one shard's slice, and a slice of 2^31 fp32
elements is 8 GiB, more than any one shard here holds (`Sparsifier` asserts it); 4 bytes per index
make an fp32 entry 8 bytes instead of 12 (fp16: 6 instead of 10), so 1% of the gradient costs 2% of
the dense bytes, not 3%. Pulls stay dense: the parameters are not sparse.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from psgd.core import codec

INDEX_BYTES = 4                  # int32, little-endian
MAX_SLICE = 2**31 - 1            # the largest shard slice int32 offsets can address


def count(n: int, fraction: float) -> int:
    """Entries a push of an n-element slice sends: round(fraction x n), within [1, n]."""
    assert 0 < fraction <= 1, f"fraction must be in (0, 1], got {fraction}"
    return min(n, max(1, math.floor(fraction * n + 0.5)))


def wire_bytes(entries: int, dtype: str) -> int:
    """Bytes of a sparse payload: an int32 index and a wire-dtype value per entry."""
    return entries * (INDEX_BYTES + codec.itemsize(dtype))


def select(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, strictly increasing) of the k entries of a 1-D tensor largest in magnitude;
    ties broken toward the lower index.

    numpy's introselect finds the k-th largest magnitude in O(n), several times faster than
    torch.topk (docs/architecture.md, "Sparsified pushes"); one more pass takes everything above it
    and the first of the entries equal to it, in index order, with no sort.
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n)
    magnitude = x.detach().abs().nan_to_num_(nan=math.inf).numpy()
    threshold = np.partition(magnitude, n - k)[n - k]
    chosen = magnitude > threshold                                  # fewer than k
    short = k - int(np.count_nonzero(chosen))
    chosen[np.flatnonzero(magnitude == threshold)[:short]] = True
    return torch.from_numpy(np.flatnonzero(chosen))


@dataclass(frozen=True)
class Sparse:
    """One shard's sparse push: `indices` int32 (shard-local, increasing), `values` in wire dtype `dtype`."""
    indices: torch.Tensor
    values: torch.Tensor
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * INDEX_BYTES + self.values.numel() * self.values.element_size()

    def _views(self) -> tuple[memoryview, memoryview]:
        return memoryview(self.indices.numpy()).cast("B"), codec.encode(self.values, self.dtype)

    def payload(self) -> bytes:
        """The TCP data plane's payload: every index, then every value."""
        return b"".join(self._views())

    def pieces(self, chunk_bytes: int = codec.CHUNK_BYTES) -> Iterator[tuple[memoryview, memoryview]]:
        """(indices, values) of consecutive entries, about chunk_bytes each: a gRPC SparseChunk apiece."""
        indices, values = self._views()
        width = self.values.element_size()
        per = max(1, chunk_bytes // (INDEX_BYTES + width))
        for start in range(0, self.indices.numel(), per):
            stop = min(start + per, self.indices.numel())
            yield indices[start * INDEX_BYTES:stop * INDEX_BYTES], values[start * width:stop * width]


WARMUP_BASE = 0.25               # Deep Gradient Compression's warm-up: density 0.25^(e+1) in epoch e


@dataclass(frozen=True)
class TopK:
    """What a worker's pushes send: `fraction` of each slice, and Deep Gradient Compression's
    momentum correction (`momentum` > 0) and warm-up (`warmup_epochs` of `pushes_per_epoch`)."""
    fraction: float
    error_feedback: bool = True
    momentum: float = 0.0
    warmup_epochs: float = 0.0
    pushes_per_epoch: float = 1.0

    def __post_init__(self) -> None:
        assert 0 < self.fraction <= 1, f"fraction must be in (0, 1], got {self.fraction}"
        assert 0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"
        assert not self.momentum or self.error_feedback, "momentum correction accumulates in the residual"
        assert self.warmup_epochs >= 0 and self.pushes_per_epoch > 0

    def density(self, clock: int) -> float:
        """The fraction push `clock` sends: max(fraction, 0.25^(e+1)) in warm-up epoch e, then fraction."""
        epoch = int(clock // self.pushes_per_epoch)
        if epoch < self.warmup_epochs:
            return min(1.0, max(self.fraction, WARMUP_BASE ** (epoch + 1)))
        return self.fraction


class Sparsifier:
    """A worker's top-k compression of its pushes, with or without error feedback (module docstring)."""

    def __init__(self, ranges: Sequence[tuple[int, int]], fraction: float | TopK, error_feedback: bool = True) -> None:
        self.ranges = list(ranges)
        self.spec = fraction if isinstance(fraction, TopK) else TopK(fraction, error_feedback)
        self.fraction, self.error_feedback = self.spec.fraction, self.spec.error_feedback
        assert all(b - a <= MAX_SLICE for a, b in self.ranges), "a shard slice too long for int32 indices"
        self.counts = [count(b - a, self.fraction) for a, b in self.ranges]   # after any warm-up
        self.sent = [self.count_at(k, 0) for k in range(len(self.ranges))]     # of each shard's last push
        size = self.ranges[-1][1] if self.ranges else 0
        # What has not been sent yet, per parameter; none without error feedback.
        self.residual = torch.zeros(size) if self.error_feedback else None
        # Momentum correction: the worker's velocity (the shards step without momentum).
        self.velocity = torch.zeros(size) if self.spec.momentum else None

    def count_at(self, k: int, clock: int) -> int:
        """Entries of shard k's push `clock` (warm-up sends more in its first epochs)."""
        a, b = self.ranges[k]
        return count(b - a, self.spec.density(clock))

    def nbytes(self, k: int, dtype: str) -> int:
        """Bytes of shard k's last push (before any, its first)."""
        return wire_bytes(self.sent[k], dtype)

    def compress(self, k: int, grad: torch.Tensor, dtype: str, clock: int = 0) -> Sparse:
        """Shard k's push `clock` of `grad` (its slice of the flat gradient); updates the residual
        (and the velocity)."""
        start, stop = self.ranges[k]
        assert grad.numel() == stop - start, f"shard {k}'s slice has {stop - start} elements, got {grad.numel()}"
        grad = grad.detach().to("cpu", torch.float32)
        if self.velocity is not None:
            u = self.velocity[start:stop]
            grad = u.mul_(self.spec.momentum).add_(grad)  # u = m u + g, in place: what is accumulated
        if self.residual is None:
            acc = grad
        else:
            acc = self.residual[start:stop]
            acc += grad                                   # the accumulated gradient (or velocity), in place
        self.sent[k] = self.count_at(k, clock)
        idx = select(acc, self.sent[k])
        values = acc[idx].to(codec.WIRE_DTYPES[dtype])
        if self.residual is not None:
            acc[idx] -= values.to(torch.float32)         # exactly what the server decodes leaves the residual
        if self.velocity is not None:
            u[idx] = 0.0                                  # momentum factor masking
        return Sparse(idx.to(torch.int32), values, dtype)


class Scatter:
    """Receives one sparse push into a dense fp32 buffer, checking every chunk (module docstring)."""

    def __init__(self, num_elements: int, entries: int, dtype: str, out: torch.Tensor) -> None:
        if not 0 < entries <= num_elements:
            raise ValueError(f"a sparse push of {entries} entries for {num_elements} elements")
        assert out.dtype == torch.float32 and out.numel() == num_elements and out.is_contiguous()
        self.num_elements, self.entries, self.dtype = num_elements, entries, dtype
        self.width = codec.itemsize(dtype)
        self.out = out.zero_()
        self.received = 0
        self.last = -1                                  # the last index written (across chunks)

    def add(self, indices: bytes | memoryview, values: bytes | memoryview) -> None:
        if len(indices) % INDEX_BYTES or len(values) != len(indices) // INDEX_BYTES * self.width:
            raise ValueError(f"sparse chunk with {len(indices)} bytes of int32 indices and {len(values)} bytes of "
                             f"{self.dtype} values: the counts differ")
        m = len(indices) // INDEX_BYTES
        if self.received + m > self.entries:
            raise ValueError(f"sparse push has more than the {self.entries} entries its header announced")
        if m == 0:
            return
        idx = np.frombuffer(indices, "<i4").astype(np.int64)
        if (np.diff(idx) <= 0).any():
            raise ValueError("sparse push indices must be strictly increasing")
        if idx[0] < 0 or idx[-1] >= self.num_elements:
            bad = idx[0] if idx[0] < 0 else idx[-1]
            raise ValueError(f"sparse push index {bad} out of range for {self.num_elements} elements")
        if idx[0] <= self.last:
            raise ValueError("sparse push indices must be strictly increasing (across chunks too)")
        self.out[torch.from_numpy(idx)] = codec.decode(values, self.dtype)
        self.received += m
        self.last = int(idx[-1])

    def finish(self) -> torch.Tensor:
        if self.received != self.entries:
            raise ValueError(f"sparse push has {self.received} of the {self.entries} entries its header announced")
        return self.out
