"""Which device a worker computes on: `--device auto | cpu | cuda | cuda:N`, decided by one pure function.

Contract:
- `parse_device(spec)` -> (kind, index): ("auto", None), ("cpu", None), ("cuda", None) or
  ("cuda", N); ValueError with a one-line message for anything else (config.validate calls it, so
  `--device gpu` is exit 2 before any process starts).
- `pick_device(spec, rank, local_rank, count)` -> "cpu" or "cuda:K", given how many CUDA devices
  this host has (`count`, 0 on a CPU-only machine or build):
    cpu          "cpu"
    auto         "cpu" when count == 0, else as `cuda`
    cuda         "cuda:K", K = (local_rank if given, else rank) % count: the workers of one host
                 spread over its GPUs, one each while there are enough (8 workers, 8 GPUs: one
                 each; 8 workers, 2 GPUs: four each), as torchrun's LOCAL_RANK convention has it
    cuda:N       "cuda:N" for every worker that asks (all of them share it)
  A CUDA spec on a host with no CUDA device, or N >= count, raises DeviceError (a ValueError with
  one line that names the fix). The caller (the worker, `psgd run`) turns it into exit 2.
Why LOCAL_RANK first: on several hosts the global rank keeps growing, but each host's GPUs are
numbered from 0; `psgd run` (one host) has rank == local rank, torchrun sets LOCAL_RANK.

Stdlib only: the count is the caller's `torch.cuda.device_count()`, so this is tested on any
machine (tests/test_devices.py) for every case a GPU host could present.
"""

from __future__ import annotations

KINDS = ("auto", "cpu", "cuda")
SPECS = "auto, cpu, cuda or cuda:N"


class DeviceError(ValueError):
    """The device asked for is not on this host; the message is one line and names the fix."""


def parse_device(spec: str) -> tuple[str, int | None]:
    """'cuda:3' -> ('cuda', 3); 'auto' -> ('auto', None); ValueError naming the flag if malformed."""
    kind, sep, index = spec.partition(":")
    if kind in KINDS and not sep:
        return kind, None
    if kind == "cuda" and index.isdigit():  # isdigit: no sign, no spaces, so N >= 0
        return kind, int(index)
    raise ValueError(f"--device must be {SPECS}, got {spec!r}")


def pick_device(spec: str, rank: int, local_rank: int | None, count: int) -> str:
    """The device this worker computes on ("cpu" or "cuda:K"); see the module docstring."""
    kind, index = parse_device(spec)
    if kind == "cpu" or (kind == "auto" and count == 0):
        return "cpu"
    if count == 0:
        raise DeviceError(f"--device {spec}, but torch sees no CUDA device (torch.cuda.is_available() is False); "
                          "use --device auto or cpu")
    if index is None:
        return f"cuda:{(rank if local_rank is None else local_rank) % count}"
    if index >= count:
        raise DeviceError(f"--device {spec}, but this host has {count} CUDA device(s), cuda:0..cuda:{count - 1}; "
                          "use one of those, or --device cuda (one per worker)")
    return f"cuda:{index}"
