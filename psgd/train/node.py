"""`psgd node`: one process of a parameter-server run that torchrun started (and, through torchrun,
Slurm or Kubernetes), or that Slurm's `srun` started by itself, deciding from the launcher's
variables whether it serves a shard or trains.

    torchrun --nnodes 1 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \\
        --local-addr 127.0.0.1 -m psgd node --servers 1 --mode sync --out results/runs/node
    psgd summarize results/runs/node

Contract:
- It runs where torchrun's variables are set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
  TORCHELASTIC_RESTART_COUNT when there); `from_environ` reads them at the edge and refuses,
  as a UsageError, a process started without them.
- Under `srun` without torchrun (RANK and WORLD_SIZE unset, SLURM_STEP_ID set: a job step, not
  the batch script), Slurm's variables say the same, as PyTorch Lightning's SLURMEnvironment and
  submitit read them: RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS (the step's), LOCAL_RANK =
  SLURM_LOCALID, the attempt = SLURM_RESTART_COUNT (a requeued job). MASTER_ADDR, where the job
  script does not export it, is the first node of SLURM_JOB_NODELIST (`expand_nodelist`, pure;
  a host name, so a lookup: deploy/slurm/psgd_ps.sbatch exports the node's NodeAddr instead), and
  MASTER_PORT, where not exported, 15000 + the last 4 digits of SLURM_JOB_ID (Lightning's rule).
  There is no torchrun agent: rank 0 (shard 0) hosts the store, listening on MASTER_ADDR only
  (a socket psgd binds and hands to torch's TCPStore), the others connect to it. torchrun under
  srun sets RANK and WORLD_SIZE, and then torchrun's variables win.
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

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from psgd.core.errors import UsageError

NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_NEEDED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_JOB_NODELIST")


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each process it starts."""
    rank: int          # RANK: 0..WORLD_SIZE-1 over all nodes
    world_size: int    # WORLD_SIZE: processes on all nodes together
    master_addr: str   # MASTER_ADDR: the store's host (torchrun --local-addr on node 0; else its FQDN)
    master_port: int   # MASTER_PORT
    attempt: int       # TORCHELASTIC_RESTART_COUNT: 0, then 1.. after a restart (--max-restarts)
    launcher: str = "torchrun"   # "srun": Slurm's variables, no agent, rank 0 hosts the store
    local_rank: int | None = None  # SLURM_LOCALID under srun (torchrun sets LOCAL_RANK itself)


@dataclass(frozen=True)
class Role:
    """What one rank does: serve shard `index`, or train as worker `index`."""
    kind: str    # "shard" or "worker"
    index: int


def from_environ(environ: Mapping[str, str]) -> TorchrunEnv:
    """torchrun's variables, or under srun Slurm's, checked; a UsageError (exit 2) without them."""
    if not environ.get("RANK") and not environ.get("WORLD_SIZE") and environ.get("SLURM_PROCID"):
        return from_slurm(environ)
    missing = [k for k in NEEDED if not environ.get(k)]
    if len(missing) == len(NEEDED):
        raise UsageError("not under torchrun or srun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set, nor "
                         "SLURM_PROCID): start it as torchrun --nproc-per-node K+N ... -m psgd node --servers K ..., "
                         "or srun -n K+N psgd node --servers K ...; on one host without either, use psgd run")
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


def from_slurm(environ: Mapping[str, str]) -> TorchrunEnv:
    """A task `srun` started: Slurm's variables as torchrun's (module docstring). A UsageError in
    the batch script itself (no SLURM_STEP_ID), or where a variable is missing or not a number."""
    if not (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")):
        raise UsageError("in a Slurm job but not in a job step (SLURM_STEP_ID is not set): start every process "
                         "with srun -n K+N psgd node ... (or srun torchrun ...), not in the batch script itself")
    missing = [k for k in SLURM_NEEDED if not environ.get(k)]
    if missing:
        raise UsageError(f"Slurm's {', '.join(missing)} not set (srun sets {', '.join(SLURM_NEEDED)})")
    try:
        rank = int(environ["SLURM_PROCID"])
        world = int(environ["SLURM_NTASKS"])
        local = int(environ["SLURM_LOCALID"]) if environ.get("SLURM_LOCALID") else None
        attempt = int(environ.get("SLURM_RESTART_COUNT") or 0)
        port = int(environ.get("MASTER_PORT") or default_port(environ["SLURM_JOB_ID"]))
    except ValueError as e:
        raise UsageError(f"a Slurm variable (or MASTER_PORT) is not a number ({e})") from None
    addr = environ.get("MASTER_ADDR") or expand_nodelist(environ["SLURM_JOB_NODELIST"])[0]
    if not 0 <= rank < world:
        raise UsageError(f"SLURM_PROCID {rank} is not in 0..SLURM_NTASKS-1 = 0..{world - 1}")
    return TorchrunEnv(rank, world, addr, port, attempt, launcher="srun", local_rank=local)


def default_port(job_id: str) -> int:
    """MASTER_PORT where the job script gives none: 15000 + the job id's last 4 digits, as
    PyTorch Lightning's SLURMEnvironment picks it (an array job's id is "123_4": its digits)."""
    digits = "".join(ch for ch in job_id if ch.isdigit())
    if not digits:
        raise ValueError(f"SLURM_JOB_ID {job_id!r}")
    return 15000 + int(digits[-4:])


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, expanded as `scontrol show hostnames` does, without Slurm:
    "n[1-3,7],gpu-[01-02]-a" -> n1, n2, n3, n7, gpu-01-a, gpu-02-a (zero padding kept; several
    bracket groups in one name multiply)."""
    names: list[str] = []
    for item in _split_top(nodelist):
        parts = re.split(r"(\[[^\]]*\])", item)
        expanded = [""]
        for part in parts:
            if part.startswith("["):
                choices = []
                for r in part[1:-1].split(","):
                    lo, _, hi = r.partition("-")
                    if not lo.isdigit() or (hi and not hi.isdigit()):
                        raise UsageError(f"SLURM_JOB_NODELIST {nodelist!r}: bad range {r!r}")
                    choices += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi or lo) + 1)]
                expanded = [e + c for e in expanded for c in choices]
            else:
                expanded = [e + part for e in expanded]
        names += [e for e in expanded if e]
    if not names:
        raise UsageError(f"SLURM_JOB_NODELIST {nodelist!r} names no node")
    return names


def _split_top(nodelist: str) -> list[str]:
    """Splits at the commas outside brackets."""
    items, depth, cur = [], 0, ""
    for ch in nodelist:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return [*items, cur]


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

    if env.launcher == "srun":
        return dist.PrefixStore(f"psgd/attempt-{env.attempt}/", _slurm_store(env, timeout_s))
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:  # DistStoreError and friends are RuntimeErrors
        raise NodeError(f"cannot reach torchrun's store at {address(env.master_addr, env.master_port)}: "
                        f"{_first_line(e)}") from None
    return dist.PrefixStore(f"psgd/attempt-{env.attempt}/", store)


def _slurm_store(env: TorchrunEnv, timeout_s: float):
    """Under srun: the TCPStore rank 0 hosts on MASTER_ADDR:MASTER_PORT (on that address only: the
    socket is psgd's, bound there, then given to torch), which the others reach. Also sets
    torchrun's names in this process's environment where unset (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), for what reads them later (a worker's --device spread by LOCAL_RANK)."""
    import torch.distributed as dist  # noqa: PLC0415

    for k, v in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                 ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)):
        if v is not None:
            os.environ.setdefault(k, str(v))
    timeout = timedelta(seconds=timeout_s)
    where = address(env.master_addr, env.master_port)
    try:
        if env.rank == 0:
            family = socket.AF_INET6 if ":" in env.master_addr else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((env.master_addr, env.master_port))
                sock.listen(128)
            except OSError:
                sock.close()
                raise
            return dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout,
                                 wait_for_workers=False, master_listen_fd=sock.detach())
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout)
    except OSError as e:
        raise NodeError(f"cannot host the store on {where} (MASTER_ADDR:MASTER_PORT): {e}") from None
    except (RuntimeError, ValueError) as e:
        raise NodeError(f"cannot reach the store at {where} (rank 0's, under srun): {_first_line(e)}") from None


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
