"""How a worker's pushes and pulls reach the shards: one small protocol, three implementations.

`Transport` is what `PSClient` (psgd/ps/client.py) talks to. Every call takes the list of shard
indices it is for (all K for a step's push / pull, one for --overlap's per-shard streams) and
fans out to them itself, the way that suits its wire; every failure is an `ExchangeError` with
one line that names the shard and the status.

    info(shards)                                        -> [InfoReply]   (waits for the shard to be up)
    init(shards, header_of, payload_of)                 -> [InitReply]
    push(shards, header_of, payload_of, events)         -> [PushReply]
    pull(shards, request_of, out_of, events)            -> [(PullHeader, bytes received)]
    push_pull(shards, header_of, payload_of, out_of, events) -> [(PullHeader, bytes received)]
                                                  (a push of clock c answered by the pull of c + 1;
                                                   each header's `pushed` is the push's reply)
    leave(shards, worker_id)                            -> [LeaveReply]  (this worker has finished)
    join(shard, request)                                -> JoinReply     (take a slot in a running job)
    push_pull_direct(shards, headers, grads, outs, on_sent, on_free) -> ([(PullHeader, bytes)], replied at)
    lend(count)                                         -> (params, grads) or None
                                                  (a step's fast path and the worker's buffers: each
                                                   transport's own, or `Wire`'s generic ones)

`header_of(k)` / `request_of(k)` build shard k's .proto header, `payload_of(k)` its bytes in the
wire dtype (or a `sparsify.Sparse` for a sparse push, --topk: SparseChunks on gRPC, its indices
then its values in the TCP frame), `out_of(k)` the fp32 slice its pulled values land in (written in place: no copy).
`Events` lets a caller follow a transfer chunk by chunk: the emulated link paces there, and
--overlap's forward hooks wait on a pull's progress.

The pieces every transport shares (`Events`, `NO_EVENTS`, `chain`, `check_pull_header`, and `Wire`,
the generic `push_pull_direct` and `lend` a transport overrides where it has a faster way) are in
psgd/ps/transfer.py; this module re-exports them, and the wires, so callers import one place.

- `GrpcTransport` (psgd/ps/grpc_transport.py): client-streaming Push / server-streaming Pull of
  ~1 MiB frames, one thread per shard; PushPull one bidirectional call per shard kept open for the
  run, each step timed by a watchdog.
- `TcpTransport` (psgd/ps/tcp_transport.py): the shards' raw-socket data planes (psgd/ps/framing.py;
  gRPC still does Info, Init and Leave); small unpaced shards in one round from the calling
  thread, larger or paced ones a thread each.
- `ShmTransport` (psgd/ps/shm/, a room of its own): the TCP data plane's frames with their payloads
  in shared memory, for workers on their shards' host (a memcpy instead of loopback TCP's copies).
- `PacedTransport(inner, link)` (here): `--link`, a wrapper that paces any transport's traffic to an
  emulated wire (psgd/core/link.py): one pacer for sends and one for receives, shared by the K
  streams as one NIC is; each message pays the latency once, each chunk its bytes / bandwidth.
- `TRANSPORTS` (here): the registry, name -> class, each class naming itself (`name`); `register(cls)`
  adds one. `choose(name, addresses, tls)`: "auto" (the default) becomes the registered transport of
  the highest `rank` whose `fits(addresses, tls)` holds (shm where every shard is on this host's
  loopback, else tcp; with --link, tcp, whose shards pace their NIC too), any other name stays;
  `check(name, hosts, tls)`: a one-line reason a name cannot carry a run, or None; `upgrades()`:
  the data-plane ops the registered transports add, for the shard's listener (psgd/ps/server.py);
  `row_upgrades()` and `row_client(name)` the same for the rows protocol (psgd/ps/rows_tcp.py's
  service, and a worker's client of it: shm's rows through a doorbell).
- `make_transport(name, addresses, timeout, link, token, tls_ca)` (here): the class `TRANSPORTS[choose(
  name, ...)]`, called `(addresses, timeout, token, tls_ca)`; a ValueError names the choices for a
  name not registered.

A new transport on the shards' existing listeners (gRPC and the TCP data plane) is one file: a
client class with the methods above (it may subclass `Wire` or a wire here, as TcpTransport takes
GrpcTransport for its control calls), registered with `register(Class)` (or `TRANSPORTS[name] =
factory`); a run built from a `RunConfig` naming it then carries every worker's pushes and pulls on
it, paced by --link as any other (tests/test_plugin_transport.py plugs one in from the test file
alone). A transport that upgrades the data plane's connections (shm) is a room: its client, its
`upgrades` (ops -> the shard's side, psgd/ps/framing.py `Frames`), and its line in `TRANSPORTS` here;
tests/test_plugin_transport.py counts the files that name it. A new wire protocol with a listener of
its own also needs the lines in psgd/ps/server.py `start` that open and stop it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import link as link_mod
from psgd.ps.grpc_transport import GrpcTransport as GrpcTransport
from psgd.ps.grpc_transport import _RunStream as _RunStream
from psgd.ps.grpc_transport import _Watchdog as _Watchdog
from psgd.ps.shm import ShmTransport
from psgd.ps.tcp_transport import ROUND_MAX_BYTES as ROUND_MAX_BYTES
from psgd.ps.tcp_transport import TcpTransport
from psgd.ps.transfer import NO_EVENTS as NO_EVENTS
from psgd.ps.transfer import Events as Events
from psgd.ps.transfer import Wire
from psgd.ps.transfer import chain as chain
from psgd.ps.transfer import check_pull_header as check_pull_header


class Transport(Protocol):
    addresses: list[str]

    def info(self, shards: Sequence[int]) -> list[pb.InfoReply]: ...
    def init(self, shards: Sequence[int], header_of, payload_of) -> list[pb.InitReply]: ...
    def push(self, shards: Sequence[int], header_of, payload_of, events: Events = NO_EVENTS) -> list[pb.PushReply]: ...
    def pull(self, shards: Sequence[int], request_of, out_of, events: Events = NO_EVENTS) -> list[tuple]: ...
    def push_pull(self, shards: Sequence[int], header_of, payload_of, out_of,
                  events: Events = NO_EVENTS) -> list[tuple]: ...
    def leave(self, shards: Sequence[int], worker_id: int) -> list[pb.LeaveReply]: ...
    def join(self, shard: int, request: pb.JoinRequest) -> pb.JoinReply: ...
    def close(self) -> None: ...


class PacedTransport(Wire):
    """`inner`, with its traffic paced to an emulated link (--link; see the module docstring).

    Full duplex: sends and receives are paced apart. A push pays the latency on its way out and
    its reply on the way back; a pull likewise; every payload chunk waits for its bytes /
    bandwidth on the shared wire. A message takes max(loopback time, emulated time).
    """

    def __init__(self, inner: Transport, link: link_mod.Link) -> None:
        self.inner, self.addresses = inner, inner.addresses
        self.send, self.recv = link_mod.Pacer(link), link_mod.Pacer(link)
        self._events = Events(sending=lambda k: self.send.start(), sent=lambda k, n: self.send.pace(n),
                              replied=lambda k, _: self.recv.start(), received=lambda k, n, e: self.recv.pace(n))

    def info(self, shards):
        return self.inner.info(shards)

    def init(self, shards, header_of, payload_of):
        return self.inner.init(shards, header_of, payload_of)  # set-up, not training traffic: unpaced

    def push_pull(self, shards, header_of, payload_of, out_of, events=NO_EVENTS):
        return self.inner.push_pull(shards, header_of, payload_of, out_of, chain(self._events, events))

    def leave(self, shards, worker_id):
        return self.inner.leave(shards, worker_id)  # the end, not training traffic: unpaced

    def join(self, shard, request):
        return self.inner.join(shard, request)  # set-up: unpaced

    def push(self, shards, header_of, payload_of, events=NO_EVENTS):
        return self.inner.push(shards, header_of, payload_of, chain(self._events, events))

    def pull(self, shards, request_of, out_of, events=NO_EVENTS):
        return self.inner.pull(shards, request_of, out_of, chain(self._events, events))

    def close(self) -> None:
        self.inner.close()


AUTO = "auto"  # RunConfig.transport's default: `choose` picks by where the shards are

# name -> the client class (or any factory of that signature) `make_transport` builds; each names itself.
TRANSPORTS: dict[str, Callable[[list[str], float, bytes | None, str], Transport]] = {}


def register(kind):
    """Add a transport class (it names itself: `kind.name`); returns it, so it may decorate."""
    TRANSPORTS[kind.name] = kind
    return kind


for _kind in (GrpcTransport, TcpTransport, ShmTransport):
    register(_kind)


def choose(name: str, addresses: list[str], tls: bool = False, linked: bool = False) -> str:
    """The transport a worker uses to reach shards at `addresses`: `name`, or for "auto" the
    registered one of the highest `rank` that `fits` (a factory without them is never chosen); with
    an emulated link (`linked`), only one whose shards pace their side of it too (`shard_paced`:
    the TCP data plane's, psgd/ps/tcp_server.py), so that --link emulates the shards' NICs as well
    as the workers'."""
    if name != AUTO:
        return name
    fitting = [k for k in TRANSPORTS.values() if getattr(k, "rank", 0) > 0 and k.fits(addresses, tls)
               and (not linked or getattr(k, "shard_paced", False))]
    return max(fitting, key=lambda k: k.rank).name if fitting else "grpc"


def check(name: str, hosts: int = 0, tls: bool = False) -> str | None:
    """Why `--transport name` cannot carry a run with these --hosts and TLS, in one line, or None."""
    if name == AUTO:
        return None
    kind = TRANSPORTS.get(name)
    if kind is None:
        return f"--transport must be {AUTO} or one of {', '.join(TRANSPORTS)}, got {name!r}"
    fits = getattr(kind, "fits", None)
    if fits is None:
        return None
    if hosts and not fits(["198.18.0.1:1"], tls):  # an address of another host (psgd cluster's range)
        return f"--transport {name} needs the workers on their shards' host: --hosts needs tcp, grpc or {AUTO}"
    if not fits(["127.0.0.1:1"], tls):
        return f"--transport {name} cannot carry a run here{' with --tls-ca' if tls else ''}: use tcp or grpc"
    return None


def upgrades() -> dict:
    """The data-plane ops every registered transport adds (op -> its shard side: psgd/ps/tcp_server.py)."""
    return {op: fn for kind in TRANSPORTS.values() for op, fn in getattr(kind, "upgrades", {}).items()}


def row_upgrades() -> dict:
    """The row service's ops every registered transport adds (op -> its side: psgd/ps/rows_tcp.py)."""
    return {op: fn for kind in TRANSPORTS.values() for op, fn in getattr(kind, "row_upgrades", {}).items()}


def row_client(name: str):
    """A transport's own client for the rows protocol (`--embeddings rows|hybrid`), called (address,
    token, timeout, processes), or None where its rows ride the row service's TCP or gRPC as they are."""
    return getattr(TRANSPORTS.get(name), "row_client", None)


def make_transport(name: str, addresses: list[str], timeout: float, link: link_mod.Link | None = None,
                   token: bytes | None = None, tls_ca: str = "") -> Transport:
    """`--transport auto | grpc | tcp | shm` (or a registered one: `choose`), paced when `link` is
    given, every request carrying `token` if given, over TLS that trusts the CA in `tls_ca` if given."""
    kind = TRANSPORTS.get(choose(name, addresses, bool(tls_ca), linked=link is not None))
    if kind is None:
        raise ValueError(f"unknown transport {name!r}; choose {AUTO}, {', '.join(TRANSPORTS)}")
    inner = kind(addresses, timeout, token, tls_ca)
    return PacedTransport(inner, link) if link else inner
