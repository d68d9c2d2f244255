"""Which cluster host each process of a run goes on (`psgd run --hosts H`). Pure.

Parameter-server modes: shard k on host k, each on a host of its own, and the workers on the
other H - K hosts, worker r on host K + r mod (H - K). So every byte a worker pushes or pulls
crosses its own link and its shard's, and a shard's link carries the traffic of all N workers:
the shared bottleneck the seed articles blame on the central server (experiments E4, E10). With
H >= K + N every process has a host to itself; with fewer, workers share hosts (and links).
A worker never shares a shard's host: it would reach the shard inside one namespace, past every link.

All-reduce: worker r on host r mod H (no servers; in the ring each rank talks to its neighbours).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    servers: tuple[int, ...]   # host index of shard k
    workers: tuple[int, ...]   # host index of worker r

    def local(self, rank: int) -> tuple[int, int]:
        """(local rank, ranks on its host) of worker `rank`: what torchrun calls LOCAL_RANK and
        LOCAL_WORLD_SIZE (they pick a GPU per rank on its host)."""
        here = [r for r, h in enumerate(self.workers) if h == self.workers[rank]]
        return here.index(rank), len(here)


def place(mode: str, servers: int, workers: int, hosts: int) -> Placement:
    """The placement described in the module docstring; ValueError (one line) when H is too small."""
    if hosts < 1:
        raise ValueError(f"--hosts must be >= 1, got {hosts}")
    if mode == "allreduce":
        return Placement((), tuple(r % hosts for r in range(workers)))
    if hosts <= servers:
        raise ValueError(f"--hosts {hosts} is too few for {servers} shard(s): each shard takes a host of its own "
                         f"and the workers need at least one more (--hosts {servers + 1} or more)")
    rest = hosts - servers
    return Placement(tuple(range(servers)), tuple(servers + r % rest for r in range(workers)))
