"""What a cluster's links carry, measured: one raw TCP stream between two hosts, and the bytes the
kernel counted on a host's eth0. Plumbing over psgd/cluster/plan.py (`ip netns exec`, `ip -s link`);
it sends nothing anywhere but from one of the cluster's hosts to another.

Contract: `goodput(c, "h1", "h0", nbytes)` runs a receiver on h0 (bound to its address, port 0)
and a sender on h1, each `python -c` in its host's namespace; the receiver times from its first
byte to its last, so the figure is the stream's steady rate, TCP/IP headers not counted (tbf counts
them: expect a few percent under the setting). A failed probe is a ProbeFailed naming it.
`wire_bytes(c, "h0")`: received + sent bytes of h0's eth0 so far (headers included).

    psgd bench cluster      # measures every link it makes (psgd/bench/cluster.py)
"""

from __future__ import annotations

import json
import subprocess
import sys

from psgd.cluster import netns, plan

PROBE_TIMEOUT_S = 120.0
RX = """import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while (k := c.recv_into(buf)):
    t0 = t0 or time.monotonic(); n += k
print(n, time.monotonic() - t0)"""
TX = """import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); b = bytes(1 << 20)
for _ in range(int(sys.argv[3]) >> 20): c.sendall(b)
c.close()"""


class ProbeFailed(RuntimeError):
    """A probe's process failed or timed out; the message names the probe."""


def goodput(c: plan.Cluster, src: str, dst: str, nbytes: int) -> tuple[int, float]:
    """(bytes received, seconds) of one raw TCP stream of nbytes (whole MiB) from host src to host dst."""
    to = c.host(dst)
    rx = subprocess.Popen(plan.exec_argv(c, dst, [sys.executable, "-c", RX, to.address]), stdout=subprocess.PIPE,
                          text=True)
    try:
        port = rx.stdout.readline().strip()
        subprocess.run(plan.exec_argv(c, src, [sys.executable, "-c", TX, to.address, port, str(nbytes)]),
                       check=True, timeout=PROBE_TIMEOUT_S)
        got, seconds = rx.communicate(timeout=PROBE_TIMEOUT_S)[0].split()
    except (subprocess.SubprocessError, ValueError) as e:
        raise ProbeFailed(f"the TCP probe {src} -> {dst} on cluster {c.name!r} failed: {e}") from None
    finally:
        rx.kill()
        rx.wait()
    return int(got), float(seconds)


def wire_bytes(c: plan.Cluster, host: str) -> int:
    """Bytes the kernel counted on a host's eth0 so far, received + sent (headers included)."""
    stats = json.loads(netns.run(["ip", "-n", c.host(host).namespace, "-j", "-s", "link", "show", "dev",
                                  plan.HOST_IF]))[0]["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])
