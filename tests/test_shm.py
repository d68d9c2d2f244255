"""`--transport shm` (psgd/ps/shm/): the TCP data plane's frames with their payloads in shared memory.

The same updates as tcp and gRPC in every wire dtype and for sparse pushes, a refused request that
leaves the connection usable, segments that grow when a request needs more, a shard that maps only
what a worker of its own host names, and nothing left behind in /dev/shm.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec
from psgd.core.config import RunConfig
from psgd.core.errors import ExchangeError
from psgd.ps import framing as fr
from psgd.ps.client import make_client
from psgd.ps.shm import segment, serve
from tests.helpers import psgd_main, summary

pytestmark = pytest.mark.usefixtures("warm_runs")


def ours() -> set[str]:
    """This process's segments in /dev/shm (a worker names them psgd-PID-...)."""
    return {n for n in os.listdir(segment.ROOT) if n.startswith(f"psgd-{os.getpid()}-")}


def steps(transport: str, addresses: list[str], n: int, dtype: str, topk: float = 1.0) -> torch.Tensor:
    client = make_client(transport, addresses, 0, n, wire_dtype=dtype, topk=topk)
    try:
        client.wait_ready()
        client.init(torch.linspace(-1, 1, n))
        out = torch.empty(n)
        for clock in range(3):
            client.pull(clock, out)
            client.push(clock, torch.linspace(0, 2, n) * (clock + 1))
        assert client.pull(3, out).versions == [3, 3]
        return out.clone()
    finally:
        client.close()


@pytest.mark.parametrize("dtype,topk", [("fp32", 1.0), ("fp16", 1.0), ("bf16", 1.0), ("fp32", 0.1)])
def test_shm_gives_the_same_updates_as_tcp_and_leaves_nothing_in_dev_shm(shards, dtype, topk):
    cfg = RunConfig(mode="async", workers=1, servers=2, steps=100)
    n = 300_001  # several frames' worth per shard, odd split
    got = {t: steps(t, shards(cfg)[0], n, dtype, topk) for t in ("tcp", "shm")}
    assert torch.equal(got["tcp"], got["shm"])
    assert ours() == set()


def test_a_refused_push_is_one_line_and_the_connection_stays_usable(shards):
    addresses, cores = shards(RunConfig(mode="async", workers=1, servers=1))
    client = make_client("shm", addresses, 0, 4)
    try:
        client.init(torch.zeros(4))
        with pytest.raises(ExchangeError, match=r"^push to shard 0 at 127\.0\.0\.1:\d+: INVALID_ARGUMENT: non-finite"):
            client.push(0, torch.tensor([1.0, float("nan"), 0.0, 0.0]))
        assert cores[0].policy.version == 0
        assert client.push(0, torch.ones(4)) == (False, False, 16)
        out = torch.empty(4)
        client.pull(1, out)
        assert torch.equal(out, torch.full((4,), -0.05))  # lr 0.05 x one gradient of ones
    finally:
        client.close()


def attach(sock: socket.socket, name: str) -> tuple[int, str]:
    fr.send_frame(sock, serve.ATTACH, name.encode())
    op, body, _ = fr.recv_head(sock)
    return op, body.decode()


def test_the_shard_maps_only_a_psgd_segment_of_a_bounded_size(shard_servers, tmp_path):
    (server,) = shard_servers(RunConfig(mode="async", workers=1, servers=1))
    big = segment.Segment.create(server.shard.max_payload + 2 * segment.PAGE)
    ok = segment.Segment.create(64)
    try:
        with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as sock:
            for name, message in [("../etc/passwd", "is not a psgd segment name"),
                                  (f"psgd-{os.getpid()}-0000000000000000", "cannot open"),
                                  (big.name, "largest payload")]:
                op, body = attach(sock, name)
                assert op == fr.ERROR and body.startswith("FAILED_PRECONDITION: ") and message in body, body
            assert attach(sock, ok.name) == (fr.WELCOME, "")  # the refusals left the connection usable
            assert ok.name not in os.listdir(segment.ROOT)  # mapped: the shard let go of the name at once
    finally:
        for seg in (big, ok):
            seg.unlink()
            seg.close()


MAKER = """
import os, sys
from psgd.ps.shm import segment
segment.ROOT = sys.argv[2]
print(segment.Segment.create(4096).name, flush=True)
os.kill(os.getpid(), 9) if sys.argv[1] == "killed" else sys.stdin.read()
"""


def test_a_segment_whose_worker_was_killed_before_its_shard_mapped_it_is_swept_by_the_next_one(tmp_path, monkeypatch):
    """SIGKILL between `create` and the shard's `attach` runs no cleanup: the file stays, named for a
    pid that no longer runs. The next segment made on this host removes it, and leaves a live
    maker's (in flight to its shard) alone. (In a folder of the test's own: the other tests check
    /dev/shm for segments of exited makers.)"""
    monkeypatch.setattr(segment, "ROOT", str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", MAKER, "killed", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert killed.returncode == -signal.SIGKILL
    left = killed.stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", MAKER, "live", str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        in_flight = live.stdout.readline().strip()
        mine = segment.Segment.create(64)
        try:
            names = set(os.listdir(segment.ROOT))
            assert left not in names and {in_flight, mine.name} <= names
        finally:
            mine.unlink()
            mine.close()
    finally:
        live.communicate("")
    segment.sweep()  # its maker has exited now
    assert in_flight not in os.listdir(segment.ROOT)


def test_a_payload_larger_than_the_segment_closes_the_connection(shard_servers):
    (server,) = shard_servers(RunConfig(mode="async", workers=1, servers=1))
    seg = segment.Segment.create(16)
    try:
        with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as sock:
            assert attach(sock, seg.name)[0] == fr.WELCOME
            fr.send_frame(sock, fr.PUSH, b"", None, length=seg.size + 4)
            op, body, _ = fr.recv_head(sock)
            assert op == fr.ERROR and "segment" in body.decode()
            assert fr.recv_head(sock) is None  # closed
    finally:
        seg.unlink()
        seg.close()


def test_only_a_loopback_peer_without_tls_may_attach():
    class Peer:
        def __init__(self, host):
            self.host = host

        def getpeername(self):
            return (self.host, 5)
    assert serve.refused(Peer("127.0.0.1"), tls=False) is None
    assert serve.refused(Peer("::1"), tls=False) is None
    assert "loopback" in serve.refused(Peer("198.18.0.2"), tls=False)
    assert "TLS" in serve.refused(Peer("127.0.0.1"), tls=True)


@pytest.mark.parametrize("mode,workers,servers", [("sync", 2, 2), ("sync", 2, 1), ("async", 1, 1)])
def test_a_run_over_shm_has_the_hash_of_tcp(tmp_path, mode, workers, servers):
    """With one shard the workers' buffers are homed in their segments (psgd/ps/shm/transport.py `lend`)."""
    args = ["--mode", mode, "--workers", str(workers), "--servers", str(servers), "--steps", "12", "--dataset",
            "synthetic", "--num-samples", "1000", "--model", "mlp"]
    hashes = {}
    for t in ("tcp", "shm"):
        r = psgd_main("run", *args, "--transport", t, "--out", str(tmp_path / t))
        assert r.returncode == 0, r.stderr
        hashes[t] = summary(tmp_path / t)["params_sha256"]
    assert hashes["tcp"] == hashes["shm"]
    # One worker and one shard: the shard kept its parameters in the worker's segment (no reply copy).
    homed = json.loads((tmp_path / "shm" / "shard-0.json").read_text())["params_homed"]
    assert homed == (workers == 1 and servers == 1)
    assert not [n for n in os.listdir(segment.ROOT) if n.startswith("psgd-")
                and not os.path.exists(f"/proc/{n.split('-')[1]}")]  # no segment outlives its worker


@pytest.mark.parametrize("args,message", [
    (["--transport", "shm", "--hosts", "2"], "--transport shm"),
    (["--transport", "shm", "--tls-ca", "ca.pem"], "--transport shm"),
])
def test_shm_usage_errors(args, message):
    r = psgd_main("run", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_codec_itemsize_matches_the_segment_views():
    seg = segment.Segment.create(64)
    try:
        values = torch.tensor([1.0, -2.5, 3.25])
        for dtype in ("fp32", "fp16", "bf16"):
            n = seg.put_tensor(values, dtype)
            assert n == 3 * codec.itemsize(dtype)
            back = torch.empty(3)
            seg.get_tensor(back, dtype)
            assert torch.equal(back, values.to(codec.WIRE_DTYPES[dtype]).float())
    finally:
        seg.unlink()
        seg.close()


def test_a_reply_larger_than_the_segment_is_refused(shards):
    addresses, _ = shards(RunConfig(mode="async", workers=1, servers=1))
    client = make_client("tcp", addresses, 0, 2000)
    seg = segment.Segment.create(16)  # one page: 4 KiB, less than the shard's 8,000 bytes
    try:
        client.init(torch.zeros(2000))
        host = addresses[0].rsplit(":", 1)[0]
        data_port = client.transport.info([0])[0].data_port
        with socket.create_connection((host, data_port), timeout=10) as sock:
            assert attach(sock, seg.name)[0] == fr.WELCOME
            request = pb.PullRequest(worker_id=0, shard=0, clock=0, dtype=pb.FP32)
            fr.send_frame(sock, fr.PULL, request.SerializeToString())
            op, body, _ = fr.recv_head(sock)
            assert op == fr.ERROR and body.decode().startswith("INVALID_ARGUMENT: a reply of 8000 bytes"), body
    finally:
        client.close()
        seg.unlink()
        seg.close()


def test_a_side_spins_only_where_the_runs_processes_fit_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert segment.spin_for(2, 0.003) == 0.003  # one worker and one shard on 2 cores: each has its own
    assert segment.spin_for(3, 0.003) == 0.0    # one more process than cores: a spin would take one's core


def test_a_shard_spins_for_the_next_push_only_where_its_lone_workers_threads_leave_it_a_core(monkeypatch):
    """A lone worker with every core (the thread budget's rule) and a shard that spins on one of them
    stalled the worker's OpenMP team: an MLP's N=1 run over shm took 20x tcp's time on 2 cores."""
    from psgd.core.config import RunConfig
    from psgd.ps.shm import serve
    from psgd.train import assemble, threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert serve.push_spin(workers=1, worker_threads=2, shards=1) == 0.0  # the default budget: no core to spin on
    assert serve.push_spin(workers=1, worker_threads=1, shards=1) == segment.PUSH_SPIN_S  # --threads 1
    assert serve.push_spin(workers=2, worker_threads=1, shards=1) == 0.0  # N threads would take turns at the GIL
    assert serve.push_spin(workers=1, worker_threads=1, shards=1, rows=True) == 0.0  # the row service's GIL
    cfg = RunConfig(mode="async", workers=1, servers=1)
    options = assemble.shard_options(cfg, 0)
    assert options.worker_threads == threads.thread_budget(cfg) == 2 and not options.serves_rows
    assert assemble.shard_options(dataclasses.replace(cfg, embeddings="rows"), 0).serves_rows


def test_a_spinning_wait_returns_once_the_socket_is_readable_and_after_its_budget_when_not():
    a, b = socket.socketpair()
    try:
        fr.await_readable(a, 0.0)   # no spin: returns at once
        fr.await_readable(a, 0.01)  # nothing to read: returns when its budget is spent, never blocks
        b.sendall(b"x")
        fr.await_readable(a, 60.0)  # readable: returns at once, whatever the budget
        assert a.recv(1) == b"x"
    finally:
        a.close()
        b.close()
