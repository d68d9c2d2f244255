"""A worker's stack at its exchange is short: at most 12 psgd frames where it waits for its shards.

A real `psgd run` (async, one worker, one shard: the default transport, shm, homed) runs with
tests/frames_trace/sitecustomize.py on the path: the worker samples its main thread's stack and
records every stack seen inside its exchange (what py-spy would show mid-run). Where a step hands
its push to the shard and waits for the reply (the innermost frame the doorbell's `send` or
`recv_head`, psgd/ps/shm/bell.py) the stack has at most 12 psgd frames from the process's first,
forked from the run's zygote and started cold.
Before issue 53 it had 21 (9 inside TcpTransport for one push_pull).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psgd.ps.shm import bell

ROOT = Path(__file__).resolve().parent.parent
MAX_FRAMES = 12

pytestmark = pytest.mark.skipif(not bell.available(), reason="the doorbell (shm's default wait) is x86-64 only")


@pytest.mark.parametrize("start", ["forked", "cold"])
def test_a_worker_waits_for_its_shard_at_most_12_psgd_frames_deep(tmp_path, start):
    traces = tmp_path / "frames"
    traces.mkdir()
    env = {**os.environ, "PSGD_TRACE_FRAMES": str(traces),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "frames_trace"), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--mode", "async", "--workers", "1", "--servers", "1",
                        "--steps", "400", "--eval-every", "0", "--out", str(tmp_path / "run"), "--quiet",
                        *(["--cold-start"] if start == "cold" else [])],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (trace,) = traces.glob("*.json")  # the one worker's
    stacks = [(stack, n) for stack, n in json.loads(trace.read_text())]
    # A step's wait (the push answered by the next parameters); the first pull, held by the start
    # barrier, and --separate-pull's pulls take the generic pull path, deeper (see docs/architecture.md).
    # The doorbell's either end: its wait (`recv_head`, a Python spin that rarely yields to the
    # sampler once the reply comes within microseconds) or its ring (`send`, which wakes a shard
    # that sleeps with a syscall), both called from the one push_pull.
    waiting = [stack for stack, _ in stacks
               if stack[-1] in ("ps/shm/bell.py:recv_head", "ps/shm/bell.py:send")
               and "ps/exchange.py:after_compute" in stack]
    assert waiting, stacks[:3]  # it did reach the shard through the doorbell
    deepest = max(waiting, key=len)
    assert len(deepest) <= MAX_FRAMES, "\n".join(deepest)
    # The exchange, the client and the transport's one push_pull are all in it.
    assert {"ps/exchange.py:after_compute", "ps/client.py:push_pull", "ps/shm/transport.py:push_pull_direct"} \
        <= set(deepest), deepest
