"""The emulated link: parsing, the alpha-beta arithmetic, the pacing schedule, and real runs with --link."""

import pytest
import torch

from psgd.core import link
from psgd.core.config import RunConfig, validate
from psgd.ps.client import make_client
from tests.helpers import psgd_main

pytestmark = pytest.mark.usefixtures("warm_runs")  # its runs fork from the tests' warm parent


@pytest.mark.parametrize("text,bits,latency", [
    ("1gbit,200us", 1e9, 200e-6),
    ("10gbit", 1e10, 0.0),
    ("100mbit,1ms", 1e8, 1e-3),
    (" 2.5Gbit , 0.5ms ", 2.5e9, 5e-4),
    ("400gbit,2us", 4e11, 2e-6),
    ("56kbit,1s", 56e3, 1.0),
])
def test_parse(text, bits, latency):
    got = link.parse(text)
    assert got.bits_per_s == pytest.approx(bits) and got.latency_s == pytest.approx(latency)


@pytest.mark.parametrize("text", ["fast", "1gbit,", "0gbit", "1gb", "1gbit,200", "1gbit,1ms,2ms", "-1gbit"])
def test_parse_rejects_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="--link expects BANDWIDTH"):
        link.parse(text)


def test_empty_means_no_emulation():
    assert link.parse("") is None


def test_alpha_beta_arithmetic():
    one_gbit = link.parse("1gbit,200us")
    assert one_gbit.seconds_per_byte == pytest.approx(8e-9)
    assert one_gbit.transfer_s(0) == pytest.approx(200e-6)
    # 64 MiB at 1 Gbit/s: 0.537 s on the wire plus one latency.
    assert one_gbit.transfer_s(64 << 20) == pytest.approx(200e-6 + (64 << 20) * 8 / 1e9)


def test_schedule_queues_chunks_back_to_back_and_takes_the_longer_of_real_and_emulated():
    lk = link.parse("8mbit")  # 1 byte per microsecond
    free_at, sleep = link.schedule(free_at=10.0, now=10.0, nbytes=1000, link=lk)
    assert free_at == pytest.approx(10.001) and sleep == pytest.approx(0.001)
    # A second chunk right away waits for the first one, then its own time.
    free_at, sleep = link.schedule(free_at, now=10.0, nbytes=1000, link=lk)
    assert free_at == pytest.approx(10.002) and sleep == pytest.approx(0.002)
    # Loopback was slower than the link: the wire is behind, nobody waits.
    free_at, sleep = link.schedule(free_at, now=10.5, nbytes=1000, link=lk)
    assert free_at == pytest.approx(10.003) and sleep == 0.0


def test_config_validates_link():
    with pytest.raises(ValueError, match="--link expects"):
        validate(RunConfig(link="fast"))
    with pytest.raises(ValueError, match="parameter-server options"):
        validate(RunConfig(mode="allreduce", link="1gbit"))
    assert validate(RunConfig(link="10gbit,5us")).link == "10gbit,5us"


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_paced_client_puts_every_byte_and_message_on_the_emulated_wire(shards, transport):
    (address,), (core,) = shards(RunConfig(mode="async", workers=1, servers=1, link="200mbit,1ms"))
    lk = link.parse("200mbit,1ms")
    n = 300_000  # 1.2 MB: two chunks
    client = make_client(transport, [address], 0, n, link=lk)
    try:
        client.init(torch.zeros(n))
        client.push(0, torch.ones(n))
        out = torch.empty(n)
        client.pull(1, out)
    finally:
        client.close()
    assert torch.all(out < 0)  # the paced push really arrived and was applied
    # Each direction carried the 4n bytes of one push or pull (plus a few bytes of framing), and
    # one latency per message: sent = push request + pull request, received = their replies.
    assert client.transport.send.wire_s == pytest.approx(lk.transfer_s(4 * n) + lk.latency_s, rel=1e-4)
    assert client.transport.recv.wire_s == pytest.approx(lk.transfer_s(4 * n) + lk.latency_s, rel=1e-4)
    assert client.transport.send.slept_s > 0 and client.transport.recv.slept_s > 0
    # The shard's own link carried init and push in, the pull out (the worker pays the latency).
    assert core.link_in.wire_s == pytest.approx(2 * 4 * n * lk.seconds_per_byte, rel=1e-4)
    assert core.link_out.wire_s == pytest.approx(4 * n * lk.seconds_per_byte, rel=1e-4)


def test_bad_link_is_a_one_line_usage_error():
    r = psgd_main("run", "--link", "1gb")
    assert r.returncode == 2 and "--link expects" in r.stderr and len(r.stderr.strip().splitlines()) == 1
