"""Shared fixtures: in-process shard servers on 127.0.0.1 port 0, always stopped."""

from __future__ import annotations

import os

import pytest
import torch

from psgd.core.config import RunConfig
from psgd.ps import server as server_mod
from tests.threads import thread_exceptions, threads  # noqa: F401 - fixtures, registered for every test

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def shard_servers():
    """Factory: start cfg.servers in-process shard servers (gRPC + TCP data plane); returns them."""
    started: list[server_mod.ShardServer] = []

    def start(cfg: RunConfig) -> list[server_mod.ShardServer]:
        servers = [server_mod.start(cfg, k, "127.0.0.1", 0) for k in range(cfg.servers)]
        started.extend(servers)
        return servers

    yield start
    for s in started:
        s.stop(grace=0)


@pytest.fixture
def shards(shard_servers):
    """Factory: start cfg.servers in-process shards; returns (addresses, their Shard cores)."""
    def start(cfg: RunConfig):
        servers = shard_servers(cfg)
        return [f"127.0.0.1:{s.port}" for s in servers], [s.shard for s in servers]
    return start
