"""Where `psgd run` starts its children: this host's loopback, or the hosts of a `psgd cluster`.

Contract:
- `--hosts 0` (the default): `loopback(cfg)`, every child on 127.0.0.1 as always: no prefix, no
  bind, no environment of its own.
- `--hosts H`: `on_cluster(cfg)` reads the cluster `psgd cluster up` made (psgd/cluster/netns.py;
  UsageError naming `psgd cluster up` when none is, when it is incomplete, has fewer than H hosts,
  or one of them is missing), places shards and workers (psgd/cluster/placement.py) and gives each
  child its seat: `ip netns exec psgd-NAME-hI` before its command (which execs it: the child is
  still the launcher's own process, so the READY line, the waits, the stop signals and
  PR_SET_PDEATHSIG work as on loopback), and a server its host's address to listen on.
- A server that listens on anything but loopback needs a token (psgd/ps/auth.py): without
  --token-file or $PSGD_TOKEN the launcher makes one per run (`secrets.token_hex`) and hands it to
  every child in $PSGD_TOKEN; config.json never holds it.
- The children's config (`Seats.cfg`) drops --hosts (they are placed already) and, where the kernel
  has no netem (latency_by "socket"), adds `--link unlimited,LATENCY`: psgd's pacer adds the latency
  at the PS sockets, the kernel shapes the bandwidth. gloo's sockets are not psgd's: an all-reduce
  run there goes without the latency, and says so (`record`: latency_applied false).
- All-reduce ranks find each other with the file rendezvous in the run folder (the namespaces
  share the filesystem) and talk over eth0 (GLOO_SOCKET_IFNAME; NCCL without shared memory or GPU
  peer-to-peer, which would bypass the links); LOCAL_RANK and LOCAL_WORLD_SIZE
  count the ranks on the rank's own host, as torchrun would there.
- `record` is what summary.json says under "cluster": which host each process ran on, the link,
  who shaped the bandwidth and who added the latency.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass

from psgd.cluster import netns, placement
from psgd.cluster import plan as cluster_plan
from psgd.core.config import RunConfig
from psgd.core.errors import UsageError
from psgd.ps import auth

# Proxy variables would send gRPC's connections to a proxy no cluster host can reach.
PROXY_VARIABLES = ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY", "GRPC_PROXY")


@dataclass(frozen=True)
class Seat:
    prefix: tuple[str, ...] = ()             # put before the child's command: runs it on its host
    bind: str = ""                           # a server's --bind ("" : the default, 127.0.0.1)
    env: tuple[tuple[str, str], ...] = ()    # this child's own variables


@dataclass(frozen=True)
class Seats:
    cfg: RunConfig                           # what the children get (flags)
    servers: tuple[Seat, ...]
    workers: tuple[Seat, ...]
    env: tuple[tuple[str, str], ...] = ()    # every child's
    unset: tuple[str, ...] = ()              # variables every child goes without
    record: dict | None = None               # summary.json's "cluster" (None on loopback)
    note: str = ""                           # one line the launcher prints before the run

    def environment(self, base: dict) -> dict:
        env = {k: v for k, v in base.items() if k not in self.unset}
        env.update(self.env)
        return env


def seats(cfg: RunConfig) -> Seats:
    return on_cluster(cfg) if cfg.hosts else loopback(cfg)


def loopback(cfg: RunConfig) -> Seats:
    servers = 0 if cfg.mode == "allreduce" else cfg.servers
    return Seats(cfg, (Seat(),) * servers, (Seat(),) * cfg.workers)


def cluster_of(cfg: RunConfig) -> cluster_plan.Cluster:
    """The cluster --hosts asks for, checked; UsageError saying what to run otherwise."""
    netns.need_privileges()  # `ip netns exec` too needs them
    c = netns.load(cfg.cluster)
    make = f"psgd cluster up --hosts {cfg.hosts}" + (f" --name {cfg.cluster}" if cfg.cluster != "lab" else "")
    if c is None:
        raise UsageError(f"--hosts {cfg.hosts}: no cluster named {cfg.cluster!r} is up: `{make}` first")
    if not c.complete:
        raise UsageError(f"--hosts {cfg.hosts}: cluster {cfg.cluster!r} is incomplete (its `up` is running or died): "
                         f"`psgd cluster down --name {cfg.cluster}`, then `{make}`")
    if len(c.hosts) < cfg.hosts:
        raise UsageError(f"--hosts {cfg.hosts}: cluster {cfg.cluster!r} has {len(c.hosts)} host(s): `psgd cluster "
                         f"down --name {cfg.cluster}`, then `{make}`")
    there = netns.present()
    gone = [h.namespace for h in c.hosts[:cfg.hosts] if h.namespace not in there]
    if gone:
        raise UsageError(f"--hosts {cfg.hosts}: {gone[0]} of cluster {cfg.cluster!r} is gone: `psgd cluster down "
                         f"--name {cfg.cluster}`, then `{make}`")
    return c


def on_cluster(cfg: RunConfig) -> Seats:
    c = cluster_of(cfg)
    try:
        where = placement.place(cfg.mode, cfg.servers, cfg.workers, cfg.hosts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    allreduce = cfg.mode == "allreduce"
    pace = "" if allreduce else c.pacer_link()
    child = dataclasses.replace(cfg, hosts=0, link=pace)

    def prefix(i: int) -> tuple[str, ...]:
        return ("ip", "netns", "exec", c.hosts[i].namespace)

    servers = tuple(Seat(prefix(i), bind=c.hosts[i].address) for i in where.servers)
    workers = []
    for r, i in enumerate(where.workers):
        local, local_world = where.local(r)
        # NCCL sees one hostname on every namespace and would move the bytes through shared memory
        # or GPU peer-to-peer, past the shaped links: sockets only, over eth0.
        env = (("GLOO_SOCKET_IFNAME", cluster_plan.HOST_IF), ("NCCL_SOCKET_IFNAME", cluster_plan.HOST_IF),
               ("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_IB_DISABLE", "1"),
               ("LOCAL_RANK", str(local)), ("LOCAL_WORLD_SIZE", str(local_world)))
        workers.append(Seat(prefix(i), env=env))
    token = () if allreduce or cfg.token_file or os.environ.get(auth.ENV) else ((auth.ENV, secrets.token_hex(32)),)
    shaping = link_record(c, cfg.mode)
    record = dict(
        name=c.name, hosts=cfg.hosts, **shaping,
        placement={**{f"server {k}": f"{c.hosts[i].name} {c.hosts[i].address}" for k, i in enumerate(where.servers)},
                   **{f"worker {r}": f"{c.hosts[i].name} {c.hosts[i].address}" for r, i in enumerate(where.workers)}})
    note = "" if shaping["latency_applied"] else (
        f"psgd run: note: cluster {c.name!r} has no netem, and gloo's sockets are not psgd's to pace: this "
        f"all-reduce run goes without the {c.latency_s * 1e6:g} us latency (the kernel still shapes the bandwidth)")
    return Seats(child, servers, tuple(workers), token, PROXY_VARIABLES, record, note)


def link_record(c: cluster_plan.Cluster, mode: str) -> dict:
    """What a run of `mode` on cluster c records about its link (summary.json's "cluster"): the
    link as given to `up`, who shaped the bandwidth, who added the latency. The suite's run cache
    compares it with the cluster up now (psgd/lab/runcache.py `is_cached`): a run's config names the
    cluster but not its link, and `psgd cluster up` may make that name again with another."""
    allreduce = mode == "allreduce"
    latency_applied = c.latency_by != "socket" or not allreduce
    unpaced = "none (gloo's sockets are not psgd's to pace; no netem)"
    return dict(link=c.link or "unshaped", bandwidth_by="kernel (tbf)" if c.shaped else "none (unshaped veth)",
                latency_by=c.latency_by if latency_applied else unpaced, latency_applied=latency_applied,
                pacer_link="" if allreduce else c.pacer_link())
