"""The thread budget: how many intra-op threads each process of a run takes, so that together they
use each core once.

- `thread_budget(cfg, cores, role)`: --threads, or the cores shared by the run's processes (N
  workers and K shards on C cores, each with torch's default of one thread per core, would ask for
  (N + K) x C). A run by hand counts the processes of the whole run as if on this host: give
  --threads there when they are spread over hosts.
- Sync without --overlap takes turns (the workers compute while the shards wait for their
  gradients, the shards apply while every worker waits for the update), and so does a single
  worker in any mode (its exchange waits for the shards' answer): there the workers get the cores,
  `cores // N` each, and every shard one thread. An idle OpenMP thread spins before it sleeps, so
  two sides that both hold every core steal it from each other at each turn; the worker's forward
  and backward outweigh the shard's elementwise update, so it gets them. docs/architecture.md
  ("Threads") has the measurements behind both rules.
- `set_threads(cfg, role)`: a shard or worker process takes its share (torch.set_num_threads);
  the launcher passes the same as OMP_NUM_THREADS (psgd/train/supervise.py `child_env`).
"""

from __future__ import annotations

import os

from psgd.core.config import RunConfig


def thread_budget(cfg: RunConfig, cores: int | None = None, role: str = "worker") -> int:
    """Intra-op threads for one `role` ("worker" or "server") process of the run (see the module docstring)."""
    if cfg.threads:
        return cfg.threads
    cores = cores or os.cpu_count() or 1
    if (cfg.mode == "sync" or cfg.workers == 1) and not cfg.overlap and cfg.mode != "allreduce":
        return 1 if role == "server" else max(1, cores // cfg.workers)
    processes = cfg.workers + (0 if cfg.mode == "allreduce" else cfg.servers)
    return max(1, cores // processes)


def set_threads(cfg: RunConfig, role: str = "worker") -> None:
    """In a server or worker process: take its share of the cores (`thread_budget`)."""
    import torch  # noqa: PLC0415 - a shard or worker has it loaded; the launcher never calls this

    torch.set_num_threads(thread_budget(cfg, role=role))
