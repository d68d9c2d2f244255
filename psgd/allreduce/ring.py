"""The hand-written ring all-reduce: the teaching version, written by hand on purpose.

Writing it by hand IS the lesson. The seed article's author "once hand-wrote an All-Reduce demo
and it was more than 10x slower than NCCL"; this file lets you repeat that experiment and see
where the time goes (`psgd bench allreduce --impl library,ring`). Training uses it with
`psgd run --mode allreduce --allreduce-impl ring`.

Contract: `ring_all_reduce(buf)` sums `buf` in place over every rank of the initialised
default process group and returns the bytes this rank sent and received. Every rank calls it
with a 1-D contiguous tensor of the same numel and dtype. Any numel works, also one that does
not divide by N or is smaller than N. Blocking; not thread-safe (one caller per group).

The algorithm (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; the ring Baidu brought to deep learning in 2017). N ranks sit on a ring: rank r
sends only to r+1 and receives only from r-1. The buffer is cut into N contiguous chunks.

  1. reduce-scatter, N-1 steps. At step s rank r sends chunk (r - s) mod N to the right and adds
     chunk (r - s - 1) mod N, received from the left, into its own copy. What it sends next is
     what it just added to, so each chunk travels once round the ring collecting one term per
     rank. After N-1 steps rank r holds the full sum of chunk (r + 1) mod N.
  2. all-gather, N-1 steps. At step s rank r sends chunk (r + 1 - s) mod N, already complete,
     and overwrites chunk (r - s) mod N with the one it receives. After N-1 steps every rank
     holds every complete chunk.

Traffic: each rank sends 2(N-1) chunks of size/N, i.e. 2(N-1)/N x size, and receives as much.
That is the lower bound for all-reduce (Patarasuk & Yuan), under 2 x size for any N: it does not
grow with N, unlike a single parameter server, which receives and sends N x size every step.
Latency: 2(N-1) rounds of messages, each paying the full per-message cost, so small buffers are
latency-bound (NCCL switches to trees for them).

Why the library is faster with the same algorithm and the same bytes: here Python drives each
of the 2(N-1) steps and each waits for its slowest link before the next begins; a chunk is sent
whole instead of pipelined in small slices; the addition runs after the receive instead of being
fused into it; and every message goes through the process group's generic point-to-point path.
NCCL and gloo do all of that in C++/CUDA with the reduction overlapped with the transfers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from psgd.core.sharding import shard_ranges


class Traffic(NamedTuple):
    """Bytes one rank sent and received in one all-reduce."""
    sent: int
    received: int


def reduce_scatter_step(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left and added) at reduce-scatter `step`."""
    return (rank - step) % n, (rank - step - 1) % n


def all_gather_step(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left and copied) at all-gather `step`."""
    return (rank + 1 - step) % n, (rank - step) % n


def ring_bytes(numel: int, n: int, itemsize: int) -> int:
    """The textbook 2(N-1)/N x size a rank sends per all-reduce (exact when N divides numel)."""
    return 2 * (n - 1) * numel * itemsize // n


def ring_all_reduce(buf: torch.Tensor) -> Traffic:
    """Sum `buf` in place across all ranks over a ring; returns this rank's Traffic."""
    assert buf.dim() == 1 and buf.is_contiguous(), "ring_all_reduce wants a flat contiguous tensor"
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1 or buf.numel() == 0:
        return Traffic(0, 0)
    right, left = (rank + 1) % n, (rank - 1) % n
    # Balanced chunks, the longer ones first: both ends of a link know every chunk's size, so a
    # chunk that is empty (numel < N) is skipped on both sides without any message.
    chunks = [buf[start:stop] for start, stop in shard_ranges(buf.numel(), n)]
    scratch = torch.empty_like(chunks[0])  # chunk 0 is a longest one
    sent = received = 0

    for step in range(n - 1):
        send, recv = reduce_scatter_step(rank, n, step)
        incoming = scratch[:chunks[recv].numel()]
        _exchange(chunks[send], incoming, right, left)
        chunks[recv].add_(incoming)  # after the receive, not fused with it: one reason NCCL wins
        sent, received = sent + _nbytes(chunks[send]), received + _nbytes(incoming)

    for step in range(n - 1):
        send, recv = all_gather_step(rank, n, step)
        _exchange(chunks[send], chunks[recv], right, left)  # receive straight into place
        sent, received = sent + _nbytes(chunks[send]), received + _nbytes(chunks[recv])

    return Traffic(sent, received)


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send to the right and receive from the left at the same time, and wait for both.

    Posting both before waiting on either is what keeps the ring from deadlocking (everybody
    sending first and receiving second would wait forever on a rendezvous protocol).
    `batch_isend_irecv` groups the two so NCCL can run them together too (ncclGroupStart/End);
    gloo simply posts them. Timeouts and dead peers surface as exceptions from `wait()`.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, right))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, left))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
