"""TLS on both of a shard's ports (psgd/ps/tls.py, psgd certs): it carries a run, and a client that
does not speak it, or does not trust the shard's certificate, gets nothing and changes nothing."""

from __future__ import annotations

import socket

import pytest
import torch

from psgd.core.config import RunConfig
from psgd.core.errors import ExchangeError
from psgd.ps import framing as fr
from psgd.ps.client import make_client
from psgd.train import assemble
from tests.helpers import open_start_barrier, psgd_main


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    good, other = tmp_path_factory.mktemp("certs"), tmp_path_factory.mktemp("other-ca")
    assert psgd_main("certs", str(good), "--hosts", "127.0.0.1").returncode == 0
    assert psgd_main("certs", str(other), "--hosts", "127.0.0.1").returncode == 0
    return good, other


@pytest.fixture
def secure_shard(certs):
    good, _ = certs
    cfg = RunConfig(mode="async", workers=2, servers=1, steps=100, tls_cert=str(good / "server.pem"),
                    tls_key=str(good / "server-key.pem"))
    srv = assemble.shard_server(cfg, 0, "127.0.0.1", 0, num_params=10)
    yield srv
    srv.stop(grace=0)


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_run_goes_over_tls_and_an_untrusted_certificate_is_refused(certs, secure_shard, transport):
    good, other = certs
    address = [f"127.0.0.1:{secure_shard.port}"]
    client = make_client(transport, address, 0, 10, tls_ca=str(good / "ca.pem"))
    try:
        client.wait_ready()
        client.init(torch.arange(10, dtype=torch.float32))
        open_start_barrier(secure_shard.shard)
        out = torch.empty(10)
        client.pull(0, out)
        client.push(0, torch.ones(10))
        assert not client.pull(1, out).done and torch.equal(out, torch.arange(10) - 0.05)
    finally:
        client.close(failed=True)
    before = secure_shard.shard.param.clone(), secure_shard.shard.policy.version
    # Another lab's CA. gRPC waits for a channel it could use (workers may start before their shards),
    # so a refused handshake shows as the deadline passing, with the handshake's failure as the reason.
    stranger = make_client(transport, address, 1, 10, rpc_timeout=2, tls_ca=str(other / "ca.pem"))
    try:
        with pytest.raises(ExchangeError, match="UNAVAILABLE|DEADLINE_EXCEEDED") as err:
            if transport == "grpc":
                stranger.wait_ready()
            else:  # Info on gRPC refuses too; the data port is checked on its own here
                stranger.transport._data[0] = ("127.0.0.1", secure_shard.data_port)
                stranger.pull(0, torch.empty(10))
        if transport == "grpc":
            assert "certificate" in str(err.value)  # the likely cause is named
    finally:
        stranger.close(failed=True)
    assert torch.equal(secure_shard.shard.param, before[0]) and secure_shard.shard.policy.version == before[1]


def test_plain_tcp_to_a_tls_port_gets_no_answer(secure_shard):
    with socket.create_connection(("127.0.0.1", secure_shard.data_port), timeout=10) as sock:
        fr.send_frame(sock, fr.PULL, b"")  # cleartext where a TLS ClientHello should be
        assert sock.recv(1024) == b""      # the handshake fails and the shard closes the connection
    assert secure_shard.shard.policy.version == 0


def test_certs_and_tls_flags_are_checked(certs, tmp_path):
    good, _ = certs
    r = psgd_main("certs", str(good), "--hosts", "127.0.0.1")
    assert r.returncode == 2 and "never overwrites keys" in r.stderr
    assert oct((good / "server-key.pem").stat().st_mode & 0o777) == "0o600"
    r = psgd_main("server", "--shard", "0", "--tls-cert", str(good / "server.pem"), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "--tls-cert and --tls-key go together" in r.stderr
    r = psgd_main("server", "--shard", "0", "--tls-cert", str(good / "ca.pem"), "--tls-key",
                  str(good / "server-key.pem"), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "--tls-cert" in r.stderr and len(r.stderr.strip().splitlines()) == 1
