"""A shard server: one `Shard` (psgd/ps/shard.py) behind its gRPC service and its TCP data plane.

Contract: `start(shard, host, port, token=, tls_cert=, tls_key=, worker_lease=)` serves a `Shard`
(built from a run's config by psgd/train/assemble.py, or by hand) with both listeners on `host`
(gRPC on `port`, 0 for any free one; the data plane on a free port of its own, told to workers by
`Info`), both gated by `token` when given (psgd/ps/auth.py), over TLS with a certificate, and
returns a `ShardServer`. `worker_lease` > 0 declares lost the workers silent that long (async and
SSP go on; in sync each later step averages the workers left). `stop()` releases held pulls (they
return done), then stops both. Raises OSError when a port cannot be bound. `psgd server`
(psgd/train/serve.py) runs one per process:

    psgd server --port 50051 --shard 0 --servers 2 --workers 4 --mode sync
"""

from __future__ import annotations

import sys
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc

from psgd.ps import grpc_auth, tls, transport, wire
from psgd.ps.grpc_server import ShardServicer, rpc_handlers
from psgd.ps.shard import Shard
from psgd.ps.tcp_server import DataServer


@dataclass
class ShardServer:
    shard: Shard
    port: int            # gRPC
    data_port: int       # TCP data plane
    grpc_server: grpc.Server
    data_server: DataServer
    lease: _LeaseWatch | None = None

    def stop(self, grace: float = 1.0) -> None:
        """Release held pulls (they return done), then stop serving on both transports."""
        if self.lease is not None:
            self.lease.stop()
        self.shard.close()
        self.data_server.stop()
        self.grpc_server.stop(grace).wait()


def start(shard: Shard, host: str = "127.0.0.1", port: int = 0, *, token: bytes | None = None,
          tls_cert: str = "", tls_key: str = "", worker_lease: float = 0.0) -> ShardServer:
    """Serve `shard` on `host`; see the module docstring. A restored shard (`Shard.restore`) is
    restored before this: no worker ever sees it uninitialised."""
    wire.reuse_freed_memory()
    secure = bool(tls_cert)  # TlsError (a ValueError) for files that cannot make it: before any port opens
    context = tls.server_context(tls_cert, tls_key) if secure else None
    credentials = tls.server_credentials(tls_cert, tls_key) if secure else None
    try:
        data = DataServer(shard, host, token, context, transport.upgrades())  # the transports' own ops
    except OSError as e:
        raise OSError(f"cannot open the TCP data plane on {host}: {e}") from None
    # Pulls may be held by the policy, one thread each: leave room for every worker's pull and push.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4 * shard.workers + 8),
                         interceptors=[grpc_auth.ServerGate(token)] if token else None,
                         options=[("grpc.so_reuseport", 0), *wire.CHANNEL_OPTIONS])
    server.add_generic_rpc_handlers((rpc_handlers(ShardServicer(shard, data.port)),))
    try:
        bound = server.add_secure_port(f"{host}:{port}", credentials) if secure else \
            server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        data.stop()
        raise OSError(f"cannot listen on {host}:{port}: the port is in use or the address is not this host's")
    server.start()
    lease = _LeaseWatch(shard, worker_lease) if worker_lease > 0 else None
    return ShardServer(shard, bound, data.port, server, data, lease)


class _LeaseWatch:
    """--worker-lease: a thread that asks the shard, a few times per lease, to declare lost the
    workers it has not heard from for a whole lease (psgd/core/consistency.py `expire`)."""

    def __init__(self, shard: Shard, lease: float) -> None:
        self.shard, self.lease = shard, lease
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=f"psgd-lease-{shard.index}", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopping.wait(self.lease / 4):
            for w, clock in self.shard.expire(self.lease):
                print(f"shard {self.shard.index}: worker {w} sent nothing for {self.lease:g}s: lost at clock "
                      f"{clock}; the run goes on without it", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
