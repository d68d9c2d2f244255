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
def shards():
    """Factory: start cfg.servers in-process shards; returns (addresses, servicers)."""
    started = []

    def start(cfg: RunConfig):
        addresses, servicers = [], []
        for k in range(cfg.servers):
            srv, servicer, port = server_mod.create_server(cfg, k, "127.0.0.1", 0)
            started.append((srv, servicer))
            addresses.append(f"127.0.0.1:{port}")
            servicers.append(servicer)
        return addresses, servicers

    yield start
    for srv, servicer in started:
        server_mod.stop(srv, servicer, grace=0)
