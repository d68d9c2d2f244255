"""The shm doorbell (psgd/ps/shm/bell.py): a connection's frames in the segment's last page.

Frames in order both ways, a reader that sleeps woken by the socket, a wake-up that never came
recovered by the reader's own look at the counter, EOF and deadlines, a header cut to its
mailbox; then the transport on both carriers and both PushPull paths, bit for bit as tcp.
"""

import socket

import numpy as np
import pytest
import torch

from psgd.core.config import RunConfig
from psgd.core.errors import ExchangeError
from psgd.ps.client import make_client
from psgd.ps.shm import bell

pytestmark = pytest.mark.skipif(not bell.available(), reason="the doorbell is x86-64 only (its memory order)")


@pytest.fixture
def ends():
    """A worker's and a shard's Bell over one page and a socketpair, neither spinning."""
    page = np.zeros(bell.PAGE_BYTES, dtype=np.uint8)
    a, b = socket.socketpair()
    yield bell.Bell(page, a, worker=True, spin_s=0.0), bell.Bell(page, b, worker=False, spin_s=0.0), page
    a.close()
    b.close()


def test_frames_go_both_ways_in_order(ends):
    worker, shard, _ = ends
    for clock in range(3):  # a request, its reply, the next request: one frame in each mailbox at a time
        worker.send(3, b"push %d" % clock, 316)
        assert shard.recv_head() == (3, b"push %d" % clock, 316)
        shard.send(0x82, b"pulled", 12 + clock)
        assert worker.recv_head(timeout=5) == (0x82, b"pulled", 12 + clock)


def test_a_sleeping_reader_is_woken_by_the_socket(ends):
    worker, shard, page = ends
    box = page[:bell.BOX_BYTES].view(np.int64)
    box[bell.ASLEEP] = 1  # the shard said it sleeps: the writer rings
    worker.send(1, b"x", 0)
    assert shard.sock.recv(8) == b"\x01"


def test_a_lost_wake_up_costs_one_look_not_the_frame(ends):
    worker, shard, page = ends
    box = page[:bell.BOX_BYTES].view(np.int64)
    box[bell.OP], box[bell.HLEN], box[bell.PLEN], box[bell.SEQ] = 7, 0, 5, 1  # written, never rung
    assert shard.recv_head() == (7, b"", 5)


def test_eof_ends_the_wait_and_a_deadline_raises(ends):
    worker, shard, _ = ends
    with pytest.raises(TimeoutError):
        worker.recv_head(timeout=0.01)
    worker.sock.shutdown(socket.SHUT_RDWR)
    assert shard.recv_head() is None


def test_a_header_longer_than_the_mailbox_is_cut(ends):
    worker, shard, _ = ends
    shard.send(0xFF, b"e" * 5000, 0)
    op, header, _ = worker.recv_head(timeout=5)
    assert op == 0xFF and header == b"e" * bell.MAX_HEADER


def test_consumed_calls_the_waiting_worker_once_awake_or_asleep(ends):
    worker, shard, page = ends
    calls = []
    worker.send(3, b"push", 8)
    assert shard.recv_head() == (3, b"push", 8)
    with pytest.raises(TimeoutError):  # no word from the shard yet: no call
        worker.recv_head(timeout=0.01, on_consumed=lambda: calls.append(1))
    assert calls == []
    shard.consumed()  # the worker sleeps (spin 0): ASLEEP is down between its waits, so no ring here
    shard.send(0x82, b"", 8)
    assert worker.recv_head(timeout=5, on_consumed=lambda: calls.append(2)) == (0x82, b"", 8)
    assert calls == []  # the reply was there at once: the worker zeroes before its next backward instead
    worker.send(3, b"again", 8)
    assert shard.recv_head() == (3, b"again", 8)
    box = page[bell.BOX_BYTES:].view(np.int64)
    box[bell.ASLEEP] = 1  # as if the worker slept in its wait: consumed rings the socket
    shard.consumed()
    assert worker.sock.recv(8) == b"\x02"
    box[bell.ASLEEP] = 0
    with pytest.raises(TimeoutError):
        worker.recv_head(timeout=0.01, on_consumed=lambda: calls.append(3))
    assert calls == [3]  # called once, and the wait for the reply went on


def exchange(addresses, n, dtype, combined):
    client = make_client("shm" if combined != "tcp" else "tcp", addresses, 0, n, wire_dtype=dtype)
    try:
        client.wait_ready()
        client.init(torch.linspace(-1, 1, n))
        out = torch.empty(n)
        client.pull(0, out)
        for clock in range(3):
            client.push_pull(clock, torch.linspace(0, 2, n) * (clock + 1), out)
        return out.clone(), client.versions
    finally:
        client.close()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_push_pull_over_the_bell_equals_tcp_and_so_do_plain_segments(shards, monkeypatch, dtype):
    n = 300_001
    cfg = RunConfig(mode="async", workers=1, servers=2, steps=100)
    want = exchange(shards(cfg)[0], n, dtype, "tcp")
    assert want[1] == [3, 3]
    got = exchange(shards(cfg)[0], n, dtype, "bell")
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    monkeypatch.setattr(bell, "available", lambda: False)  # ATTACH: frames on the socket, payloads in memory
    got = exchange(shards(cfg)[0], n, dtype, "plain")
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_a_refused_push_pull_is_one_line_and_the_next_one_works(shards):
    addresses, cores = shards(RunConfig(mode="async", workers=1, servers=1, steps=100))
    client = make_client("shm", addresses, 0, 4)
    try:
        client.init(torch.zeros(4))
        out = torch.empty(4)
        client.pull(0, out)
        with pytest.raises(ExchangeError, match=r"^push-pull with shard 0 at 127\.0\.0\.1:\d+: INVALID_ARGUMENT: non"):
            client.push_pull(0, torch.tensor([1.0, float("nan"), 0.0, 0.0]), out)
        assert cores[0].policy.version == 0
        client.push_pull(0, torch.ones(4), out)
        assert torch.equal(out, torch.full((4,), -0.05))  # lr 0.05 x one gradient of ones
    finally:
        client.close()


def test_a_one_shard_worker_is_homed_in_its_segment_and_pushes_without_a_copy(shards):
    from psgd.train import models

    model = torch.nn.Linear(3, 2)
    flat = models.FlatParams(model)
    before = flat.params.clone()
    addresses, cores = shards(RunConfig(mode="async", workers=1, servers=1, steps=100))
    client = make_client("shm", addresses, 0, flat.params.numel())
    try:
        client.wait_ready()
        lent = client.lend(flat.params.numel())
        assert lent is not None
        flat.rehome(*lent)
        seg = client.transport._segments[client.transport._lanes[0]]
        assert seg.reply_at > 0 and flat.grads.data_ptr() == seg.region("fp32", 0, 1).data_ptr()
        assert flat.params.data_ptr() == seg.region("fp32", seg.reply_at, 1).data_ptr()
        assert torch.equal(flat.params, before) and model.weight.data_ptr() == flat.params.data_ptr()
        client.init(flat.params)
        out = torch.empty_like(flat.params)
        client.pull(0, out)
        model(torch.ones(1, 3)).sum().backward()  # into the segment
        grad, zeroed = flat.grads.clone(), []
        client.push_pull(0, flat.grads, flat.params, on_free=lambda: zeroed.append(flat.grads.zero_()))
        assert torch.equal(flat.params, before - 0.05 * grad)  # lr 0.05, the reply in place
        assert torch.equal(flat.grads, torch.zeros_like(grad) if zeroed else grad)
        assert torch.equal(cores[0].param, flat.params)
    finally:
        client.close()


@pytest.mark.parametrize("n,kw", [(10, {"wire_dtype": "fp16"}), (10, {"topk": 0.5})])
def test_only_a_dense_fp32_one_shard_worker_is_homed(shards, n, kw):
    from psgd.train import models

    flat = models.FlatParams(torch.nn.Linear(3, 2))
    client = make_client("shm", shards(RunConfig(mode="async", workers=1, servers=1))[0], 0, 8, **kw)
    try:
        client.wait_ready()
        assert client.lend(flat.params.numel()) is None
    finally:
        client.close()
    two = make_client("shm", shards(RunConfig(mode="async", workers=1, servers=2))[0], 0, 8)
    try:
        two.wait_ready()
        assert two.lend(flat.params.numel()) is None
    finally:
        two.close()


def test_a_reply_offset_must_be_aligned_and_inside_the_segment(shard_servers):
    from psgd.ps import framing as fr
    from psgd.ps.shm import segment, serve

    (server,) = shard_servers(RunConfig(mode="async", workers=1, servers=1))
    seg = segment.Segment.create(4096, belled=True)
    try:
        with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as sock:
            for at in ("x", "3", "65536"):
                fr.send_frame(sock, serve.BELL, f"{seg.name}@{at}".encode())
                op, body, _ = fr.recv_head(sock)
                assert op == fr.ERROR and body.startswith(b"INVALID_ARGUMENT: a reply offset"), body
            fr.send_frame(sock, serve.BELL, f"{seg.name}@64".encode())
            assert fr.recv_head(sock)[0] == fr.WELCOME
    finally:
        seg.unlink()
        seg.close()


def test_a_crowded_host_does_not_spin(monkeypatch):
    """A run whose processes fit the cores still sleeps at once while more tasks than the cores + 1
    are runnable on the host (a second run, a test suite): its spin would take a core from one that
    computes; once the host is quiet again it spins."""
    import os

    from psgd.ps.shm import bell

    cores = len(os.sched_getaffinity(0))
    assert bell.runnable() >= 1  # this test's own process, at least
    for count, spins in ((cores + 4, False), (cores, True)):
        monkeypatch.setattr(bell, "runnable", lambda count=count: count)
        monkeypatch.setitem(bell._load, "runnable", float(count))  # as after a few samples of it
        monkeypatch.setitem(bell._load, "checked", -10.0**9)  # sample now
        assert bell.spin_now(0.02) == (0.02 if spins else 0.0)
    assert bell.spin_now(0.0) == 0.0
