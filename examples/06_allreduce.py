"""06 - all-reduce: no server; the workers sum their gradients among themselves. The ring by hand vs torch.

What it shows: psgd's hand-written ring (psgd/allreduce/ring.py: reduce-scatter, then all-gather,
Patarasuk & Yuan 2009) computes what torch.distributed's `all_reduce` computes. N processes
(gloo over 127.0.0.1, a rendezvous file in a temp folder) each hold a vector of their own (seeded
by rank, so every rank can also rebuild the others' and compute the exact sum in float64). Each
sums them twice: with `ring_all_reduce` and with `dist.all_reduce`. Printed: the ring's traffic
(2(N-1)/N x the vector per rank, where a PS worker pushes 1x and pulls 1x), how far each result
is from the exact sum, whether every rank ends with bit-identical values, and the ring against
the library, first on random floats (float rounding: the two add in different orders), then on
whole numbers, where every partial sum is exact and the two must agree bit for bit.

    python examples/06_allreduce.py
    python examples/06_allreduce.py --workers 4

Training with either (the same loop as the PS modes; the replicas are hash-checked):
    psgd run --mode allreduce --workers 4 --model mlp --dataset mnist1d --steps 100
    psgd run --mode allreduce --allreduce-impl ring --workers 4 --model mlp --dataset mnist1d --steps 100
    psgd bench allreduce --size-mb 100 --workers 2,4 --impl library,ring      # their speed
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from psgd.allreduce.ring import ring_all_reduce

NUMEL = 100_003   # not a multiple of N: the ring's chunks are uneven, and that must not matter
TOLERANCE = 1e-5  # the sums are below ~10 in size, where float32's last bit is ~1e-6


def inputs(rank: int, whole: bool) -> torch.Tensor:
    """Rank `rank`'s vector: random floats, or whole numbers in [-1000, 1000] (exact in float32)."""
    g = torch.Generator().manual_seed(rank)
    if whole:
        return torch.randint(-1000, 1001, (NUMEL,), generator=g).float()
    return torch.randn(NUMEL, generator=g)


def same_on_every_rank(t: torch.Tensor) -> bool:
    """Gather every rank's copy and compare bit for bit."""
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t)
    return all(torch.equal(c, copies[0]) for c in copies)


def rank_main(rank: int, n: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    try:
        float_gap = 0.0
        for whole in (False, True):
            ring, library = inputs(rank, whole), inputs(rank, whole)
            traffic = ring_all_reduce(ring)                      # psgd's ring, in place
            dist.all_reduce(library, op=dist.ReduceOp.SUM)       # torch's (gloo's) all-reduce, in place
            exact = sum(inputs(r, whole).double() for r in range(n))
            ring_err = float((ring.double() - exact).abs().max())
            lib_err = float((library.double() - exact).abs().max())
            gap = float((ring - library).abs().max())
            float_gap = gap if not whole else float_gap
            ring_same, lib_same = same_on_every_rank(ring), same_on_every_rank(library)
            if rank == 0:
                kind = "whole numbers" if whole else "random floats"
                if not whole:
                    size = NUMEL * ring.element_size()
                    print(f"{n} processes, each with {NUMEL} float32s ({size} bytes); ring traffic of rank 0: "
                          f"sent {traffic.sent} = {traffic.sent / size:.2f} x, received {traffic.received} "
                          f"(2(N-1)/N = {2 * (n - 1) / n:.2f})")
                print(f"{kind:13s}: largest |ring - exact| {ring_err:.1e}, |library - exact| {lib_err:.1e}, "
                      f"|ring - library| {gap:.1e}; identical on every rank: ring {ring_same}, library {lib_same}")
            assert ring_same and lib_same, "an all-reduce leaves every rank with the same values"
            assert max(ring_err, lib_err, gap) < TOLERANCE, "both compute the sum, to float rounding"
            if whole:
                assert gap == 0.0, "with every partial sum exact, the order cannot matter: bit-equal"
        if rank == 0 and float_gap > 0.0:
            print("random floats differ in the last bits only because the ring and gloo add the N terms in "
                  "different orders; with whole numbers no sum rounds, and the two are bit-equal.")
        dist.barrier()  # every rank is done with the group before anyone tears it down
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3, help="processes N (2 or more)")
    args = ap.parse_args()
    if args.workers < 2:
        ap.error("--workers: an all-reduce needs at least 2 processes")
    # gloo picks a network interface for its connections: loopback, so nothing leaves this host.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        # A rendezvous file instead of a TCP store: a store resolves its peer's host name, which
        # may send DNS queries off the machine (docs/architecture.md, "All-reduce mode").
        rendezvous = f"file://{Path(tmp) / 'rendezvous'}"
        # fork: each rank starts as a copy of this process, torch already imported (about a second
        # per rank saved on a small machine). Safe here: nothing has run on a device or started a
        # thread pool yet; with CUDA, use "spawn".
        mp.start_processes(rank_main, args=(args.workers, rendezvous), nprocs=args.workers, join=True,
                           start_method="fork")


if __name__ == "__main__":
    main()
