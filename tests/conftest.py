"""Shared fixtures: in-process shard servers on 127.0.0.1 port 0, always stopped."""

from __future__ import annotations

import os
import signal

# The tests hold parameter hashes of real runs, and a run's last bits depend on which of torch's CPU
# kernels it runs (measured: the same sync run hashes 41ce5e7b... with AVX2 kernels and 537f4dc0...
# with AVX-512 ones). Every x86 machine since 2013 has AVX2, so the tests and every process they start
# (tests/helpers.py ENV copies this environment) use those kernels. MKL's matrix kernels follow the
# CPU's vendor whatever this says, so the hashes are held per class of CPU (tests/numerics.py).
# Set before torch is imported; a value already set (e.g. `default`) is kept.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

from tests.threads import thread_exceptions, threads  # noqa: F401 - fixtures, registered for every test

if TYPE_CHECKING:
    from psgd.core.config import RunConfig

# The warm parents, registered here once: a session fixture imported into each test module is a
# fixture of that module, one warm parent per module (measured: 26 torch imports in a run, not 2).
from tests.warm import script_parent, warm_benches, warm_parent, warm_runs, warm_suites  # noqa: F401 - fixtures

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    """torch's one intra-op thread from the first test module on, in each process that runs tests.
    pytest-xdist's controller (`-n 2`) runs none: it does not import torch (this file imports in 0.15 s
    without it, 1.8 s with), and its two workers start sooner (one test file: 5.0 s against 6.4 s)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        import torch

        torch.set_num_threads(1)

# Started as a background job (`make test &`, nohup), this process ignores SIGINT, and an ignored
# signal stays ignored across exec: every psgd process a test starts would then ignore the Ctrl-C a
# test stops it with (measured: two tests waited out their 60 s grace each before SIGKILL). Children
# get Python's own handler back; the tests of Ctrl-C itself still set theirs.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Every test starts with torch's one intra-op thread. A command run in this process (psgd
    worker or server by psgd_main) sets its own thread budget, and the count changes a matmul's
    last bits (1 vs 2 threads, measured): a bit-for-bit comparison in a later test of the same
    xdist worker would then fail by the order the tests ran in."""
    import torch

    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


def gpu_skip_reason(wanted: int, available: int) -> str | None:
    """Why a test marked gpu(devices=wanted) cannot run with `available` CUDA devices (None: it can)."""
    if available >= wanted:
        return None
    have = "torch sees no CUDA device" if available == 0 else f"torch sees {available} CUDA device(s)"
    return f"needs {wanted} CUDA device(s), {have}: runs on a GPU host (make gpu-check)"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run wherever CUDA is present and are skipped, with the reason, elsewhere."""
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        reason = marker and gpu_skip_reason(marker.kwargs.get("devices", 1), available)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def shard_servers():
    """Factory: start cfg.servers in-process shard servers (gRPC + TCP data plane); returns them."""
    from psgd.ps import server as server_mod
    from psgd.train import assemble

    started: list[server_mod.ShardServer] = []

    def start(cfg: RunConfig) -> list[server_mod.ShardServer]:
        servers = [assemble.shard_server(cfg, k, "127.0.0.1", 0) for k in range(cfg.servers)]
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
