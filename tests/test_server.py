"""A real shard over gRPC on 127.0.0.1:0: bad requests are refused and change nothing."""

import grpc
import pytest
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.core import codec
from psgd.core.config import RunConfig
from psgd.core.errors import ExchangeError
from psgd.ps.client import make_client
from psgd.train import assemble
from tests.helpers import open_start_barrier


def chunks(header: pb.TensorHeader, values: torch.Tensor, dtype="fp32"):
    yield pb.TensorChunk(header=header)
    for c in codec.iter_chunks(codec.encode(values, dtype)):
        yield pb.TensorChunk(data=c)


@pytest.fixture
def shard(shards):
    cfg = RunConfig(mode="async", workers=2, servers=1, steps=100)
    (address,), (core,) = shards(cfg)
    open_start_barrier(core)  # then worker 0 alone may pull
    client = make_client("grpc", [address], 0, 10)
    client.wait_ready()
    client.init(torch.arange(10, dtype=torch.float32))
    channel = grpc.insecure_channel(address)
    yield pb_grpc.ParameterShardStub(channel), core, client
    channel.close()
    client.close()


def snapshot(core) -> bytes:
    return core.param.detach().numpy().tobytes()


@pytest.mark.parametrize("header,values,message", [
    (pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=9), torch.ones(9), "has 10 elements"),
    (pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=10), torch.ones(9), "too short"),
    (pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=10), torch.ones(11), "too long"),
    (pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=1, num_elements=10), torch.ones(10), "shard 1"),
    (pb.TensorHeader(worker_id=7, dtype=pb.FP32, shard=0, num_elements=10), torch.ones(10), "worker id 7"),
    (pb.TensorHeader(worker_id=0, dtype=pb.WIRE_DTYPE_UNSPECIFIED, shard=0, num_elements=10), torch.ones(10),
     "unknown wire dtype"),
    (pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=10, clock=3), torch.ones(10), "clock 3"),
    (pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=10, base_version=9), torch.ones(10),
     "base_version"),
    (pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=10),
     torch.tensor([0, 1, float("nan")] + [0] * 7), "non-finite"),
    (pb.TensorHeader(worker_id=0, dtype=pb.FP16, shard=0, num_elements=10),
     torch.tensor([1e6] + [0.0] * 9), "non-finite"),  # overflows fp16 to inf on the wire
])
def test_bad_push_is_rejected_and_changes_nothing(shard, header, values, message):
    stub, core, _ = shard
    before, version = snapshot(core), core.policy.version
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(chunks(header, values, "fp16" if header.dtype == pb.FP16 else "fp32"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert snapshot(core) == before and core.policy.version == version
    assert core.policy.clocks == [0, 0]


def test_stream_without_header_is_rejected(shard):
    stub, core, _ = shard
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([pb.TensorChunk(data=b"\0" * 40)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_good_push_applies_sgd_and_pull_returns_it(shard):
    stub, core, client = shard
    out = torch.empty(10)
    assert not client.pull(0, out).done
    assert torch.equal(out, torch.arange(10, dtype=torch.float32))
    done, refused, sent = client.push(0, torch.ones(10))
    assert not done and not refused and sent == 40
    client.pull(1, out)
    # One SGD step with lr 0.05, momentum 0.9 (first step: buffer = grad).
    assert torch.allclose(out, torch.arange(10, dtype=torch.float32) - 0.05)
    assert core.policy.version == 1


def test_pull_in_half_precision(shard):
    _, _, client = shard
    client.dtype = "bf16"
    out = torch.empty(10)
    client.pull(0, out)
    assert torch.equal(out, torch.arange(10, dtype=torch.float32).bfloat16().float())


def test_push_before_init_is_refused(shards):
    (address,), _ = shards(RunConfig(mode="sync", workers=1, servers=1))
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ParameterShardStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(chunks(pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=1), torch.ones(1)),
                      timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_skip_nonfinite_counts_and_never_applies(shards):
    cfg = RunConfig(mode="async", workers=1, servers=1, skip_nonfinite=True)
    (address,), (core,) = shards(cfg)
    client = make_client("grpc", [address], 0, 4)
    client.init(torch.zeros(4))
    before = snapshot(core)
    client.push(0, torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    assert snapshot(core) == before and core.policy.stats.skipped_nonfinite == 1
    client.close()


def test_port_in_use_is_a_clear_error(shards):

    (address,), _ = shards(RunConfig(servers=1))
    port = int(address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="in use"):
        assemble.shard_server(RunConfig(servers=1), 0, "127.0.0.1", port)


def test_init_for_another_shard_is_refused(shard_servers):
    (server, _) = shard_servers(RunConfig(mode="sync", workers=1, servers=2))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ParameterShardStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Init(chunks(pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=1, num_elements=4), torch.ones(4)),
                      timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "for shard 1" in err.value.details()
    assert not server.shard.ready.is_set()


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_closing_after_a_failure_cuts_held_calls_instead_of_waiting_for_their_deadline(shard_servers, threads,
                                                                                       transport):
    # Worker 0's first pull is held at the start barrier (worker 1 never comes); its deadline is 10
    # minutes away. close(failed=True) must end it now: the close thread finishes within the join
    # deadline, and the pull fails with a one-line ExchangeError.
    (server,) = shard_servers(RunConfig(mode="sync", workers=2, servers=1))
    client = make_client(transport, [f"127.0.0.1:{server.port}"], 0, 4, rpc_timeout=600)
    client.init(torch.zeros(4))
    streams = client.start_pull(0, torch.empty(4))
    with server.shard.lock:  # the pull is in: held by the policy
        assert server.shard.lock.wait_for(lambda: 0 in server.shard.policy.roster.at_start, timeout=60)
    threads.start(client.close, True, name="close")
    threads.join()
    with pytest.raises(ExchangeError):
        streams.result()


def test_push_pull_is_one_call_for_the_run_and_a_held_step_fails_at_its_deadline(shard_servers, monkeypatch):
    """gRPC's PushPull stays open from step to step (one call per shard per run); its steps are
    timed by the client, since a call's deadline would span the run: a step the shard holds (sync,
    worker 1 never pushes) fails with DEADLINE_EXCEEDED, and the next step opens a new call."""
    from psgd.ps import transport as transport_mod

    opened: list[int] = []
    original = transport_mod._RunStream.__init__
    monkeypatch.setattr(transport_mod._RunStream, "__init__",
                        lambda self, method: (opened.append(1), original(self, method))[-1])
    (alone,) = shard_servers(RunConfig(mode="sync", workers=1, servers=1, steps=100))
    client = make_client("grpc", [f"127.0.0.1:{alone.port}"], 0, 4, rpc_timeout=60)
    client.init(torch.zeros(4))
    client.pull(0, torch.empty(4))
    out = torch.empty(4)
    for clock in range(3):
        assert client.push_pull(clock, torch.ones(4), out).pulled.versions == [clock + 1]
    assert opened == [1] and torch.equal(out, alone.shard.param)
    client.close()

    (held,) = shard_servers(RunConfig(mode="sync", workers=2, servers=1, rpc_timeout=600))
    open_start_barrier(held.shard)
    client = make_client("grpc", [f"127.0.0.1:{held.port}"], 0, 4, rpc_timeout=0.4)
    client.init(torch.zeros(4))
    client.pull(0, torch.empty(4))
    with pytest.raises(ExchangeError, match="push-pull with shard 0 .*DEADLINE_EXCEEDED"):
        client.push_pull(0, torch.ones(4), torch.empty(4))
    with pytest.raises(ExchangeError, match="INVALID_ARGUMENT.*pushed clock 0, expected 1"):
        client.push_pull(0, torch.ones(4), torch.empty(4))  # a new call, the same shard state
    assert opened == [1, 1, 1]
    client.close()
