"""An emulated network link: each worker's and shard's traffic paced as if it crossed a slower wire.

EMULATED, not measured: everything still moves over loopback at loopback speed; the worker's
client and the shard's server then sleep so that each transfer takes what it would on the
given link (`psgd run --link`, PS modes). Sleeping is the
emulation itself here, never synchronisation.

Contract:
- `parse("1gbit,200us")` -> `Link(bits_per_s=1e9, latency_s=200e-6)`. Bandwidth in bit / kbit /
  mbit / gbit per second (decimal, as `tc` and NIC datasheets write them), optional one-way
  latency in ns / us / ms / s: "10gbit", "100mbit,1ms", "1gbit,200us". "" means no emulation.
  "unlimited,200us" paces the latency alone (bandwidth infinite): on a `psgd cluster` whose kernel
  lacks netem the kernel shapes the bandwidth and psgd adds the latency (psgd/cluster/).
- The alpha-beta (Hockney) model of one message of n bytes: `link.transfer_s(n)` =
  latency + 8n / bandwidth. psgd/core/costmodel.py uses the same two numbers.
- `Pacer(link)` paces one direction of a process's link (full duplex: one pacer for sends, one
  for receives). A worker's is shared by its K shard streams, a shard's by its N workers'
  pushes (or pulls), which split the bandwidth as they would on one NIC; the worker alone adds
  the latency: `start()` once per message (a push or pull stream: the latency, paid by each
  stream in parallel), `pace(n)` per chunk (bandwidth: a virtual wire that is busy until
  `free_at`, see `schedule`). A message takes max(loopback time, latency + 8n / bandwidth).
  Each RPC is two messages (request, reply), as on a real network. Thread-safe.

    psgd run --mode sync --workers 4 --servers 2 --model wide_mlp --link 1gbit,200us
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    bits_per_s: float    # bandwidth of the emulated wire, one direction
    latency_s: float     # one-way latency added once per message (alpha of the alpha-beta model)

    @property
    def seconds_per_byte(self) -> float:
        """beta of the alpha-beta model."""
        return 8.0 / self.bits_per_s

    def transfer_s(self, nbytes: int) -> float:
        """Time of one n-byte message on this link: alpha + n * beta (Hockney 1994)."""
        return self.latency_s + nbytes * self.seconds_per_byte


def parse(text: str) -> Link | None:
    """"1gbit,200us" -> Link; "" -> None. Raises ValueError with the accepted forms."""
    text = text.strip().lower()
    if not text:
        return None
    usage = f"--link expects BANDWIDTH[,LATENCY] like 1gbit,200us or 100mbit,1ms or 10gbit, got {text!r}"
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 2:
        raise ValueError(usage)
    m = re.fullmatch(_NUMBER + r"\s*(" + "|".join(_RATE) + r")(?:/s|ps)?", parts[0])
    if parts[0] == "unlimited":
        bits = math.inf
    elif not m or float(m.group(1)) <= 0:
        raise ValueError(usage)
    else:
        bits = float(m.group(1)) * _RATE[m.group(2)]
    latency = 0.0
    if len(parts) == 2:
        m = re.fullmatch(_NUMBER + r"\s*(" + "|".join(_TIME) + r")", parts[1])
        if not m:
            raise ValueError(usage)
        latency = float(m.group(1)) * _TIME[m.group(2)]
    return Link(bits_per_s=bits, latency_s=latency)


def schedule(free_at: float, now: float, nbytes: int, link: Link) -> tuple[float, float]:
    """One chunk of a message on the virtual wire: returns (new free_at, seconds to sleep now).

    Within a message chunks go back to back: this one ends 8n / bandwidth after the previous
    one, and the sender waits until then. When loopback itself was slower than the emulated
    link, the wire is already past its end and nobody waits: a message takes the longer of the
    real and the emulated time, never their sum. (`Pacer.start` moves an idle wire to now, so
    idle time between messages is not banked: no bursts above the link rate.)
    """
    end = free_at + nbytes * link.seconds_per_byte
    return end, max(0.0, end - now)


class Pacer:
    """Paces one direction of one worker's link (see the module docstring). Thread-safe."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._lock = threading.Lock()  # guards _free_at and the totals, shared by the K shard streams
        self._free_at = 0.0
        self.wire_s = 0.0   # emulated time put on the wire: latencies + bytes x beta (accounting)
        self.slept_s = 0.0  # time actually slept to match it (less when loopback was slower)

    def start(self, latency: bool = True) -> None:
        """A new message: an idle wire starts now; its first byte arrives one latency later
        (latency=False: the other end of the message pays it)."""
        wait = self.link.latency_s if latency else 0.0
        with self._lock:
            self._free_at = max(self._free_at, time.monotonic())
            self.wire_s += wait
            self.slept_s += wait
        if wait > 0:
            time.sleep(wait)  # streams wait out their latencies in parallel

    def pace(self, nbytes: int) -> None:
        with self._lock:
            self._free_at, delay = schedule(self._free_at, time.monotonic(), nbytes, self.link)
            self.wire_s += nbytes * self.link.seconds_per_byte
            self.slept_s += delay
        if delay > 0:
            time.sleep(delay)


def paced(chunks: Iterable[T], pacer: Pacer | None, size: Callable[[T], int] = len) -> Iterator[T]:
    """Yield `chunks` as they would cross the pacer's link: one message, each chunk paced before
    it is passed on. Without a pacer (no --link) the chunks pass through untouched. The latency
    is the other end's (`start(latency=False)`): a shard's NIC adds bandwidth only."""
    if pacer is None:
        yield from chunks
        return
    pacer.start(latency=False)
    for chunk in chunks:
        pacer.pace(size(chunk))
        yield chunk
