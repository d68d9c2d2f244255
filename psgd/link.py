"""An emulated network link: a worker's traffic paced as if it crossed a slower wire.

EMULATED, not measured: everything still moves over loopback at loopback speed; the worker's
client then sleeps so that each transfer takes what it would on the given link. Sleeping is the
emulation itself here, never synchronisation.

Contract:
- `parse("1gbit,200us")` -> `Link(bits_per_s=1e9, latency_s=200e-6)`. Bandwidth in bit / kbit /
  mbit / gbit per second (decimal, as `tc` and NIC datasheets write them), optional one-way
  latency in ns / us / ms / s: "10gbit", "100mbit,1ms", "1gbit,200us". "" means no emulation.
- The alpha-beta (Hockney) model of one message of n bytes: `link.transfer_s(n)` =
  latency + 8n / bandwidth. psgd/costmodel.py uses the same two numbers.
- `Pacer(link)` paces one direction of a worker's link (full duplex: one pacer for sends, one
  for receives), shared by its K shard streams, which split the bandwidth as they would on
  one NIC: `start()` once per message (a push or pull stream: the latency, paid by each
  stream in parallel), `pace(n)` per chunk (bandwidth: a virtual wire that is busy until
  `free_at`, see `schedule`). Thread-safe.

    psgd run --mode sync --workers 4 --servers 2 --model wide_mlp --link 1gbit,200us
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


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
    if not m or float(m.group(1)) <= 0:
        raise ValueError(usage)
    bits = float(m.group(1)) * _RATE[m.group(2)]
    latency = 0.0
    if len(parts) == 2:
        m = re.fullmatch(_NUMBER + r"\s*(" + "|".join(_TIME) + r")", parts[1])
        if not m:
            raise ValueError(usage)
        latency = float(m.group(1)) * _TIME[m.group(2)]
    return Link(bits_per_s=bits, latency_s=latency)


def schedule(free_at: float, now: float, nbytes: int, link: Link) -> tuple[float, float]:
    """One chunk on a shared virtual wire: returns (new free_at, seconds to sleep now).

    The wire sends one chunk after another: this chunk starts when the wire is free (or now,
    if it is idle) and ends 8n / bandwidth later; the sender waits until then. Idle time is
    not banked, so there are no bursts above the link rate.
    """
    end = max(free_at, now) + nbytes * link.seconds_per_byte
    return end, max(0.0, end - now)


class Pacer:
    """Paces one direction of one worker's link (see the module docstring). Thread-safe."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._lock = threading.Lock()  # guards _free_at, shared by the K shard streams
        self._free_at = 0.0
        self.slept_s = 0.0  # total emulated delay, for reports

    def start(self) -> None:
        """A new message: its first byte arrives one latency later (streams wait in parallel)."""
        if self.link.latency_s > 0:
            with self._lock:
                self.slept_s += self.link.latency_s
            time.sleep(self.link.latency_s)

    def pace(self, nbytes: int) -> None:
        with self._lock:
            self._free_at, delay = schedule(self._free_at, time.monotonic(), nbytes, self.link)
            self.slept_s += delay
        if delay > 0:
            time.sleep(delay)
