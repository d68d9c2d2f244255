"""Who may talk to a shard, and how much a peer can make it do (psgd/ps/auth.py, the bounds in
psgd/ps/tcp_server.py and psgd/ps/shard.py): tokens on both transports, the loopback rule, the
connection cap, the first-frame deadline, and seeded fuzzing of both transports' parsers."""

from __future__ import annotations

import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec
from psgd.core.config import RunConfig
from psgd.core.errors import ExchangeError
from psgd.ps import auth, tcp_server, wire
from psgd.ps import framing as fr
from psgd.ps.client import make_client
from psgd.ps.grpc_server import ShardServicer
from psgd.ps.shm.serve import ATTACH
from psgd.train import assemble
from tests.helpers import open_start_barrier, psgd_main

TOKEN = b"s3cret-token"


@pytest.fixture
def gated(tmp_path):
    """One async shard (2 workers, 10 elements) behind a token, initialised by a client holding it."""

    cfg = RunConfig(mode="async", workers=2, servers=1, steps=100)
    srv = assemble.shard_server(cfg, 0, "127.0.0.1", 0, token=TOKEN, num_params=10)
    good = make_client("tcp", [f"127.0.0.1:{srv.port}"], 0, 10, token=TOKEN)
    try:
        good.wait_ready()
        good.init(torch.arange(10, dtype=torch.float32))
        open_start_barrier(srv.shard)
        yield srv, good
    finally:
        good.close()
        srv.stop(grace=0)


def state(shard) -> tuple:
    return shard.policy.version, tuple(shard.policy.clocks), shard.param.detach().numpy().tobytes()


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
@pytest.mark.parametrize("token", [None, b"wrong"])
def test_a_missing_or_wrong_token_is_refused_and_changes_nothing(gated, transport, token):
    srv, good = gated
    before = state(srv.shard)
    bad = make_client(transport, [f"127.0.0.1:{srv.port}"], 1, 10, token=token)
    try:
        with pytest.raises(ExchangeError, match="UNAUTHENTICATED"):
            bad.wait_ready()
    finally:
        bad.close(failed=True)  # no Leave: it never joined
    if transport == "tcp":  # the data port checks on its own: a peer may skip Info and go straight there
        with socket.create_connection(("127.0.0.1", srv.data_port), timeout=10) as sock:
            if token is not None:
                fr.send_frame(sock, fr.HELLO, token)
            header = pb.TensorHeader(worker_id=1, shard=0, num_elements=10, dtype=pb.FP32)
            fr.send_frame(sock, fr.PUSH, header.SerializeToString(), codec.encode(torch.ones(10), "fp32"))
            op, body, _ = fr.recv_head(sock)
            assert op == fr.ERROR and body.decode().startswith("UNAUTHENTICATED: ")
            assert fr.recv_head(sock) is None  # and closed
    assert state(srv.shard) == before
    out = torch.empty(10)
    assert not good.pull(0, out).done and torch.equal(out, torch.arange(10, dtype=torch.float32))


def test_grpc_refusal_is_the_unauthenticated_status(gated):
    srv, _ = gated
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        info = ch.unary_unary(f"/{wire.SERVICE}/Info", request_serializer=pb.InfoRequest.SerializeToString,
                              response_deserializer=pb.InfoReply.FromString)
        with pytest.raises(grpc.RpcError) as err:
            info(pb.InfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info(pb.InfoRequest(), timeout=10, metadata=[(auth.METADATA_KEY, TOKEN.decode())]).data_port


def test_the_token_comes_from_the_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.ENV, raising=False)
    assert auth.load("") is None
    monkeypatch.setenv(auth.ENV, " from-env \n")
    assert auth.load("") == b"from-env"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert auth.load(str(f)) == b"from-file"  # the file wins
    for text, why in [("", "is empty"), ("caf\u00e9", "printable ASCII")]:
        f.write_text(text)
        with pytest.raises(auth.TokenError, match=why):
            auth.load(str(f))
    with pytest.raises(auth.TokenError, match="cannot read"):
        auth.load(str(tmp_path / "missing"))
    assert auth.is_loopback("127.0.0.1") and auth.is_loopback("::1") and auth.is_loopback("localhost")
    assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("198.18.0.2") and not auth.is_loopback("h1")


def test_serving_beyond_loopback_needs_a_token_or_insecure(tmp_path, monkeypatch):
    # Refused before anything is bound: no socket is opened on any address but loopback here.
    monkeypatch.delenv(auth.ENV, raising=False)
    r = psgd_main("server", "--shard", "0", "--bind", "0.0.0.0", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "refusing to serve on 0.0.0.0 without a token" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = psgd_main("server", "--shard", "0", "--token-file", str(tmp_path / "none"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "cannot read it" in r.stderr


def test_silent_strangers_are_cut_and_only_admitted_connections_fill_the_room(gated):
    srv, good = gated
    ds = srv.data_server
    ds.auth_deadline = 0.5  # a silent connection is cut this soon
    out = torch.empty(10)
    good.pull(0, out)  # the worker's pooled connection is open before the crowd arrives
    crowd = [socket.create_connection(("127.0.0.1", srv.data_port), timeout=30) for _ in range(200)]
    hellos = []
    try:
        # Silent, they take no room: each is cut at the deadline, none refused for lack of room.
        assert all(_answer(s) == "cut" for s in crowd)
        # Peers holding the token do: past max_connections they are refused at once.
        room = ds.max_connections - len(ds.connections)
        for _ in range(room + 5):
            s = socket.create_connection(("127.0.0.1", srv.data_port), timeout=30)
            hellos.append(s)
            fr.send_frame(s, fr.HELLO, TOKEN)
        answers = [fr.recv_head(s)[0] for s in hellos]
        # The shard's threads take them in whatever order they run: which ones are refused may vary,
        # how many may not.
        assert sorted(answers) == sorted([fr.WELCOME] * room + [fr.ERROR] * 5)
        good.push(0, torch.ones(10))  # ...and through all of it the real worker was served
        assert not good.pull(1, out).done and torch.equal(out, torch.arange(10) - 0.05)
    finally:
        for s in crowd + hellos:
            s.close()


def _answer(sock: socket.socket) -> str:
    """How the shard ended a stranger's connection: "cut" (EOF or reset) or its ERROR's status."""
    try:
        head = fr.recv_head(sock)
    except ConnectionResetError:
        return "cut"
    return "cut" if head is None else head[1].decode().split(":")[0]


def _trickle(port: int, pace: float, stop: threading.Event, started: threading.Barrier | None) -> str:
    """A stranger sending a HELLO one byte per `pace` seconds (its header says 200 bytes): "cut"
    when the shard closes it first, "answered" when it says something, "stopped" when told to."""
    frame = fr.PREFIX.pack(fr.HELLO, 200, 0) + b"x" * 200
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for i in range(len(frame)):
            try:
                s.sendall(frame[i:i + 1])
                if started is not None and i == 0:
                    started.wait()
                s.settimeout(pace)  # the trickle's cadence: wait this long for an answer, then a byte more
                if s.recv(64):
                    return "answered"
                return "cut"
            except TimeoutError:
                if stop.is_set():
                    return "stopped"
            except (ConnectionResetError, BrokenPipeError):
                return "cut"
    return "finished"


def test_fifty_trickling_strangers_neither_lock_a_worker_out_nor_outstay_the_deadline(gated):
    """Strangers sending a byte now and then: before, they counted against the 4N+8 cap and each
    byte bought another --rpc-timeout, so 12 kept a worker out; now they count for nothing until
    their first frame is whole, and the whole of it must come within the deadline."""
    srv, _ = gated
    ds, stop = srv.data_server, threading.Event()
    ds.auth_deadline = 60.0  # first: they stay (pending) while the worker comes
    started = threading.Barrier(51)
    with ThreadPoolExecutor(50) as pool:
        tricklers = [pool.submit(_trickle, srv.data_port, 0.05, stop, started) for _ in range(50)]
        started.wait(timeout=30)
        while len(ds.connections) + len(getattr(ds, "pending", ())) < min(50, ds.max_connections):
            stop.wait(0.01)  # the server has not accepted them all yet (a condition, not a delay)
        worker = make_client("tcp", [f"127.0.0.1:{srv.port}"], 1, 10, token=TOKEN)
        try:
            worker.wait_ready()
            out = torch.empty(10)
            assert not worker.pull(0, out).done and torch.equal(out, torch.arange(10, dtype=torch.float32))
            assert len(ds.pending) == 50  # they were all there, and took no place
        finally:
            stop.set()
            worker.close()
        assert {t.result() for t in tricklers} == {"stopped"}
    # Then: a deadline far shorter than a trickle takes (200+ bytes at 20 ms each) cuts every one.
    ds.auth_deadline = 0.3
    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(lambda _: _trickle(srv.data_port, 0.02, threading.Event(), None), range(50)))
    assert results == ["cut"] * 50


# -- fuzzing ------------------------------------------------------------------------------------
class _FakeSocket:
    """Just enough of a socket for tcp_server._Connection: reads from bytes, collects what is sent."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.sent = data, 0, bytearray()

    def recv_into(self, view, n: int = 0) -> int:
        view = memoryview(view).cast("B")
        k = min(len(view), len(self.data) - self.pos)
        view[:k] = self.data[self.pos:self.pos + k]
        self.pos += k
        return k

    def sendall(self, data) -> None:
        self.sent += bytes(data)

    def sendmsg(self, parts) -> int:
        for p in parts:
            self.sent += bytes(p)
        return sum(len(p) for p in parts)

    def setsockopt(self, *a) -> None: ...
    def settimeout(self, t) -> None: ...
    def shutdown(self, how) -> None: ...

    def getpeername(self) -> tuple[str, int]:
        return ("127.0.0.1", 40000)  # a loopback peer: ATTACH frames reach the segment checks


def _random_frame(rng: random.Random) -> bytes:
    """Mostly near-misses of real frames: valid ops with mangled headers and wrong lengths."""
    op = rng.choice([fr.PUSH, fr.PULL, fr.PUSHPULL, fr.HELLO, ATTACH, fr.PUSHED, fr.ERROR, rng.randrange(256)])
    if rng.random() < 0.5:
        header = pb.TensorHeader(worker_id=rng.choice([0, 1, 2, 2**31]), shard=rng.choice([0, 1]),
                                 num_elements=rng.choice([10, 9, 0, 2**40]), clock=rng.choice([0, 1, 5]),
                                 dtype=rng.choice([pb.FP32, pb.FP16, 99])).SerializeToString()
    else:
        header = rng.randbytes(rng.randrange(0, 40))
    payload = rng.randbytes(rng.choice([0, 20, 36, 40, 44]))
    declared = len(payload) if rng.random() < 0.7 else rng.choice([0, 40, 2**40, 2**63])
    frame = fr.PREFIX.pack(op, len(header), declared) + header + payload
    return frame[:rng.randrange(len(frame) + 1)] if rng.random() < 0.2 else frame


def _ops(sent: bytes) -> list[int]:
    """The ops of the frames a handler sent back."""
    ops, pos = [], 0
    while pos < len(sent):
        op, header_len, payload_len = fr.PREFIX.unpack_from(sent, pos)
        ops.append(op)
        pos += fr.PREFIX.size + header_len + payload_len
    return ops


def test_fuzzed_frames_never_crash_the_data_plane_nor_change_state(gated):
    """10,000 seeded frames through the data plane's own handler (a fake socket, so it is fast):
    every one ends in an answer or a closed connection, and only accepted pushes change state."""
    srv, _ = gated
    rng = random.Random(1234)
    for case in range(10_000):
        before = state(srv.shard)
        hello = fr.PREFIX.pack(fr.HELLO, len(TOKEN), 0) + TOKEN if rng.random() < 0.8 else b""
        conn = _FakeSocket(hello + b"".join(_random_frame(rng) for _ in range(rng.randrange(1, 4))))
        tcp_server._Connection(conn, ("fuzz", case), srv.data_server)  # setup, handle, finish
        if not {fr.PUSHED, fr.PULLED} & set(_ops(bytes(conn.sent))):  # nothing was accepted
            assert state(srv.shard) == before, f"case {case} changed the shard"
    assert srv.data_server.connections == set()  # every handler finished and let go


def test_fuzzed_chunk_streams_never_crash_the_grpc_servicer_nor_change_state(gated):
    srv, _ = gated
    servicer = ShardServicer(srv.shard, srv.data_port)
    parse = wire.frame_parser(pb.TensorChunk)

    class Aborted(Exception):
        pass

    class Context:
        def time_remaining(self):  # grpc.ServicerContext's: no deadline on this call
            return None

        def abort(self, code, message):
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (code, message)
            raise Aborted

    rng = random.Random(99)
    header = pb.TensorChunk(header=pb.TensorHeader(worker_id=1, shard=0, num_elements=10, dtype=pb.FP32))
    for case in range(2_000):
        chunks = []
        if rng.random() < 0.7:
            chunks.append(header.SerializeToString())
        for _ in range(rng.randrange(0, 4)):
            data = pb.TensorChunk(data=rng.randbytes(rng.choice([0, 8, 40, 44]))).SerializeToString()
            chunks.append(rng.choice([data, rng.randbytes(rng.randrange(0, 50)), header.SerializeToString()]))
        try:
            messages = [parse(c) for c in chunks]
        except Exception:  # noqa: BLE001 - gRPC answers a message it cannot parse with an error status
            continue
        before = state(srv.shard)
        try:
            servicer.Push(iter(messages), Context())
        except Aborted:
            assert state(srv.shard) == before, f"case {case}: a refused stream changed the shard"
