"""psgd/ps/rows_tcp.py: sparse pulls and pushes by key over TCP (loopback, port 0): the same training as
local row stores bit for bit, the bytes it moves, and every bad request refused with the shard unchanged."""

import copy
import functools
import socket

import pytest
import torch
import torch.nn.functional as F

from psgd.core import rows
from psgd.core.config import DataConfig, ModelConfig
from psgd.core.rowoptim import RowAdagrad
from psgd.ps import rows_tcp
from psgd.ps.rows_tcp import RemoteStore, RowClient, RowWireError
from psgd.train import data, models, rowtrain

OPT = functools.partial(RowAdagrad, lr=0.05)


@pytest.fixture
def served():
    """A DLRM's tables on 2 shards (hash), each shard's stores behind its own row server."""
    ds = data.load(DataConfig(dataset="clicks", num_samples=1000))
    model = models.build(ModelConfig(model="dlrm", width=4), ds.input_dim, ds.num_classes, seed=0)
    stores = rowtrain.make_stores(model, 2, "hash", OPT)
    servers = [rows_tcp.serve([table[k] for table in stores]) for k in range(2)]
    clients = [RowClient(f"127.0.0.1:{s.port}") for s in servers]
    yield ds, model, stores, servers, clients
    for c in clients:
        c.close()
    for s in servers:
        s.close()


def _remote(stores, clients):
    return [[RemoteStore(clients[k], t, table[k].partition, table[k].dim) for k in range(len(clients))]
            for t, table in enumerate(stores)]


def _train(model, stores, ds, steps=8):
    worker = rowtrain.SparseRows(model, stores, rank=0)
    stale = []
    for step in range(steps):
        x, y = ds.x_train[step * 16:(step + 1) * 16], ds.y_train[step * 16:(step + 1) * 16]
        F.cross_entropy(model(x), y).backward()
        stale += worker.push()
    return worker, stale


def test_training_over_the_wire_equals_training_on_local_stores(served):
    ds, model, stores, servers, clients = served
    local_model = copy.deepcopy(model)
    local = rowtrain.make_stores(local_model, 2, "hash", OPT)
    _train(local_model, local, ds)
    worker, stale_wire = _train(model, _remote(stores, clients), ds)
    for a, b in zip(stores, local, strict=True):
        assert torch.equal(rowtrain.assemble(a), rowtrain.assemble(b))  # fp32 on the wire: exact
    # Bytes: a request and its answer are a prefix each, the ids and the rows; nothing else.
    on_wire = sum(c.bytes_sent + c.bytes_received for c in clients)
    requests = sum(c.requests for c in clients)
    assert on_wire == worker.bytes_pulled + worker.bytes_pushed + 2 * rows_tcp.PREFIX.size * requests
    assert worker.bytes_pulled == sum(s.bytes_out for t in stores for s in t)
    # The shards counted the same per-row staleness as the local stores (the wire brings none back).
    assert all(len(s) == 0 for s in stale_wire)
    for k, c in enumerate(clients):
        stats = c.stats()
        assert [s["rows"] for s in stats] == [len(table[k].ids) for table in stores]
        assert [s["staleness"] for s in stats] == [{str(v): n for v, n in sorted(t[k].clock.histogram.items())}
                                                   for t in local]
        assert [s["bytes_out"] for s in stats] == [table[k].bytes_out for table in stores]


def _state(stores):
    return [(rowtrain.assemble(t), [s.clock.updates.clone() for s in t], [s.optimizer.sum.clone() for s in t])
            for t in stores]


def _same(a, b):
    return all(torch.equal(x, y) for (ta, ua, sa), (tb, ub, sb) in zip(a, b, strict=True)
               for x, y in [(ta, tb), *zip(ua, ub, strict=True), *zip(sa, sb, strict=True)])


def test_bad_requests_get_invalid_argument_and_change_nothing(served):
    ds, model, stores, servers, clients = served
    c = clients[0]
    mine = stores[0][0].ids[:3]
    other = stores[0][1].ids[0]
    dim = stores[0][0].dim
    c.pull(0, 0, mine, dim)
    before = _state(stores)
    bad = [
        (lambda: c.pull(len(stores), 0, mine, dim), "table 8 does not exist"),
        (lambda: c.push(0, 0, mine, torch.ones(3, dim), count=4), "4 rows need a payload of"),
        (lambda: c.push(0, 0, mine, torch.ones(2, dim)), "3 rows need a payload of"),
        (lambda: c.push(0, 0, torch.tensor([mine[0], 10**6]), torch.ones(2, dim)), "out of range"),
        (lambda: c.push(0, 0, mine[[0, 0, 1]], torch.ones(3, dim)), "distinct and sorted"),
        (lambda: c.push(0, 0, torch.sort(torch.tensor([mine[0], other])).values, torch.ones(2, dim)),
         "held by shard 1"),
        (lambda: c.push(0, 7, mine, torch.ones(3, dim)), "never pulled"),
        (lambda: c.push(0, 0, stores[0][0].ids[3:4], torch.ones(1, dim)), "which its last pull did not read"),
    ]
    for call, message in bad:
        with pytest.raises(RowWireError, match=message) as e:
            call()
        assert e.value.status == "INVALID_ARGUMENT"
    assert _same(before, _state(stores))
    assert torch.equal(c.pull(0, 0, mine, dim), stores[0][0].block[:3])  # the connection still serves


def test_an_oversized_payload_closes_the_connection_and_the_server_goes_on(served):
    ds, model, stores, servers, clients = served
    with socket.create_connection(("127.0.0.1", servers[0].port)) as s:
        s.sendall(rows_tcp.PREFIX.pack(rows_tcp.PUSH, 0, 0, 1, 1 << 62))
        head = s.recv(rows_tcp.PREFIX.size, socket.MSG_WAITALL)
        op, *_, length = rows_tcp.PREFIX.unpack(head)
        assert op == rows_tcp.ERROR and b"more than any request" in s.recv(length, socket.MSG_WAITALL)
        assert s.recv(1) == b""  # closed
    assert clients[0].stats()


def test_the_token_gates_every_request():
    table = torch.zeros(10, 2)
    store = rowtrain.RowStore(rows.RowPartition(10, 1), 0, table, OPT)
    srv = rows_tcp.serve([store], token=b"secret")
    try:
        with pytest.raises(RowWireError, match="UNAUTHENTICATED"):
            RowClient(f"127.0.0.1:{srv.port}", token=b"wrong")
        anonymous = RowClient(f"127.0.0.1:{srv.port}")
        with pytest.raises(RowWireError, match="UNAUTHENTICATED: send HELLO"):
            anonymous.pull(0, 0, torch.tensor([1]), 2)
        anonymous.close()
        ok = RowClient(f"127.0.0.1:{srv.port}", token=b"secret")
        assert torch.equal(ok.pull(0, 0, torch.tensor([1, 2]), 2), torch.zeros(2, 2))
        ok.close()
    finally:
        srv.close()
