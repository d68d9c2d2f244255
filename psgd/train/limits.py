"""What a run asks of its host, checked before any folder or process exists (psgd/train/preflight.py).

`check(cfg, num_params)` refuses with one line (a UsageError: exit 2 from the CLI, a ValueError
from psgd.fit) a run that cannot start here, stating the limit it found:
- processes: the launcher starts one process per worker slot, one per shard (parameter-server
  modes) and the zygote; each takes about PROCESS_PIDS pids (its threads count too). The host's
  room is the smaller of pid_max and RLIMIT_NPROC, less the pids in use now. Without this check
  `--workers 100000` forks until the OS refuses, leaving a folder of logs.
- memory: the model's parameter bytes times the copies the run keeps (each worker: its parameters,
  gradient, optimizer state and a pulled copy; the shards together: the parameters, their optimizer
  state, a receive buffer and a checkpoint's copy), plus PROCESS_BYTES per process, against
  MemAvailable (/proc/meminfo). `num_params` None (a small built-in model, not counted so that the
  launcher stays free of torch): the processes' own memory alone.
A host that does not say (no /proc) is not checked. Pure arithmetic over what `host()` reads.
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from psgd.core.config import PS_MODES, RunConfig
from psgd.core.errors import UsageError

PROCESS_PIDS = 16          # the threads of one worker or shard (gRPC's, torch's, the feeders): pids each
PROCESS_BYTES = 32 << 20   # the private pages of one process forked from the zygote (Python, torch, gRPC)
COPIES_PER_WORKER = 4      # parameters, gradient, optimizer state, the pulled copy
COPIES_ON_SHARDS = 4       # parameters, optimizer state, a receive buffer, a checkpoint's copy


@dataclass(frozen=True)
class Host:
    pid_room: int | None        # pids this user may still take (None: not known)
    pid_source: str             # where that number comes from, for the message
    mem_available: int | None   # bytes (None: not known)


def host() -> Host:
    """This host's room for a run's processes and memory, as Linux says it now."""
    in_use = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit()) if Path("/proc").is_dir() else 0
    limits = []
    with contextlib.suppress(OSError, ValueError):  # a host that does not say: not checked
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        limits.append((pid_max - in_use, f"pid_max {pid_max}"))
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if soft != resource.RLIM_INFINITY and os.getuid() != 0:  # root is not held to RLIMIT_NPROC
        limits.append((soft - in_use, f"RLIMIT_NPROC {soft}"))
    room, source = min(limits) if limits else (None, "")
    available = None
    with contextlib.suppress(OSError, ValueError):  # a host that does not say: not checked
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return Host(room, f"{source}, {in_use} pids in use" if limits else "", available)


def processes(cfg: RunConfig) -> int:
    """The processes `psgd run` starts for `cfg`: the worker slots, the shards, the zygote."""
    return cfg.slots + (cfg.servers if cfg.mode in PS_MODES else 0) + 1


def needed_bytes(cfg: RunConfig, num_params: int | None) -> int:
    return processes(cfg) * PROCESS_BYTES + (num_params or 0) * 4 * needed_copies(cfg)


def check(cfg: RunConfig, num_params: int | None, at: Host | None = None) -> None:
    """Refuse (UsageError, one line) a run this host has no room for (see the module docstring)."""
    at = at or host()
    n = processes(cfg)
    if at.pid_room is not None and n * PROCESS_PIDS > at.pid_room:
        raise UsageError(f"{_who(cfg)} start {n} processes of about {PROCESS_PIDS} threads each; this host has "
                         f"room for {max(at.pid_room, 0) // PROCESS_PIDS} ({at.pid_source}): use fewer")
    need = needed_bytes(cfg, num_params)
    if at.mem_available is not None and need > at.mem_available:
        params = f"{num_params:,} parameters x {needed_copies(cfg)} copies and " if num_params else ""
        raise UsageError(f"{_who(cfg)} need about {_gib(need)} ({params}{n} processes); this host has "
                         f"{_gib(at.mem_available)} available (MemAvailable): use a smaller model or fewer processes")


def needed_copies(cfg: RunConfig) -> int:
    return cfg.slots * COPIES_PER_WORKER + (COPIES_ON_SHARDS if cfg.mode in PS_MODES else 0)


def _who(cfg: RunConfig) -> str:
    shards = f" and {cfg.servers} shard{'s' * (cfg.servers > 1)}" if cfg.mode in PS_MODES else ""
    return f"--workers {cfg.slots}{shards} would"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB"

