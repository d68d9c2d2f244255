"""The raw-TCP data plane (psgd/ps/tcp_server.py, psgd/ps/framing.py) against real shards on 127.0.0.1:0.

Same contract as gRPC: bad frames are refused with a status and a message and change nothing,
good ones give the same SGD results in every wire dtype, and stopping a shard leaves no thread.
"""

import socket
import threading

import pytest
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec
from psgd.core.config import RunConfig
from psgd.core.errors import ExchangeError
from psgd.ps import framing as tcp
from psgd.ps.client import make_client
from psgd.train import assemble
from tests.helpers import open_start_barrier, processes_mentioning, psgd_main, summary

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")


@pytest.fixture
def shard(shard_servers):
    cfg = RunConfig(mode="async", workers=2, servers=1, steps=100)
    (server,) = shard_servers(cfg)
    open_start_barrier(server.shard)  # then worker 0 alone may pull
    client = make_client("tcp", [f"127.0.0.1:{server.port}"], 0, 10)
    client.wait_ready()
    client.init(torch.arange(10, dtype=torch.float32))
    with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as sock:
        yield sock, server.shard, client
    client.close()


def snapshot(core) -> bytes:
    return core.param.detach().numpy().tobytes()


def push_frame(sock, header: pb.TensorHeader, values: torch.Tensor, dtype: str = "fp32") -> tuple[int, bytes]:
    tcp.send_frame(sock, tcp.PUSH, header.SerializeToString(), codec.encode(values, dtype))
    op, body, payload_len = tcp.recv_head(sock)
    assert payload_len == 0
    return op, body


def pull_frame(sock, request: pb.PullRequest) -> tuple[pb.PullHeader, torch.Tensor]:
    tcp.send_frame(sock, tcp.PULL, request.SerializeToString())
    op, body, _ = tcp.recv_head(sock)
    assert op == tcp.PULLED, body
    header = pb.PullHeader.FromString(body)
    out = torch.empty(header.num_elements)
    tcp.recv_tensor(sock, out, "fp32")
    return header, out


def fp32_header(**kw) -> pb.TensorHeader:
    return pb.TensorHeader(**{"worker_id": 0, "dtype": pb.FP32, "shard": 0, "num_elements": 10, **kw})


@pytest.mark.parametrize("header,values,message", [
    (fp32_header(num_elements=9), torch.ones(9), "has 10 elements"),
    (fp32_header(), torch.ones(9), "payload of 36 bytes"),
    (fp32_header(shard=1), torch.ones(10), "shard 1"),
    (fp32_header(worker_id=7), torch.ones(10), "worker id 7"),
    (fp32_header(dtype=pb.WIRE_DTYPE_UNSPECIFIED), torch.ones(10), "unknown wire dtype"),
    (fp32_header(clock=3), torch.ones(10), "clock 3"),
    (fp32_header(base_version=9), torch.ones(10), "base_version"),
    (fp32_header(), torch.tensor([0, 1, float("nan")] + [0] * 7), "non-finite"),
])
def test_bad_push_is_refused_changes_nothing_and_the_connection_stays_usable(shard, header, values, message):
    sock, core, _ = shard
    before, version = snapshot(core), core.policy.version
    op, body = push_frame(sock, header, values)
    assert op == tcp.ERROR and body.decode().startswith("INVALID_ARGUMENT: ") and message in body.decode()
    assert snapshot(core) == before and core.policy.version == version
    assert core.policy.clocks == [0, 0]
    # The refused payload was drained: the next request on the same connection is answered.
    header, out = pull_frame(sock, pb.PullRequest(worker_id=0, clock=0, dtype=pb.FP32, shard=0))
    assert header.version == version and torch.equal(out, torch.arange(10, dtype=torch.float32))


@pytest.mark.parametrize("prefix,message", [
    (tcp.PREFIX.pack(9, 0, 0), "unknown frame op 9"),
    (tcp.PREFIX.pack(tcp.PUSH, tcp.MAX_HEADER + 1, 0), "not a psgd peer"),
    # More than any request to this 10-element shard carries: closed, not drained (a payload
    # length of 2**63 would otherwise hold the connection's thread for ever).
    (tcp.PREFIX.pack(tcp.PUSH, 0, 84), "payload of 84 bytes"),
    (tcp.PREFIX.pack(tcp.PUSH, 0, 2**63), "no request to this shard has more than 80"),
])
def test_untrustworthy_frame_gets_an_error_and_the_connection_is_closed(shard, prefix, message):
    sock, core, client = shard
    sock.sendall(prefix)
    op, body, _ = tcp.recv_head(sock)
    assert op == tcp.ERROR and message in body.decode()
    assert tcp.recv_head(sock) is None  # closed by the shard
    out = torch.empty(10)
    assert not client.pull(0, out).done  # other connections are unaffected


def test_malformed_header_is_refused(shard):
    sock, _, _ = shard
    tcp.send_frame(sock, tcp.PULL, b"\xff\xff\xff")
    op, body, _ = tcp.recv_head(sock)
    assert op == tcp.ERROR and "malformed PullRequest" in body.decode()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_tcp_and_grpc_give_the_same_updates_in_every_wire_dtype(shards, dtype):
    cfg = RunConfig(mode="async", workers=1, servers=2, steps=100)
    results = []
    for transport in ("grpc", "tcp"):
        addresses, _ = shards(cfg)
        n = 300_001  # several chunks per shard, odd split
        client = make_client(transport, addresses, 0, n, wire_dtype=dtype)
        try:
            client.wait_ready()
            client.init(torch.linspace(-1, 1, n))
            grad = torch.linspace(0, 2, n)
            out = torch.empty(n)
            for clock in range(3):
                client.pull(clock, out)
                assert client.push(clock, grad) == (False, False, n * codec.itemsize(dtype))
            result = client.pull(3, out)
            assert result.versions == [3, 3] and result.bytes == n * codec.itemsize(dtype)
            results.append(out.clone())
        finally:
            client.close()
    assert torch.equal(results[0], results[1])


def test_start_pull_streams_ranges_in_order_over_tcp(shards):
    addresses, _ = shards(RunConfig(mode="async", workers=1, servers=2))
    n = 700_000
    values = torch.linspace(-1, 1, n)
    client = make_client("tcp", addresses, 0, n)
    try:
        client.init(values)
        out = torch.zeros(n)
        streams = client.start_pull(0, out)
        streams.wait_range(0, 10)
        assert torch.equal(out[:10], values[:10])
        result = streams.result()
        assert torch.equal(out, values) and not result.done and result.bytes == 4 * n
    finally:
        client.close()


def test_push_before_init_is_refused(shard_servers):
    (server,) = shard_servers(RunConfig(mode="sync", workers=1, servers=1))
    with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as sock:
        op, body = push_frame(sock, fp32_header(num_elements=1), torch.ones(1))
    assert op == tcp.ERROR and body.decode().startswith("FAILED_PRECONDITION: ")


def test_refused_push_is_one_line_exchange_error(shards):
    addresses, _ = shards(RunConfig(mode="async", workers=1, servers=1))
    client = make_client("tcp", addresses, 0, 4)
    try:
        client.init(torch.zeros(4))
        with pytest.raises(ExchangeError, match=r"^push to shard 0 at 127\.0\.0\.1:\d+: INVALID_ARGUMENT: non-finite"):
            client.push(0, torch.tensor([1.0, float("nan"), 0.0, 0.0]))
        assert client.push(0, torch.ones(4)) == (False, False, 16)  # the client recovers
    finally:
        client.close()


def test_stopped_shard_is_unavailable_and_leaves_no_thread():

    cfg = RunConfig(mode="async", workers=1, servers=1)
    server = assemble.shard_server(cfg, 0, "127.0.0.1", 0)
    client = make_client("tcp", [f"127.0.0.1:{server.port}"], 0, 4, rpc_timeout=10)
    try:
        client.init(torch.zeros(4))
        client.pull(0, torch.empty(4))  # leaves an idle connection open on the shard
        server.stop(grace=0)
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("psgd-tcp") or "process_request" in t.name]
        assert not server.data_server.connections
        with pytest.raises(ExchangeError, match="UNAVAILABLE"):
            client.push(0, torch.ones(4))
    finally:
        client.close(failed=True)  # after a failure: no Leave to a shard that is gone


def test_run_over_grpc_writes_everything(tmp_path):
    """tcp is the default data plane (the other runs' tests use it); gRPC carries a whole run too."""
    out = tmp_path / "grpc"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--servers", "2", "--steps", "8", "--transport", "grpc",
                  "--dataset", "synthetic", "--num-samples", "1000", "--model", "mlp", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["global_updates"] == 8 and s["config"]["transport"] == "grpc"
    assert processes_mentioning(str(out)) == []


@pytest.mark.parametrize("args,message", [
    (["--transport", "udp"], "--transport"),
    (["--mode", "allreduce", "--transport", "grpc"], "--transport is a parameter-server option"),
])
def test_transport_usage_errors(args, message):
    r = psgd_main("run", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
