"""The virtual clock: a discrete-event loop, and the queues time is spent in.

`Clock.at(t, fn, *args)` schedules `fn(*args)` at virtual time t; `run()` calls them in order of
(t, the order they were scheduled), so two events at the same instant always run in the same
order: the same inputs give the same event order, bit for bit (what makes a simulated async run
reproducible). Nothing here reads this machine's clock.

`Queue` is one resource that serves one thing at a time (a NIC, a shard's CPU): `take(t, d)`
starts when both the request has come (t) and the resource is free, and returns when it ends.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Clock:
    """A heap of events on a virtual time line (seconds from the run's start)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0  # events run so far

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        assert t >= self.now, f"an event at {t} is in the past (now {self.now})"
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> None:
        """Run events until none is left (the caller checks that everyone finished)."""
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn(*args)


class Queue:
    """One thing at a time: a NIC's direction or a shard's CPU."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0  # time spent serving (utilisation = busy_s / the run's time)

    def take(self, t: float, duration: float) -> float:
        """Serve a request that came at `t` for `duration`; returns when it ends."""
        start = max(t, self.free_at)
        self.free_at = start + duration
        self.busy_s += duration
        return self.free_at


def take_both(t: float, duration: float, a: Queue, b: Queue) -> float:
    """A transfer that needs both ends at once (the sender's NIC and the receiver's): it starts when
    both are free and holds both until it ends."""
    start = max(t, a.free_at, b.free_at)
    a.free_at = b.free_at = start + duration
    a.busy_s += duration
    b.busy_s += duration
    return start + duration
