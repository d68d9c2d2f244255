"""The plan of a `psgd cluster`: its hosts, their addresses, and the exact `ip` / `tc` commands, in order.

Pure: nothing here runs a command or reads the system. psgd/cluster/netns.py applies a plan and
undoes it; tests read plans without privileges.

Topology: one network namespace per host, one more for the switch, and nothing in the root
namespace (no device of it is created, moved or changed):

      psgd-NAME-h0             psgd-NAME-h1              ...    one namespace per host
      lo, eth0 198.18.0.1/24   lo, eth0 198.18.0.2/24           (no default route)
           | veth                   | veth
      +----h0----------------------h1---------- ... ---+
      |              br0: a bridge, no address         |        psgd-NAME-sw, the switch
      +------------------------------------------------+        (no uplink, no NAT, no route)

- Addresses: host i is 198.18.0.(i+1)/24, inside 198.18.0.0/15, the block reserved for network
  benchmarking (RFC 2544; RFC 6890: not forwardable beyond a lab). Each host's routing table holds
  its /24 and loopback, and no default route; the bridge has no uplink: a packet to any other
  address has no route (`routes_out` checks a host's table). Clusters of different names reuse
  the same addresses: their bridges never meet.
- IPv6 is off in every namespace: no link-local addresses, router solicitations or MLD reports on
  the links, so what crosses them is the run's traffic.
- Bandwidth, both ways of every host's link: a tbf qdisc (token bucket) on the host's eth0 shapes
  what it sends, one on its switch port what it receives (so N workers pushing to one shard meet
  in the queue of the shard's port, as on a real switch). See `shaping` for burst and queue.
- Latency (one-way, host to host): netem where the kernel has it, half on each side (the sender's
  eth0, the receiver's switch port), so a message from A to B waits the latency once; where it
  has not (latency_by "socket"), psgd's pacer adds it at the worker's sockets (`pacer_link`:
  `--link unlimited,LATENCY`, psgd/core/link.py) and the kernel still shapes the bandwidth.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from dataclasses import dataclass

from psgd.core import link as link_mod

RESERVED = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544's benchmarking block
SUBNET = ipaddress.ip_network("198.18.0.0/24")    # the hosts' subnet, inside it
MAX_HOSTS = 250                                   # 198.18.0.1 .. .250
PREFIX = "psgd-"                                  # every namespace psgd makes starts with this
BRIDGE = "br0"                                    # in the switch namespace
HOST_IF = "eth0"                                  # in each host namespace
NAME = re.compile(r"[a-z][a-z0-9]{0,15}")         # no '-': psgd-NAME-h1 reads back one way only
LATENCY_BY = ("none", "netem", "socket")
STATE_VERSION = 1

# Measured on this machine's kernel (two namespaces, one TCP stream, 1 MiB sendall, tbf both ways):
# at 1gbit a burst of 3000 B gave 150 Mbit/s, 64 KiB 496, 125 KB 933 and 250 KB 945; at 200mbit
# every burst from 3000 B to 130 KB gave 191. The bucket must cover the gap between two wake-ups
# of the qdisc's watchdog (a busy VM's softirq, not the nanosecond timer) and a whole GSO segment
# (64 KiB: veth hands TCP's segments over unsplit; a smaller burst makes tbf split them in software).
BURST_S = 2e-3
MIN_BURST = 64 * 1024
# The queue behind the bucket: 5 ms of the rate, like a switch port's buffer. Enough that TCP keeps
# the link busy (veth round trips are ~50 us; 0.5, 1.25 and 2.5 MB at 1gbit all gave 950-957 Mbit/s)
# and short enough that a full queue adds at most 5 ms to a message.
QUEUE_S = 5e-3
NETEM_MIN_PACKETS = 1000  # netem's own default queue, in packets


@dataclass(frozen=True)
class Shaping:
    """One direction of one host's link, as tbf takes it."""
    rate_bit: int     # bits per second
    burst: int        # bytes the bucket holds: sent at the device's speed after an idle moment
    limit: int        # bytes queued behind the bucket before tbf drops (the port's buffer)


def shaping(bits_per_s: float) -> Shaping:
    """tbf's parameters for a link of `bits_per_s` (see BURST_S and QUEUE_S for the measurements)."""
    per_s = bits_per_s / 8
    burst = max(MIN_BURST, math.ceil(per_s * BURST_S))
    return Shaping(int(bits_per_s), burst, burst + math.ceil(per_s * QUEUE_S))


@dataclass(frozen=True)
class Host:
    index: int
    name: str        # h0, h1, ...: also its port's name on the bridge
    namespace: str   # psgd-NAME-h0
    address: str     # 198.18.0.1


@dataclass(frozen=True)
class Cluster:
    """What `psgd cluster up` made (the state file holds exactly this, `to_dict`)."""
    name: str
    hosts: tuple[Host, ...]
    link: str                 # as given to `up`: "1gbit,200us"; "" unshaped (veth speed)
    latency_by: str = "none"  # "none" (no latency asked), "netem" (the kernel), "socket" (psgd's pacer)
    complete: bool = False    # False while `up` runs, or when it was killed midway: `down` cleans up

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.name}-sw"

    @property
    def namespaces(self) -> tuple[str, ...]:
        """In the order `up` makes them (`down` deletes them in reverse)."""
        return (self.switch, *(h.namespace for h in self.hosts))

    @property
    def parsed_link(self) -> link_mod.Link | None:
        return link_mod.parse(self.link)

    @property
    def shaped(self) -> Shaping | None:
        lk = self.parsed_link
        return shaping(lk.bits_per_s) if lk and math.isfinite(lk.bits_per_s) else None

    @property
    def latency_s(self) -> float:
        lk = self.parsed_link
        return lk.latency_s if lk else 0.0

    def pacer_link(self) -> str:
        """The --link psgd's own sockets must add on this cluster: the latency the kernel does not."""
        return f"unlimited,{self.latency_s * 1e6:g}us" if self.latency_by == "socket" else ""

    def host(self, key: str) -> Host:
        """A host by index ("1"), name ("h1") or namespace ("psgd-lab-h1"); ValueError otherwise."""
        for h in self.hosts:
            if key in (str(h.index), h.name, h.namespace):
                return h
        raise ValueError(f"cluster {self.name!r} has no host {key!r}: give 0..{len(self.hosts) - 1} or "
                         f"h0..h{len(self.hosts) - 1}")


def describe(name: str, hosts: int, link: str = "", netem: bool = False) -> Cluster:
    """The cluster `up` will make; ValueError (one line) for a bad name, host count or link.
    `netem`: whether the kernel has it (the probe's answer), which decides latency_by."""
    if not NAME.fullmatch(name):
        raise ValueError(f"--name must be a lowercase letter then up to 15 lowercase letters or digits, got {name!r}")
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--hosts must be in 1..{MAX_HOSTS}, got {hosts}")
    lk = link_mod.parse(link)  # ValueError with the accepted forms
    latency_by = "none" if not lk or lk.latency_s == 0 else ("netem" if netem else "socket")
    first = SUBNET.network_address + 1
    return Cluster(name, tuple(Host(i, f"h{i}", f"{PREFIX}{name}-h{i}", str(first + i)) for i in range(hosts)),
                   link.strip().lower(), latency_by)


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    creates: str = ""  # the namespace this step makes: undoing it is deleting that namespace


def namespace_steps(c: Cluster) -> list[Step]:
    """Make every namespace, and turn IPv6 off in it before any device exists there."""
    steps = []
    for ns in c.namespaces:
        steps.append(Step(("ip", "netns", "add", ns), creates=ns))
        steps.append(Step(("ip", "netns", "exec", ns, "sysctl", "-q", "-e", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                           "net.ipv6.conf.default.disable_ipv6=1")))
    return steps


def netem_probe(c: Cluster) -> tuple[Step, Step]:
    """Add netem to the switch namespace's lo, and remove it: a device of the cluster's own that
    carries nothing (never one of the root namespace). The first failing means no netem here."""
    return (Step(("tc", "-n", c.switch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")),
            Step(("tc", "-n", c.switch, "qdisc", "del", "dev", "lo", "root")))


def wire_steps(c: Cluster) -> list[Step]:
    """The bridge, each host's veth, address and routes (the kernel's, for the /24 only), its shaping."""
    sw = c.switch
    steps = [Step(("ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge")),
             Step(("ip", "-n", sw, "link", "set", BRIDGE, "up"))]
    for h in c.hosts:
        ns = h.namespace
        steps += [
            # Made inside the switch namespace with its peer put straight into the host's: the pair
            # never exists in the root namespace, not even for a moment.
            Step(("ip", "-n", sw, "link", "add", h.name, "type", "veth", "peer", "name", HOST_IF, "netns", ns)),
            Step(("ip", "-n", sw, "link", "set", h.name, "master", BRIDGE)),
            Step(("ip", "-n", sw, "link", "set", h.name, "up")),
            Step(("ip", "-n", ns, "link", "set", "lo", "up")),
            Step(("ip", "-n", ns, "addr", "add", f"{h.address}/{SUBNET.prefixlen}", "dev", HOST_IF)),
            Step(("ip", "-n", ns, "link", "set", HOST_IF, "up")),
        ]
        for where, dev in ((ns, HOST_IF), (sw, h.name)):  # what the host sends, what it receives
            steps += [Step(("tc", "-n", where, "qdisc", "add", "dev", dev, *q)) for q in qdiscs(c)]
    return steps


def qdiscs(c: Cluster) -> list[tuple[str, ...]]:
    """The qdisc arguments (after `tc qdisc add dev DEV`) for one direction of a host's link."""
    s = c.shaped
    tbf = ("tbf", "rate", f"{s.rate_bit}bit", "burst", str(s.burst), "limit", str(s.limit)) if s else ()
    if c.latency_by != "netem":
        return [("root", *tbf)] if tbf else []
    half_us = c.latency_s / 2 * 1e6
    lk = c.parsed_link
    # netem holds every packet for the delay: room for a delay's worth at the rate, twice over.
    inflight = lk.bits_per_s * c.latency_s / 8 / 1500 * 2 if s else 0
    netem = ("root", "handle", "1:", "netem", "delay", f"{half_us:g}us",
             "limit", str(max(NETEM_MIN_PACKETS, math.ceil(inflight))))
    return [netem, ("parent", "1:1", "handle", "10:", *tbf)] if tbf else [netem]


def down_steps(c: Cluster, present: set[str]) -> list[Step]:
    """Delete the cluster's namespaces that are there, hosts first: deleting a namespace deletes its
    devices, so the veths, the bridge and every qdisc go with them."""
    return [Step(("ip", "netns", "del", ns)) for ns in reversed(c.namespaces) if ns in present]


def exec_argv(c: Cluster, host: str, cmd: list[str]) -> list[str]:
    """`psgd cluster exec HOST -- CMD`: run CMD in that host's namespace (ip netns exec execs it:
    no process in between, so its exit code and signals are CMD's own)."""
    return ["ip", "netns", "exec", c.host(host).namespace, *cmd]


def routes_out(routes: list[dict]) -> list[dict]:
    """The routes of a host's table (`ip -j route show table all`, any family) that lead anywhere
    but the cluster's subnet or loopback: a default route, another prefix, another device."""
    bad = []
    for r in routes:
        dst = r.get("dst", "")
        if dst in ("default", "0.0.0.0/0", "::/0") or r.get("gateway") or r.get("dev") not in ("lo", HOST_IF):
            bad.append(r)
            continue
        net = ipaddress.ip_network(dst, strict=False)
        if not (net.subnet_of(SUBNET) if net.version == 4 and r.get("dev") == HOST_IF else net.is_loopback):
            bad.append(r)
    return bad


# -- the state file -------------------------------------------------------------------------------
def to_dict(c: Cluster) -> dict:
    return dict(version=STATE_VERSION, **dataclasses.asdict(c))


def from_dict(d: dict) -> Cluster:
    """The inverse of to_dict; ValueError when the file is not a cluster psgd wrote, or names a
    namespace outside this cluster's own names (`down` deletes what it names: only psgd's)."""
    if d.get("version") != STATE_VERSION:
        raise ValueError(f"not a psgd cluster state file of version {STATE_VERSION}")
    try:
        c = Cluster(d["name"], tuple(Host(**h) for h in d["hosts"]), d["link"], d["latency_by"], d["complete"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"bad cluster state: {e}") from None
    expected = describe(c.name, len(c.hosts), c.link)
    if c.hosts != expected.hosts or c.latency_by not in LATENCY_BY:
        raise ValueError(f"cluster state of {c.name!r} names hosts psgd would not have made")
    return c
