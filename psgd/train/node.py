"""`psgd node`: one process of a parameter-server run that torchrun started (and, through torchrun,
Slurm or Kubernetes), deciding from torchrun's variables whether it serves a shard or trains.

    torchrun --nnodes 1 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \\
        --local-addr 127.0.0.1 -m psgd node --servers 1 --mode sync --out results/runs/node
    psgd summarize results/runs/node

Contract:
- It runs where torchrun's variables are set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
  TORCHELASTIC_RESTART_COUNT when there); `from_environ` reads them at the edge and refuses,
  as a UsageError, a process started without them.
- `role` is pure: ranks 0..K-1 serve shard k = RANK, ranks K..K+N-1 train as worker RANK - K.
  WORLD_SIZE must be K + N (N defaults to WORLD_SIZE - K). torchrun numbers ranks node by node,
  so the shards sit on the node that the rendezvous made node 0, beside its first workers.
- The shards' addresses go through torchrun's own TCP store, the one `init_process_group` would
  use (`torch.distributed.rendezvous("env://")`: torch 2.x's agent store when
  TORCHELASTIC_USE_AGENT_STORE=True, else a store on rank 0). No process group is formed, so
  nothing here goes through gloo. Shard k listens on --bind port 0, then sets
  `psgd/attempt-A/shard/k` = "ADDR:PORT" (ADDR: --advertise, default --bind, default 127.0.0.1;
  never guessed from the host name); A is torchrun's restart count, so a restarted group never
  reads the addresses of the group before it (the agent's store outlives a restart). A worker
  waits for all K keys, at most --shards-timeout seconds, then trains as `psgd worker` does.
- The token of a non-loopback --bind is never put in the store: torch's TCP store is
  unauthenticated, and anyone who reaches MASTER_PORT could read it there. Every node takes it
  from the same --token-file (or $PSGD_TOKEN: a Kubernetes Secret, a file on the cluster's
  shared disk), as psgd/ps/auth.py says.
- Names: psgd looks none up. A shard binds --bind and publishes --advertise; MASTER_ADDR is
  what torchrun's node 0 was given as --local-addr (without it torchrun takes that host's FQDN,
  a DNS lookup). torch's c10d store itself, though (torch 2.13; docs/deploy.md), listens
  on every interface ("::") whatever --rdzv-endpoint says, and asks getnameinfo for the name of
  every connection's address; for a loopback store that is ::ffff:127.0.0.1, which /etc/hosts
  does not list, so each connection sends a reverse-DNS query to the host's resolver. That is
  torchrun's, not psgd's: tests/test_node.py runs torchrun in a network namespace of its own
  (only lo), where the query cannot leave the machine.
- The end is a by-hand run's: rank 0 (shard 0) prepares the run folder and writes config.json
  before it listens (`launch.prepare_by_hand`; no worker can write there before it has shard 0's
  address); the workers leave, the shards write their files and exit 0, torchrun exits 0, and
  `psgd summarize OUT` evaluates the snapshots (across hosts: a shared --out, or the files
  copied together first). Rank 0 does not summarize by itself: the other shards' files may sit
  on other hosts, and the all-reduce mode under torchrun ends the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from psgd.core.errors import UsageError

NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each process it starts."""
    rank: int          # RANK: 0..WORLD_SIZE-1 over all nodes
    world_size: int    # WORLD_SIZE: processes on all nodes together
    master_addr: str   # MASTER_ADDR: the store's host (torchrun --local-addr on node 0; else its FQDN)
    master_port: int   # MASTER_PORT
    attempt: int       # TORCHELASTIC_RESTART_COUNT: 0, then 1.. after a restart (--max-restarts)


@dataclass(frozen=True)
class Role:
    """What one rank does: serve shard `index`, or train as worker `index`."""
    kind: str    # "shard" or "worker"
    index: int


def from_environ(environ: Mapping[str, str]) -> TorchrunEnv:
    """torchrun's variables, checked; a UsageError (exit 2) without them."""
    missing = [k for k in NEEDED if not environ.get(k)]
    if len(missing) == len(NEEDED):
        raise UsageError("not under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set): start it "
                         "as torchrun --nproc-per-node K+N ... -m psgd node --servers K ...; on one host without "
                         "torchrun, use psgd run")
    if missing:
        raise UsageError(f"torchrun's {', '.join(missing)} not set (RANK, WORLD_SIZE, MASTER_ADDR "
                         "and MASTER_PORT are all needed)")
    try:
        env = TorchrunEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), environ["MASTER_ADDR"],
                          int(environ["MASTER_PORT"]), int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0))
    except ValueError as e:
        raise UsageError(f"a torchrun variable is not a number ({e})") from None
    if not 0 <= env.rank < env.world_size:
        raise UsageError(f"RANK {env.rank} is not in 0..WORLD_SIZE-1 = 0..{env.world_size - 1}")
    return env


def workers_of(world_size: int, servers: int, workers: int | None) -> int:
    """N: --workers when given, else what WORLD_SIZE leaves beside the K shards; a world of
    another size than K + N is a UsageError naming both."""
    if workers is None:
        if world_size <= servers:
            raise UsageError(f"WORLD_SIZE {world_size} leaves no worker beside --servers {servers}: start more "
                             f"processes (torchrun --nproc-per-node, --nnodes), K + N = {servers} + N in all")
        return world_size - servers
    if world_size != servers + workers:
        raise UsageError(f"WORLD_SIZE is {world_size}, but --servers {servers} + --workers {workers} = "
                         f"{servers + workers}: start K + N processes in all (torchrun --nnodes H --nproc-per-node P "
                         "with H x P = K + N), or leave out --workers to train on the rest")
    return workers


def role(rank: int, servers: int) -> Role:
    """Ranks 0..K-1 serve shard RANK; the others train as worker RANK - K."""
    return Role("shard", rank) if rank < servers else Role("worker", rank - servers)


def address(host: str, port: int) -> str:
    """HOST:PORT as `--servers` takes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _key(k: int) -> str:
    return f"shard/{k}"


class NodeError(RuntimeError):
    """The store could not be reached, or the shards' addresses did not arrive in time (exit 1)."""


def connect(env: TorchrunEnv, timeout_s: float):
    """The run's keys (`psgd/attempt-A/`) in the store init_process_group would use. NodeError when
    it cannot be reached within `timeout_s`."""
    import torch.distributed as dist  # noqa: PLC0415 - torch loads after a shard has blocked its stop signals

    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:  # DistStoreError and friends are RuntimeErrors
        raise NodeError(f"cannot reach torchrun's store at {address(env.master_addr, env.master_port)}: "
                        f"{_first_line(e)}") from None
    return dist.PrefixStore(f"psgd/attempt-{env.attempt}/", store)


def publish(store, shard: int, where: str) -> None:
    """A shard's side: its HOST:PORT, for the workers."""
    store.set(_key(shard), where)


def wait_for_shards(store, servers: int, timeout_s: float) -> list[str]:
    """A worker's side: the K shards' HOST:PORT in shard order, once all K are in the store.
    NodeError naming the missing shards after `timeout_s`."""
    keys = [_key(k) for k in range(servers)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError: the wait timed out
        missing = [k for k in range(servers) if not store.check([_key(k)])]
        raise NodeError(f"no address from shard {', '.join(map(str, missing))} (of {servers}) within {timeout_s:g}s "
                        "(--shards-timeout): did ranks 0..K-1 start, and could they listen on --bind? "
                        "see their output") from None
    return [store.get(key).decode() for key in keys]


class Publisher:
    """`publish(port)`, called once shard `shard` listens: its address into torchrun's store. The
    store stays open for the process's life: where rank 0 hosts it (no agent store, e.g. a
    launcher that sets the variables itself), the workers still read from it."""

    def __init__(self, env: TorchrunEnv, shard: int, advertise: str, timeout_s: float) -> None:
        self.env, self.shard, self.advertise, self.timeout_s = env, shard, advertise, timeout_s
        self.store = None

    def publish(self, port: int) -> None:
        self.store = connect(self.env, self.timeout_s)
        publish(self.store, self.shard, address(self.advertise, port))


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__
