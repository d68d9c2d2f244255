"""The simulated cluster's time model: how long a step's compute, a message and a shard's apply take.

Pure: no torch, no clock of this machine. Every figure a simulated run reports is SIMULATED, made
by this model from the numbers it holds; `describe()` states them, and summary.json carries that
statement as its `time_model`.

- Compute, worker w, step c: `compute_s / speed[w]` (`--sim-compute 120ms`, or per sample:
  `--sim-compute 40us/sample` times the worker's batch; measured on this machine when not given,
  psgd/sim/calibrate.py), plus the real run's straggler laws in milliseconds: `--straggler W=MS`
  and `--jitter MS` drawn from `jitter_draw` (exp or pareto, `--jitter-tail`) with worker w's own
  stream seeded `seed * 7919 + w`, as psgd/train/assemble.py seeds a real worker's. Each worker
  draws in its own step order, so a draw never depends on the others' interleaving.
- Spread (`--sim-spread CV`, a profile's `spread`): each step's device time is multiplied by a
  log-normal factor of mean 1 and coefficient of variation CV (sigma^2 = ln(1 + CV^2)), drawn from
  worker w's own spread stream (seeded `seed * 7919 + w + SPREAD_STREAM`, apart from its jitter
  stream, so a run without spread draws as before). 0: every step of a worker takes the same time.
  `psgd bench sim-vs-real` measures it from the real run's step lines (psgd/sim/calibrate.py `step_law`).
- Heterogeneous devices: `--sim-speeds 1,1,0.5` (a worker's speed, repeated over the ranks when
  shorter than N) or `lognormal:SIGMA` (speed e^X, X ~ N(0, SIGMA^2), seeded by the run's seed).
- The network: the alpha-beta (Hockney) model of psgd/core/link.py, from `--link BANDWIDTH,LATENCY`:
  a message of n bytes occupies the sender's and the receiver's NIC for 8n / bandwidth (each NIC
  is a queue: psgd/sim/network.py), then arrives one latency later, plus `message_s` of software
  per message. No --link: transfers take no time.
- A shard's CPU: each push costs `apply_s_per_byte` x its slice's fp32 bytes (the fold of sync's
  sum or the optimizer step), one push at a time per shard.
- A hardware profile (`--sim-profile FILE.toml`) holds any of: compute = "120ms" or
  "40us/sample", speeds = "1,1,0.5", link = "25gbit,5us", apply = "0.25ns" (per byte), message =
  "50us". A flag given on the command line wins over the profile, the profile over a measurement.
"""

from __future__ import annotations

import math
import random
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?(?:e-?\d+)?|\.\d+)"
PROFILE_KEYS = ("compute", "speeds", "spread", "link", "apply", "message")
SPREAD_STREAM = 1_000_003  # worker w's spread stream: seed * 7919 + w + this (its jitter stream has no offset)


def seconds(text: str, what: str = "a duration") -> float:
    """"120ms" -> 0.12 (units ns, us, ms, s); ValueError naming `what` otherwise."""
    m = re.fullmatch(_NUMBER + r"\s*(ns|us|ms|s)", text.strip().lower())
    if not m:
        raise ValueError(f"{what} expects a duration like 120ms, 40us or 0.25ns, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def compute_of(text: str, batch: int) -> tuple[float, str]:
    """`--sim-compute`: "120ms" (per step) or "40us/sample" (times `batch`) -> (seconds per step, as given)."""
    text = text.strip().lower()
    if text.endswith("/sample"):
        return seconds(text.removesuffix("/sample"), "--sim-compute") * batch, text
    return seconds(text, "--sim-compute"), text


def speeds_of(text: str, workers: int, seed: int) -> tuple[float, ...]:
    """`--sim-speeds`: "1,1,0.5" (repeated over the ranks) or "lognormal:SIGMA" -> one speed per worker."""
    text = text.strip().lower()
    if not text:
        return (1.0,) * workers
    if text.startswith("lognormal:"):
        sigma = float(text.split(":", 1)[1])
        if sigma < 0:
            raise ValueError(f"--sim-speeds lognormal:SIGMA needs SIGMA >= 0, got {sigma}")
        rng = random.Random(seed * 104_729 + 17)
        return tuple(math.exp(rng.gauss(0.0, sigma)) for _ in range(workers))
    try:
        given = [float(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--sim-speeds expects speeds like 1,1,0.5 or lognormal:0.3, got {text!r}") from None
    if not given or any(s <= 0 or not math.isfinite(s) for s in given):
        raise ValueError(f"--sim-speeds: every speed must be a positive number, got {text!r}")
    return tuple(given[w % len(given)] for w in range(workers))


def spread_of(text: str) -> float:
    """`--sim-spread`: a coefficient of variation >= 0 ("" -> 0)."""
    try:
        cv = float(text) if str(text).strip() else 0.0
    except ValueError:
        raise ValueError(f"--sim-spread expects a coefficient of variation like 0.3, got {text!r}") from None
    if not (cv >= 0 and math.isfinite(cv)):
        raise ValueError(f"--sim-spread must be a finite number >= 0, got {text!r}")
    return cv


def spread_factor(rng: random.Random, cv: float) -> float:
    """One step's log-normal factor of mean 1 and coefficient of variation `cv` (1.0 when cv is 0, no draw)."""
    if cv <= 0:
        return 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    return math.exp(rng.gauss(-sigma * sigma / 2, sigma))


def load_profile(path: str) -> dict[str, str]:
    """A hardware profile (TOML): its keys as strings; ValueError for an unknown key or a bad file."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--sim-profile {path}: {e}") from None
    unknown = sorted(set(raw) - set(PROFILE_KEYS))
    if unknown:
        raise ValueError(f"--sim-profile {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(PROFILE_KEYS)}")
    return {k: str(v) for k, v in raw.items()}


@dataclass(frozen=True)
class TimeModel:
    """Every number the simulation's clock is made of (see the module docstring)."""
    compute_s: float                          # one step's forward + backward on a speed-1 worker
    compute_source: str                       # where it came from: "given ...", "profile ...", "measured ..."
    speeds: tuple[float, ...]                 # per worker: its compute takes compute_s / speed
    delays_s: tuple[float, ...] = ()          # per worker: --straggler's extra seconds per step
    jitter_s: float = 0.0                     # --jitter's mean, seconds
    jitter_tail: str = "exp"                  # --jitter-tail
    spread: float = 0.0                       # --sim-spread: CV of a step's device time (log-normal, mean 1)
    seed: int = 0                             # the run's seed (each worker's jitter stream)
    bits_per_s: float = math.inf              # the link's bandwidth, one direction (--link)
    latency_s: float = 0.0                    # the link's one-way latency
    message_s: float = 0.0                    # software per message (alpha beyond the wire)
    apply_s_per_byte: float = 0.0             # a shard's CPU per byte of a push's fp32 slice
    apply_source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.compute_s >= 0 and self.apply_s_per_byte >= 0, "times are never negative"
        assert all(s > 0 for s in self.speeds), "speeds are positive"

    def transfer_s(self, nbytes: int) -> float:
        """The wire time of n bytes (beta x n); 0 on an unlimited link."""
        return 0.0 if math.isinf(self.bits_per_s) else 8.0 * nbytes / self.bits_per_s

    def jitter_streams(self) -> list[random.Random]:
        """Worker w's jitter stream, seeded as a real worker's (psgd/train/assemble.py)."""
        return [random.Random(self.seed * 7919 + w) for w in range(len(self.speeds))]

    def spread_streams(self) -> list[random.Random]:
        """Worker w's spread stream (its own, apart from its jitter stream)."""
        return [random.Random(self.seed * 7919 + w + SPREAD_STREAM) for w in range(len(self.speeds))]

    def describe(self) -> dict:
        """The model as summary.json states it (SIMULATED figures are made of these numbers)."""
        return {
            "clock": "virtual (discrete events); every time, rate and wait of this run is SIMULATED",
            "compute_s_per_step": self.compute_s, "compute_source": self.compute_source,
            "speeds": list(self.speeds) if len(set(self.speeds)) > 1 else self.speeds[0] if self.speeds else 1.0,
            "straggler_s": {str(w): d for w, d in enumerate(self.delays_s) if d},
            "jitter_s": self.jitter_s, "jitter_tail": self.jitter_tail,
            "spread_cv": self.spread, "spread_law": "log-normal, mean 1" if self.spread else None,
            "link": None if math.isinf(self.bits_per_s) and not self.latency_s else
            {"bits_per_s": None if math.isinf(self.bits_per_s) else self.bits_per_s, "latency_s": self.latency_s},
            "message_s": self.message_s,
            "apply_s_per_byte": self.apply_s_per_byte, "apply_source": self.apply_source,
            "queues": "each shard's NIC (in, out) and each worker's (up, down) serialise their messages; "
                      "each shard's CPU applies one push at a time",
            "notes": list(self.notes), "said": self.line(),
        }

    def line(self) -> str:
        """One line for the terminal: SIMULATED and what made the clock."""
        link = "no link time" if math.isinf(self.bits_per_s) and not self.latency_s else \
            f"link {self.bits_per_s / 1e9:g} Gbit/s, {self.latency_s * 1e6:g} us"
        spread = f" x log-normal spread CV {self.spread:.3g}" if self.spread else ""
        return (f"SIMULATED (time model: compute {self.compute_s * 1e3:.3g} ms/step{spread}, {self.compute_source}; "
                f"{link}; apply {self.apply_s_per_byte * 1e9:.3g} ns/byte)")
