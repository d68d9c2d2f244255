"""A transport plugs in from one file: a toy client registered in psgd/ps/transport.py `TRANSPORTS`.

The toy wraps the real gRPC client (psgd/ps/grpc_transport.py) and counts what it forwards: the
calls of each kind and the bytes each push sends and each pull receives. A short real sync job
(2 workers in threads, 2 in-process shard servers on 127.0.0.1 port 0, stopped by the fixture)
runs with `transport` set to its name; every push and pull went through it, the shards saw its
bytes, and the parameters are bit for bit those of the same job on `transport="grpc"`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig
from psgd.ps import transport as transport_mod
from psgd.ps.grpc_transport import GrpcTransport
from tests.helpers import train_in_threads


class CountingTransport(GrpcTransport):
    """gRPC, counting: calls per method, payload bytes pushed, bytes pulled (what a new client
    class looks like: the Transport methods, here each forwarded to the real wire)."""

    def __init__(self, addresses: list[str], timeout: float, token: bytes | None = None, tls_ca: str = "") -> None:
        super().__init__(addresses, timeout, token, tls_ca)
        self.calls: Counter[str] = Counter()  # method -> shards it was called for
        self.sent = self.received = 0

    def _counted(self, payload_of):
        def payload(k: int):
            p = payload_of(k)  # dense here: a memoryview of the shard's slice in the wire dtype
            self.sent += p.nbytes
            return p
        return payload

    def _count_pulled(self, results: list[tuple]) -> list[tuple]:
        self.received += sum(n for _, n in results)
        return results

    def push(self, shards: Sequence[int], header_of, payload_of, events=transport_mod.NO_EVENTS):
        self.calls["push"] += len(shards)
        return super().push(shards, header_of, self._counted(payload_of), events)

    def pull(self, shards: Sequence[int], request_of, out_of, events=transport_mod.NO_EVENTS):
        self.calls["pull"] += len(shards)
        return self._count_pulled(super().pull(shards, request_of, out_of, events))

    def push_pull(self, shards: Sequence[int], header_of, payload_of, out_of, events=transport_mod.NO_EVENTS):
        self.calls["push_pull"] += len(shards)
        return self._count_pulled(super().push_pull(shards, header_of, self._counted(payload_of), out_of, events))

    def leave(self, shards: Sequence[int], worker_id: int):
        self.calls["leave"] += len(shards)
        return super().leave(shards, worker_id)


def job(**kw) -> RunConfig:
    # Constructed, not validated: config.validate's --transport choices do not list the toy.
    return RunConfig(mode="sync", workers=2, servers=2, batch_size=8, steps=4, seed=1, device="cpu",
                     optim=OptimConfig(lr=0.1), data=DataConfig(dataset="synthetic", num_samples=200),
                     model=ModelConfig(model="mlp", width=16), **kw)


@pytest.mark.parametrize("separate_pull", [False, True])
def test_a_transport_plugs_in_as_one_class_and_its_registration(monkeypatch, shards, separate_pull):
    made: list[CountingTransport] = []

    def counting(addresses: list[str], timeout: float, token: bytes | None, tls_ca: str) -> CountingTransport:
        made.append(CountingTransport(addresses, timeout, token, tls_ca))
        return made[-1]

    monkeypatch.setitem(transport_mod.TRANSPORTS, "counting", counting)
    cfg = job(transport="counting", separate_pull=separate_pull)
    addresses, cores = shards(cfg)
    params = train_in_threads(cfg, addresses, cores)  # checks every shard made cfg.steps updates

    assert len(made) == cfg.workers  # one client per worker, each the toy
    total = sum((t.calls for t in made), Counter())
    pushes = total["push_pull"] + total["push"]
    # Every gradient the shards took came through the toy, and every byte either way.
    assert pushes == sum(c.policy.accepted for c in cores) >= cfg.steps * cfg.workers * cfg.servers
    assert sum(t.sent for t in made) == sum(c.bytes_in for c in cores) > 0
    assert sum(t.received for t in made) == sum(c.bytes_out for c in cores) > 0
    assert total["leave"] == cfg.workers * cfg.servers
    assert (total["push"] > 0) == separate_pull and (total["push_pull"] > 0) != separate_pull

    ref_addresses, ref_cores = shards(job(transport="grpc", separate_pull=separate_pull))
    reference = train_in_threads(job(transport="grpc", separate_pull=separate_pull), ref_addresses, ref_cores)
    assert torch.equal(params, reference)


def test_an_unknown_transport_is_one_line_with_the_choices():
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'; choose auto, grpc, tcp, shm"):
        transport_mod.make_transport("carrier-pigeon", ["127.0.0.1:1"], 1.0)
