"""psgd/ps/rows_tcp.py and rows_grpc.py: sparse pulls and pushes by key over TCP and gRPC (loopback,
port 0): the same training as local row stores bit for bit, the bytes it moves, and every bad
request refused with the shard unchanged."""

import copy
import functools
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from psgd.core import rows
from psgd.core.config import DataConfig, ModelConfig
from psgd.core.rowoptim import RowAdagrad
from psgd.core.rowstore import RowStore
from psgd.ps import rows_grpc, rows_tcp, transport
from psgd.ps.rows_tcp import RowClient, RowWireError
from psgd.train import data, models, rowtrain

OPT = functools.partial(RowAdagrad, lr=0.05)


WIRES = {"tcp": (rows_tcp.serve, RowClient), "grpc": (rows_grpc.serve, rows_grpc.connect),
         # TCP's row service as a run's shard starts it (with the transports' upgrades), its frames
         # through a shm doorbell once the client attached (psgd/ps/shm/rows.py)
         "shm": (functools.partial(rows_tcp.serve, upgrades=transport.row_upgrades()), transport.row_client("shm"))}


def _served(wire: str):
    """A DLRM's tables on 2 shards (hash), each shard's stores behind its own row server."""
    ds = data.load(DataConfig(dataset="clicks", num_samples=1000))
    model = models.build(ModelConfig(model="dlrm", width=4), ds.input_dim, ds.num_classes, seed=0)
    shards, partitions = rowtrain.make_local(model, 2, "hash", OPT)
    serve, connect = WIRES[wire]
    servers = [serve(s.stores) for s in shards]
    clients = [connect(f"127.0.0.1:{s.port}") for s in servers]
    yield ds, model, shards, partitions, servers, clients
    for c in clients:
        c.close()
    for s in servers:
        s.close()


@pytest.fixture(params=sorted(WIRES))
def served(request):
    """The protocol over TCP (rows_tcp.py), gRPC (rows_grpc.py) and shm: the same tests for each."""
    yield from _served(request.param)


@pytest.fixture
def served_tcp():
    yield from _served("tcp")


def _train(model, shards, partitions, ds, prefetch, steps=8):
    worker = rowtrain.SparseRows(model, shards, partitions, rank=0)
    for step in range(steps):
        x, y = ds.x_train[step * 16:(step + 1) * 16], ds.y_train[step * 16:(step + 1) * 16]
        if prefetch:
            worker.prefetch({f: x[:, f] for f in range(x.shape[1])})
        F.cross_entropy(model(x), y).backward()
        worker.push()
    return worker


@pytest.mark.parametrize("prefetch", [False, True])
def test_training_over_the_wire_equals_training_on_local_stores(served, prefetch):
    ds, model, shards, partitions, servers, clients = served
    local_model = copy.deepcopy(model)
    local, _ = rowtrain.make_local(local_model, 2, "hash", OPT)
    _train(local_model, local, partitions, ds, prefetch)
    def counts():
        return [sum(getattr(c, a) for c in clients) for a in ("bytes_sent", "bytes_received", "requests", "entries")]

    before = counts()
    worker = _train(model, clients, partitions, ds, prefetch)
    sent, received, requests, entries = (a - b for a, b in zip(counts(), before, strict=True))
    for t in range(len(partitions)):
        assert torch.equal(rowtrain.assemble(shards, t), rowtrain.assemble(local, t))  # fp32 on the wire: exact
    # Bytes: a request and its answer are a prefix each, a directory entry per table asked, the ids
    # and the rows; nothing else. Prefetched, a step is one pull and one push per shard.
    assert sent + received == (worker.bytes_pulled + worker.bytes_pushed + 2 * rows_tcp.PREFIX.size * requests
                               + rows_tcp.ENTRY.size * entries)
    assert worker.bytes_pulled == sum(st.bytes_out for s in shards for st in s.stores)
    if prefetch:
        assert requests == 8 * 2 * 2
    else:
        assert requests > 8 * 2 * 2
    # The shards counted the same per-row staleness as the local stores.
    for k, c in enumerate(clients):
        stats = c.stats()
        assert [s["rows"] for s in stats] == [len(st.ids) for st in shards[k].stores]
        assert [s["staleness"] for s in stats] == [{str(v): n for v, n in sorted(st.clock.histogram.items())}
                                                   for st in local[k].stores]



def _state(shards):
    return [(st.block.clone(), st.clock.updates.clone(), st.optimizer.sum.clone(), st.bytes_in, st.bytes_out)
            for s in shards for st in s.stores]


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


def _raw(port, op, worker, directory, payload=b""):
    """A hand-made request: (op, payload) of the answer."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        body = b"".join(rows_tcp.ENTRY.pack(t, n) for t, n in directory) + payload
        s.sendall(rows_tcp.PREFIX.pack(op, worker, len(directory), len(body)) + body)
        rop, _, _, length = rows_tcp.PREFIX.unpack(s.recv(rows_tcp.PREFIX.size, socket.MSG_WAITALL))
        return rop, s.recv(length, socket.MSG_WAITALL) if length else b""


def test_bad_requests_get_invalid_argument_and_change_nothing(served):
    ds, model, shards, partitions, servers, clients = served
    c = clients[0]
    s0 = shards[0].stores
    mine, other = s0[0].ids[:3], shards[1].stores[0].ids[0]
    dim = s0[0].dim
    ones = torch.ones(3, dim)
    c.pull(0, [(0, mine), (1, s0[1].ids[:2])])
    before = _state(shards)
    bad = [
        (lambda: c.pull(0, [(len(s0), mine)]), "each must be distinct and below 8"),
        (lambda: c.pull(0, [(0, mine), (0, mine)]), "each must be distinct"),
        (lambda: c.push(0, [(0, mine, torch.ones(2, dim))]),
         f"need {3 * (8 + 4 * dim)} bytes after it, got {3 * 8 + 2 * 4 * dim}"),
        (lambda: c.push(0, [(0, torch.tensor([mine[0], 10**6, 10**6 + 1]), ones)]), "out of range"),
        (lambda: c.push(0, [(0, mine[[0, 0, 1]], ones)]), "distinct and sorted"),
        (lambda: c.push(0, [(0, torch.sort(torch.tensor([mine[0], other, mine[1]])).values, ones)]),
         "held by shard 1"),
        (lambda: c.push(7, [(0, mine, ones)]), "never pulled"),
        (lambda: c.push(0, [(0, s0[0].ids[3:6], ones)]), "which its last pull did not read"),
        # One good table and one bad: neither is applied.
        (lambda: c.push(0, [(1, s0[1].ids[:2], torch.ones(2, dim)), (0, s0[0].ids[3:6], ones)]), "did not read"),
    ]
    for call, message in bad:
        with pytest.raises(RowWireError, match=message) as e:
            call()
        assert e.value.status == "INVALID_ARGUMENT"
    if isinstance(c.sock, socket.socket):
        assert _rawcheck(servers[0].port)  # frames no client would send, on the raw TCP socket
    assert _same(before, _state(shards))
    assert torch.equal(c.pull(0, [(0, mine)])[0], s0[0].block[:3])  # the connection still serves


def _rawcheck(port):
    """Requests no client would send: no table, a directory longer than the payload, an unknown op."""
    answers = [_raw(port, rows_tcp.PULL, 0, []), _raw(port, rows_tcp.PULL, 0, [(0, 5)], b"\0" * 8),
               _raw(port, 9, 0, [])]
    assert [op for op, _ in answers] == [rows_tcp.ERROR] * 3
    assert b"INVALID_ARGUMENT: a request names 1 to 8 tables, got 0" in answers[0][1]
    assert b"need 40 bytes after it, got 8" in answers[1][1]
    assert answers[2][1].startswith(b"UNIMPLEMENTED")
    return True


def test_an_oversized_payload_closes_the_connection_and_the_server_goes_on(served_tcp):
    ds, model, shards, partitions, servers, clients = served_tcp
    with socket.create_connection(("127.0.0.1", servers[0].port)) as s:
        s.sendall(rows_tcp.PREFIX.pack(rows_tcp.PUSH, 0, 1, 1 << 62))
        op, *_, length = rows_tcp.PREFIX.unpack(s.recv(rows_tcp.PREFIX.size, socket.MSG_WAITALL))
        assert op == rows_tcp.ERROR and b"more than any request" in s.recv(length, socket.MSG_WAITALL)
        assert s.recv(1) == b""  # closed
    assert clients[0].stats()


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_the_token_gates_every_request(wire):
    serve, connect = WIRES[wire]
    store = RowStore(rows.RowPartition(10, 1), 0, torch.zeros(10, 2), OPT)
    srv = serve([store], token=b"secret")
    try:
        with pytest.raises(RowWireError, match="UNAUTHENTICATED: wrong token"):
            connect(f"127.0.0.1:{srv.port}", token=b"wrong")
        with pytest.raises(RowWireError, match="UNAUTHENTICATED: send HELLO"):
            connect(f"127.0.0.1:{srv.port}")
        ok = connect(f"127.0.0.1:{srv.port}", token=b"secret")
        assert torch.equal(ok.pull(0, [(0, torch.tensor([1, 2]))])[0], torch.zeros(2, 2))
        with pytest.raises(RowWireError, match="INVALID_ARGUMENT"):  # refused; the next request is served
            ok.pull(0, [(3, torch.tensor([1]))])
        assert torch.equal(ok.pull(0, [(0, torch.tensor([3]))])[0], torch.zeros(1, 2))
        ok.close()
    finally:
        srv.close()


def test_fused_tables_over_the_wire_equal_fused_tables_here():
    ds = data.load(DataConfig(dataset="clicks", num_samples=1000))
    model = models.build(ModelConfig(model="dlrm", width=4), ds.input_dim, ds.num_classes, seed=0)
    here_model = copy.deepcopy(model)
    served, partitions = rowtrain.make_local(model, 2, "hash", OPT, fused=True)
    here, _ = rowtrain.make_local(here_model, 2, "hash", OPT, fused=True)
    servers = [rows_tcp.serve(s.stores) for s in served]
    clients = [RowClient(f"127.0.0.1:{s.port}") for s in servers]
    try:
        _train(here_model, here, partitions, ds, prefetch=True)
        _train(model, clients, partitions, ds, prefetch=True)
        assert torch.equal(rowtrain.assemble(served, 0), rowtrain.assemble(here, 0))
        assert sum(c.entries for c in clients) == 8 * 2 * 2  # one table entry per request
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()


def test_a_grpc_reply_that_never_comes_is_a_deadline_not_a_hang():
    """A sync round held for a worker that never pushes: the server holds the pull (its own deadline
    60 s), the gRPC client gives up at its own (0.3 s) with DEADLINE_EXCEEDED, as a TCP socket would."""
    from psgd.core.rowrounds import RowRounds

    store = RowStore(rows.RowPartition(10, 1), 0, torch.zeros(10, 2), OPT)
    srv = rows_grpc.serve([store], rounds=RowRounds([store], "sync", workers=2))
    try:
        c = rows_grpc.connect(f"127.0.0.1:{srv.port}", timeout=0.3)
        c.pull(0, [(0, torch.tensor([1]))])
        c.push(0, [(0, torch.tensor([1]), torch.ones(1, 2))])  # round 0 waits for worker 1's push
        with pytest.raises(RowWireError, match="DEADLINE_EXCEEDED"):
            c.pull(0, [(0, torch.tensor([1]))])
        c.close()
    finally:
        srv.close()


def test_a_grpc_worker_that_goes_silent_after_a_refusal_stops_holding_up_its_round():
    """Over gRPC a refusal ends the stream (its status); a worker that then sends nothing more is
    gone once half the server's deadline passed, as a closed TCP connection is at once: the sync
    round it held up closes and the other worker's pull is answered, not refused at its deadline."""
    from psgd.core.rowrounds import RowRounds

    store = RowStore(rows.RowPartition(10, 1), 0, torch.zeros(10, 2), OPT)
    srv = rows_grpc.serve([store], rounds=RowRounds([store], "sync", workers=2), timeout=2.0)
    try:
        a, b = (rows_grpc.connect(f"127.0.0.1:{srv.port}") for _ in range(2))
        for w, c in enumerate((a, b)):
            c.pull(w, [(0, torch.tensor([1]))])
        with pytest.raises(RowWireError, match="INVALID_ARGUMENT"):
            b.push(1, [(0, torch.tensor([2]), torch.ones(1, 2))])  # a row its pull did not read
        b.close()  # and worker 1 is heard of no more
        a.push(0, [(0, torch.tensor([1]), torch.ones(1, 2))])
        a.pull(0, [(0, torch.tensor([1]))])  # answered: the round closed without worker 1
        assert srv.rounds.version == 1 and 1 not in srv.rounds.active
        a.close()
    finally:
        srv.close()


def test_rows_over_shm_ride_a_doorbell_grow_their_segment_and_refuse_a_bad_attach():
    """After its set-up over TCP a shm row client's frames go through its segment (the TCP socket
    only wakes and says EOF); a pull whose answer outgrows the segment attaches a larger one first;
    a segment the service will not map is refused in one line, the connection as it was."""
    from psgd.ps.shm import rows as shm_rows
    from psgd.ps.shm import segment

    width = 64
    table = torch.randn(2000, width)
    store = RowStore(rows.RowPartition(2000, 1), 0, table, OPT)
    serve, connect = WIRES["shm"]
    srv = serve([store])
    c = connect(f"127.0.0.1:{srv.port}")
    try:
        assert isinstance(c.sock, shm_rows.BellSock) and c.sock.segment.size == shm_rows.MIN_SEGMENT
        small = c.pull(0, [(0, torch.arange(10))])[0]
        assert torch.equal(small, table[:10])
        ids = torch.arange(0, 2000, 2)  # 1,000 rows x 256 bytes: more than 64 KiB back
        assert torch.equal(c.pull(0, [(0, ids)])[0], table[ids])
        assert c.sock.segment.size >= len(ids) * width * 4
        every = torch.arange(2000)  # the largest answer: grown to at most what the service maps (a push of every row)
        assert torch.equal(c.pull(0, [(0, every)])[0], table) and c.sock.segment.size <= c.limit + 4096
        c.push(0, [(0, ids, torch.ones(len(ids), width))])
        assert not torch.equal(c.pull(0, [(0, ids[:3])])[0], table[ids[:3]])  # the push was applied
        with c.sock.raw.dup() as dup:  # nothing of the frames is on the TCP socket: at most wake-up bytes
            dup.setblocking(False)
            try:
                waiting = dup.recv(1 << 16, socket.MSG_PEEK)
            except BlockingIOError:
                waiting = b""
            assert set(waiting) <= {1, 2}, waiting[:40]
        c._send(shm_rows.ATTACH, 0, 0, b"psgd-1-0000000000000000")  # no such file
        with pytest.raises(RowWireError, match="FAILED_PRECONDITION: cannot open") as e:
            c._answer()
        assert e.value.status == "FAILED_PRECONDITION"
        assert c.stats()[0]["rows"] == 2000  # the same connection, the same segment, still served
    finally:
        c.close()
        srv.close()
    assert not [n for n in os.listdir(segment.ROOT) if n.startswith(f"psgd-{os.getpid()}-")]
