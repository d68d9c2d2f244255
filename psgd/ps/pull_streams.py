"""`PullStreams`: a pull in flight (`PSClient.start_pull`, psgd/ps/client.py), and `PullResult`.

K streams, one per shard on the client's background pool, fill `out` in place; the caller waits
on what it needs next: every shard's header (`wait_headers`: the policies released the pull), a
range of `out` (`wait_range`: --overlap's forward hooks wait there, layer by layer), or the whole
`result()`. Thread-safe: `cond` guards the headers, the elements of each shard written so far and
the first error, and the stream threads notify it on every chunk. Every wait has the client's
deadline; a failure raises the stream's `ExchangeError` (or one that names the deadline).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from psgd.core.errors import ExchangeError
from psgd.ps.transfer import Events


@dataclass
class PullResult:
    done: bool
    versions: list[int]
    wait_s: float        # longest time a policy held this pull (max over shards)
    clock_gap: int
    bytes: int



class _Client(Protocol):
    """What a PullStreams uses of the PSClient that started it (psgd/ps/client.py)."""
    ranges: list[tuple[int, int]]
    timeout: float
    background: ThreadPoolExecutor

    def _pull(self, shards: list[int], clock: int, out: torch.Tensor, events: Events | None = None) -> list: ...
    def pull_result(self, results: list) -> PullResult: ...


class PullStreams:
    """A pull in flight (`PSClient.start_pull`): K streams fill `out` in the background.

    Thread-safe: `cond` guards `headers`, `filled` (elements of each shard written so far) and
    `error`; the stream threads notify it on every chunk.
    """

    def __init__(self, client: _Client, clock: int, out: torch.Tensor) -> None:
        self.client = client
        self.cond = threading.Condition()
        k = len(client.ranges)
        self.headers: list = [None] * k
        self.filled = [0] * k
        self.error: BaseException | None = None
        events = Events(replied=self._on_header, received=self._on_progress)
        self.futures = [client.background.submit(self._run, i, clock, out, events) for i in range(k)]

    def _run(self, k: int, clock: int, out: torch.Tensor, events: Events):
        try:
            return self.client._pull([k], clock, out, events)[0]
        except BaseException as e:
            with self.cond:
                self.error = e
                self.cond.notify_all()
            raise

    def _on_header(self, k: int, header) -> None:
        with self.cond:
            self.headers[k] = header
            self.cond.notify_all()

    def _on_progress(self, k: int, nbytes: int, elements: int) -> None:
        with self.cond:
            self.filled[k] = elements
            self.cond.notify_all()

    def _wait(self, ready) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or ready(), self.client.timeout)
            if self.error is not None:
                raise self.error
            if not ready():
                raise ExchangeError(f"pull still incomplete after the {self.client.timeout:.0f}s deadline")

    def wait_headers(self) -> list:
        """Block until every shard's header arrived (the policy released the pull)."""
        self._wait(lambda: all(h is not None for h in self.headers))
        return list(self.headers)

    def wait_range(self, start: int, stop: int) -> None:
        """Block until out[start:stop] holds the pulled values (or a shard said done)."""
        need = []
        for k, (a, b) in enumerate(self.client.ranges):
            if a < stop and start < b:
                need.append((k, min(stop, b) - a))
        self._wait(lambda: all(self.filled[k] >= n or (self.headers[k] is not None and self.headers[k].done)
                               for k, n in need))

    def result(self) -> PullResult:
        return self.client.pull_result([f.result() for f in self.futures])
