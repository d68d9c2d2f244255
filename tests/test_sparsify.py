"""Sparsified pushes (--topk, psgd/core/sparsify.py): the selection, error feedback's bookkeeping,
the sparse wire on both transports, and its refusals. Real shards on 127.0.0.1:0, tiny tensors."""

import socket

import grpc
import pytest
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.core import link, sparsify
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig, validate
from psgd.ps import framing as fr
from psgd.ps.client import make_client
from psgd.train import assemble
from psgd.train import data as data_mod
from tests.helpers import open_start_barrier, psgd_main, workers_in_threads

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")


def test_select_takes_the_largest_magnitudes_and_breaks_ties_toward_the_lower_index():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sparsify.select(x, 37), torch.topk(x.abs(), 37).indices.sort().values)
    assert sparsify.select(torch.tensor([1.0, -2.0, 2.0, -2.0, 0.5]), 2).tolist() == [1, 2]
    assert sparsify.select(torch.tensor([0.0, float("nan"), 3.0]), 1).tolist() == [1]  # the server refuses it
    assert [sparsify.count(n, f) for n, f in [(1000, 0.01), (1000, 1.0), (10, 0.01), (7, 0.5)]] == [10, 1000, 1, 4]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_error_feedback_conserves_the_gradient_mass(dtype):
    """Each step, sent + new residual == old residual + gradient, bit for bit (the rounding to the
    wire dtype is fed back exactly: Sterbenz's lemma, see sparsify's docstring). Over many steps
    sent + residual == the sum of the gradients up to the fp32 additions that accumulate them."""
    ranges = [(0, 300), (300, 1000)]
    s = sparsify.Sparsifier(ranges, 0.05, error_feedback=True)
    gen = torch.Generator().manual_seed(1)
    total_sent, total_grad = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for _ in range(20):
        grad = torch.randn(1000, generator=gen) * 10 ** torch.randint(-3, 3, (1000,), generator=gen)
        before = s.residual.clone()
        sent = torch.zeros(1000)
        for k, (a, b) in enumerate(ranges):
            sp = s.compress(k, grad[a:b], dtype)
            assert sp.values.dtype == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
            assert sp.indices.dtype == torch.int32 and sp.nbytes == s.nbytes(k, dtype) == sparsify.wire_bytes(
                sparsify.count(b - a, 0.05), dtype)
            sent[a + sp.indices.long()] = sp.values.float()
        assert torch.equal(sent + s.residual, before + grad)
        total_sent += sent.double()
        total_grad += grad.double()
    assert torch.allclose(total_sent + s.residual.double(), total_grad, rtol=1e-5, atol=1e-4)
    assert s.residual.abs().max() > 0  # something was held back


def test_without_error_feedback_the_rest_is_dropped():
    s = sparsify.Sparsifier([(0, 100)], 0.1, error_feedback=False)
    grad = torch.arange(100, dtype=torch.float32) - 49.5
    sp = s.compress(0, grad, "fp32")
    assert s.residual is None and sp.indices.tolist() == list(range(5)) + list(range(95, 100))
    assert torch.equal(sp.values, grad[sp.indices.long()])


def dense_or_sparse_at_one(shards, transport: str, sparse: bool):
    """One worker (sums in one order: bit for bit), two shards, a tiny MLP; the sparse path at
    fraction 1 sends every entry as an (index, value) pair."""
    cfg = RunConfig(mode="sync", workers=1, servers=2, batch_size=16, steps=6, seed=3, transport=transport,
                    optim=OptimConfig(lr=0.1, momentum=0.9), data=DataConfig(dataset="synthetic", num_samples=500),
                    model=ModelConfig(model="mlp", width=16), device="cpu")
    addresses, cores = shards(cfg)

    def exchange(cfg, addresses):
        ex = assemble.ps_exchange(cfg, addresses)
        ex.topk = 1.0 if sparse else None
        return ex
    (totals,) = workers_in_threads(cfg, addresses, exchange)
    return torch.cat([c.param.detach().clone() for c in cores]), totals["bytes_pushed"]


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_topk_with_fraction_1_equals_dense_pushes_bit_for_bit(shards, transport):
    dense, dense_bytes = dense_or_sparse_at_one(shards, transport, sparse=False)
    sparse, sparse_bytes = dense_or_sparse_at_one(shards, transport, sparse=True)
    assert dense.numpy().tobytes() == sparse.numpy().tobytes()
    assert sparse_bytes == 2 * dense_bytes  # it did go sparse: an int32 index beside every fp32 value


@pytest.mark.parametrize("transport,dtype", [("grpc", "fp32"), ("tcp", "fp32"), ("tcp", "bf16")])
def test_a_sparse_push_applies_exactly_the_sent_entries_and_paces_their_bytes(shards, transport, dtype):
    cfg = RunConfig(mode="async", workers=1, servers=1, link="10gbit", optim=OptimConfig(lr=0.5, momentum=0.0))
    (address,), (core,) = shards(cfg)
    lk, n = link.parse(cfg.link), 1000
    client = make_client(transport, [address], 0, n, dtype, link=lk, topk=0.01)
    grad = torch.linspace(-1, 1, n)  # the largest magnitudes at both ends
    try:
        client.init(torch.zeros(n))
        client.pull(0, torch.empty(n))
        _, _, sent = client.push(0, grad)
    finally:
        client.close()
    idx = torch.tensor([0, 1, 2, 3, 4, 995, 996, 997, 998, 999])
    on_wire = torch.zeros(n)
    on_wire[idx] = grad[idx].to(torch.bfloat16 if dtype == "bf16" else torch.float32).float()
    assert torch.equal(core.param, -0.5 * on_wire)  # SGD, lr 0.5, no momentum, from zero
    assert torch.equal(client.sparsifier.residual, grad - on_wire)
    nbytes = 10 * (4 + (2 if dtype == "bf16" else 4))
    assert sent == nbytes == core.stats()["bytes_in"]
    # --link paced exactly the sparse bytes: the worker's sends, and the shard's NIC (init, then the push).
    assert client.transport.send.wire_s == pytest.approx(nbytes * lk.seconds_per_byte, rel=1e-9)
    assert core.link_in.wire_s == pytest.approx((4 * n + nbytes) * lk.seconds_per_byte, rel=1e-9)


# (header's sparse_count, chunks of (indices, values)) -> the message a refusal carries on each transport.
BAD = [
    (2, [([3, 10], [1.0, 1.0])], "index 10 out of range", "index 10 out of range"),
    (2, [([-1, 3], [1.0, 1.0])], "index -1 out of range", "index -1 out of range"),
    (2, [([3, 3], [1.0, 1.0])], "strictly increasing", "strictly increasing"),
    (2, [([5], [1.0]), ([2], [1.0])], "across chunks", "strictly increasing"),
    (2, [([1, 2], [1.0])], "counts differ", "payload of 12 bytes"),
    (3, [([1, 2], [1.0, 1.0])], "2 of the 3 entries", "payload of 16 bytes"),
    (1, [([1, 2], [1.0, 1.0])], "more than the 1 entries", "payload of 16 bytes"),
    (11, [([1], [1.0])], "11 entries for a shard of 10", "11 entries for a shard of 10"),
    (2, [([1, 2], [float("nan"), 1.0])], "non-finite", "non-finite"),
]


def sparse_header(count: int) -> pb.TensorHeader:
    return pb.TensorHeader(worker_id=0, dtype=pb.FP32, shard=0, num_elements=10, sparse_count=count)


def raw(indices: list[int], values: list[float]) -> tuple[bytes, bytes]:
    return (torch.tensor(indices, dtype=torch.int32).numpy().tobytes(),
            torch.tensor(values, dtype=torch.float32).numpy().tobytes())


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_bad_sparse_pushes_are_invalid_argument_and_change_nothing(shard_servers, transport):
    (server,) = shard_servers(RunConfig(mode="async", workers=2, servers=1, steps=100))
    core = server.shard
    open_start_barrier(core)
    client = make_client("grpc", [f"127.0.0.1:{server.port}"], 0, 10)
    client.wait_ready()
    client.init(torch.arange(10, dtype=torch.float32))
    before = core.param.detach().numpy().tobytes()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=10)
    try:
        for count, chunks, grpc_message, tcp_message in BAD + [(2, "dense", "sparse chunks only", None)]:
            if transport == "grpc":
                body = [pb.TensorChunk(data=b"\0" * 8)] if chunks == "dense" else [
                    pb.TensorChunk(sparse=pb.SparseChunk(indices=i, values=v)) for i, v in (raw(*c) for c in chunks)]
                with pytest.raises(grpc.RpcError) as err:
                    pb_grpc.ParameterShardStub(channel).Push(iter([pb.TensorChunk(header=sparse_header(count))] + body),
                                                             timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, chunks
                assert grpc_message in err.value.details(), err.value.details()
            elif chunks != "dense":
                pieces = [raw(*c) for c in chunks]
                fr.send_frame(sock, fr.PUSH, sparse_header(count).SerializeToString(),
                              memoryview(b"".join(i for i, _ in pieces) + b"".join(v for _, v in pieces)))
                op, reply, _ = fr.recv_head(sock)
                assert op == fr.ERROR and reply.decode().startswith("INVALID_ARGUMENT: ")
                assert tcp_message in reply.decode(), reply.decode()
            assert core.param.detach().numpy().tobytes() == before and core.policy.version == 0
            assert core.policy.clocks == [0, 0] and core.stats()["bytes_in"] == 0
        # A good one is taken after all that (on TCP: refusals before and after the payload was read
        # both left the connection in step).
        if transport == "grpc":
            chunk = pb.SparseChunk(indices=raw([4], [1.0])[0], values=raw([4], [1.0])[1])
            reply = pb_grpc.ParameterShardStub(channel).Push(
                iter([pb.TensorChunk(header=sparse_header(1)), pb.TensorChunk(sparse=chunk)]), timeout=10)
            assert reply.version == 1
        else:
            fr.send_frame(sock, fr.PUSH, sparse_header(1).SerializeToString(), memoryview(b"".join(raw([4], [1.0]))))
            assert fr.recv_head(sock)[0] == fr.PUSHED
        assert core.policy.version == 1 and core.param[4] < 4 and core.param[3] == 3
    finally:
        sock.close()
        channel.close()
        client.close()


@pytest.mark.parametrize("flags,message", [
    (["--topk", "0"], "--topk must be a fraction in (0, 1]"),
    (["--topk", "1.5"], "--topk must be a fraction in (0, 1]"),
    (["--topk", "nan"], "--topk must be a fraction in (0, 1]"),
    (["--topk", "0.1", "--mode", "allreduce"], "--mode allreduce reduces dense gradients"),
    (["--topk", "0.1", "--local-steps", "4"], "use one or the other"),
    (["--no-error-feedback"], "give --topk a fraction below 1"),
    (["--topk-momentum-correction"], "give --topk a fraction below 1"),
    (["--topk-warmup-epochs", "2"], "give --topk a fraction below 1"),
    (["--topk", "0.1", "--topk-momentum-correction", "--no-error-feedback"], "drop --no-error-feedback"),
    (["--topk", "0.1", "--topk-momentum-correction", "--optimizer", "adamw"], "use --optimizer sgd"),
    (["--topk", "0.1", "--topk-momentum-correction", "--nesterov"], "use --optimizer sgd"),
    (["--topk", "0.1", "--topk-warmup-epochs", "-1"], "--topk-warmup-epochs must be >= 0"),
])
def test_bad_topk_is_a_one_line_usage_error(flags, message):
    r = psgd_main("run", *flags)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert validate(RunConfig(topk=0.01, no_error_feedback=True)).topk == 0.01


def test_momentum_correction_accumulates_the_velocity_and_masks_what_was_sent():
    """Deep Gradient Compression's momentum correction by hand, one shard of 4, one entry a push,
    m = 0.5: u = m u + g; acc = residual + u; the top entry of acc is sent and zeroed in both acc
    and u. Every number below is exact in fp32."""
    s = sparsify.Sparsifier([(0, 4)], sparsify.TopK(0.25, momentum=0.5))
    steps = [  # gradient, (index, value) sent, residual after, velocity after
        ([1.0, -3.0, 0.5, 2.0], (1, -3.0), [1.0, 0.0, 0.5, 2.0], [1.0, 0.0, 0.5, 2.0]),
        ([1.0, 1.0, 1.0, -1.0], (0, 2.5), [0.0, 1.0, 1.75, 2.0], [0.0, 1.0, 1.25, 0.0]),
        ([0.0, 0.0, 0.0, 0.0], (2, 2.375), [0.0, 1.5, 0.0, 2.0], [0.0, 0.5, 0.0, 0.0]),
    ]
    for clock, (grad, (i, v), residual, velocity) in enumerate(steps):
        sp = s.compress(0, torch.tensor(grad), "fp32", clock)
        assert sp.indices.tolist() == [i] and sp.values.tolist() == [v], clock
        assert s.residual.tolist() == residual and s.velocity.tolist() == velocity, clock
    # Without momentum the same spec is the plain error feedback of a bare fraction, bit for bit.
    plain, spec = sparsify.Sparsifier([(0, 4)], 0.25), sparsify.Sparsifier([(0, 4)], sparsify.TopK(0.25))
    for grad, *_ in steps:
        a, b = plain.compress(0, torch.tensor(grad), "fp32"), spec.compress(0, torch.tensor(grad), "fp32")
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert spec.velocity is None and torch.equal(plain.residual, spec.residual)


def test_warmup_sends_exponentially_less_for_its_epochs_then_the_fraction():
    spec = sparsify.TopK(0.01, warmup_epochs=4, pushes_per_epoch=10)
    assert [spec.density(c) for c in (0, 9, 10, 19, 20, 30, 39, 40, 1000)] == [
        0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.01, 0.01, 0.01, 0.01]  # 0.25^4 < 1%: the target
    assert [sparsify.TopK(0.1, warmup_epochs=3, pushes_per_epoch=2.5).density(c) for c in (0, 2, 3, 5)] == [
        0.25, 0.25, 0.1, 0.1]
    assert sparsify.TopK(0.5, warmup_epochs=2).density(0) == 0.5      # never less than the fraction
    s = sparsify.Sparsifier([(0, 1000), (1000, 1200)], spec)
    for clock, expect in [(0, [250, 50]), (10, [63, 13]), (20, [16, 3]), (35, [10, 2])]:  # round half up
        assert [s.count_at(k, clock) for k in (0, 1)] == expect
        for k, (a, b) in enumerate(s.ranges):
            sp = s.compress(k, torch.randn(b - a), "fp16", clock)
            assert sp.indices.numel() == expect[k] and s.nbytes(k, "fp16") == sp.nbytes == expect[k] * 6


def test_assemble_moves_the_momentum_to_the_workers_and_counts_warmup_epochs_in_pushes():
    data = DataConfig(dataset="synthetic", num_samples=500)
    cfg = validate(RunConfig(mode="sync", workers=2, batch_size=8, topk=0.05, topk_momentum_correction=True,
                             topk_warmup_epochs=2, optim=OptimConfig(lr=0.1, momentum=0.9), data=data))
    assert assemble.topk(cfg) == sparsify.TopK(0.05, True, 0.9, 2.0, data_mod.train_size(data) / 16)
    opt = assemble.shard_optimizer(cfg)(torch.nn.Parameter(torch.zeros(3)))
    assert opt.cfg.momentum == 0.0 and opt.cfg.lr == 0.1
    plain = validate(RunConfig(mode="sync", topk=0.05, optim=OptimConfig(momentum=0.9)))
    assert assemble.topk(plain) == sparsify.TopK(0.05) and assemble.topk(RunConfig()) is None
    assert assemble.shard_optimizer(plain)(torch.nn.Parameter(torch.zeros(3))).cfg.momentum == 0.9


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_warmup_and_momentum_correction_on_a_real_shard(shards, transport):
    """Each push's header announces the count its payload has (the shard refuses any other), and
    the shard, without momentum, applies exactly what the worker's velocity sent."""
    cfg = RunConfig(mode="async", workers=1, servers=1, optim=OptimConfig(lr=0.5, momentum=0.0))
    (address,), (core,) = shards(cfg)
    n, spec = 1000, sparsify.TopK(0.01, momentum=0.9, warmup_epochs=1, pushes_per_epoch=2)
    client = make_client(transport, [address], 0, n, "fp32", topk=spec)
    mirror = sparsify.Sparsifier([(0, n)], spec)
    gen = torch.Generator().manual_seed(5)
    expect, sent_bytes = torch.zeros(n), []
    try:
        client.init(torch.zeros(n))
        for clock in range(4):
            client.pull(clock, torch.empty(n))
            grad = torch.randn(n, generator=gen)
            _, refused, sent = client.push(clock, grad)
            assert not refused
            sent_bytes.append(sent)
            sp = mirror.compress(0, grad, "fp32", clock)
            expect[sp.indices.long()] -= 0.5 * sp.values
    finally:
        client.close()
    assert sent_bytes == [250 * 8, 250 * 8, 10 * 8, 10 * 8] and core.stats()["bytes_in"] == sum(sent_bytes)
    assert torch.allclose(core.param, expect, rtol=0, atol=1e-6)
    assert torch.equal(client.sparsifier.velocity, mirror.velocity)
