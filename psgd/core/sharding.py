"""The flat parameter vector split into K contiguous, balanced ranges (ps-lite's key ranges).

Contract: `shard_ranges(n, k)` returns K half-open (start, stop) ranges that tile [0, n) in
order; lengths differ by at most one, the longer ones first. K may exceed n (some ranges are
then empty). Pure module.
"""

from __future__ import annotations


def shard_ranges(num_elements: int, num_shards: int) -> list[tuple[int, int]]:
    """Balanced contiguous ranges: the first num_elements % num_shards get one extra element."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_elements < 0:
        raise ValueError(f"num_elements must be >= 0, got {num_elements}")
    base, extra = divmod(num_elements, num_shards)
    ranges, start = [], 0
    for k in range(num_shards):
        stop = start + base + (1 if k < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
