"""`psgd cluster up | status | exec | down`: hosts as network namespaces, links shaped by the kernel.

    psgd cluster up --hosts 5 --link 1gbit,200us     # five hosts, 198.18.0.1-5, on one bridge
    psgd cluster status                              # hosts, addresses, link, who adds the latency
    psgd cluster exec h1 -- python -c 'import socket; print(socket.gethostname())'
    psgd run --hosts 5 --mode sync --workers 4       # the shard on h0, a worker on each of h1-h4
    psgd cluster down

Bad input is one line and exit 2 (psgd/cli.py prints UsageError); a failed `ip` / `tc` command
is one line and exit 1, after `up` undid what it had made; Ctrl-C likewise, exit 130.
`exec` passes its command's exit code through. psgd/cluster/plan.py draws the topology.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from psgd.cluster import netns, plan
from psgd.core.errors import Parser, UsageError

DEFAULT_NAME = "lab"


def build_parser() -> Parser:
    top = Parser(prog="psgd cluster", description="Hosts as network namespaces on one bridge, with links shaped "
                 "by the kernel (tc), in 198.18.0.0/24 and with no route off the machine. Needs root.")
    sub = top.add_subparsers(dest="action", required=True, parser_class=Parser)
    p = sub.add_parser("up", help="make the hosts, the bridge, and shape every host's link both ways")
    p.add_argument("--hosts", type=int, required=True, help="how many hosts (namespaces psgd-NAME-h0..)")
    p.add_argument("--link", default="", metavar="BANDWIDTH[,LATENCY]",
                   help="each host's link, e.g. 1gbit,200us or 200mbit (default: unshaped, the veth's speed); "
                        "latency by netem where the kernel has it, else by psgd's pacer in psgd run")
    p.add_argument("--name", default=DEFAULT_NAME, help="the cluster's name (default: %(default)s)")
    p = sub.add_parser("status", help="the cluster(s): hosts, addresses, link, and whether each namespace is there")
    p.add_argument("--name", default="", help="only this cluster (default: every cluster psgd made)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("exec", help="run a command on one host: psgd cluster exec HOST -- CMD ...")
    p.add_argument("host", metavar="HOST", help="0, 1, ... or h0, h1, ...")
    p.add_argument("--name", default=DEFAULT_NAME, help="the cluster's name (default: %(default)s)")
    p = sub.add_parser("down", help="delete the cluster: its namespaces, and with them its veths, bridge and qdiscs")
    p.add_argument("--name", default=DEFAULT_NAME, help="the cluster's name (default: %(default)s)")
    p.add_argument("--kill", action="store_true", help="end processes still running on its hosts (else refused)")
    return top


def main(argv: list[str]) -> int:
    argv = list(argv)
    cmd: list[str] = []
    if "--" in argv:  # `exec HOST -- CMD`: everything after -- is the command, flags included
        cmd, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    a = build_parser().parse_args(argv)
    if a.action != "exec" and cmd:
        raise UsageError(f"`psgd cluster {a.action}` takes no command after --")
    try:
        if a.action == "up":
            return _up(a)
        if a.action == "status":
            return _status(a)
        if a.action == "exec":
            return _exec(a, cmd)
        c = netns.down(a.name, kill=a.kill)
        last = f"..{c.hosts[-1].name}" if len(c.hosts) > 1 else ""
        print(f"cluster {c.name!r} is down: deleted its {len(c.namespaces)} namespaces ({c.switch}, "
              f"{c.hosts[0].namespace}{last}) and with them its veths, bridge and qdiscs")
        return 0
    except netns.ClusterError as e:
        undone = "; undid what it had made" if a.action == "up" and "could not undo" not in str(e) else ""
        print(f"psgd cluster {a.action}: failed: {e}{undone}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"psgd cluster {a.action}: interrupted" + ("; undid what it had made" if a.action == "up" else ""),
              file=sys.stderr)
        return 130


def _up(a: argparse.Namespace) -> int:
    c = netns.up(a.name, a.hosts, a.link)
    print(describe(c))
    return 0


def describe(c: plan.Cluster, there: set[str] | None = None) -> str:
    """A few lines a person reads: the link and who shapes it, then one line per host."""
    s = c.shaped
    bandwidth = (f"bandwidth {s.rate_bit / 1e6:g} Mbit/s each way by the kernel (tbf, burst {s.burst} B, queue "
                 f"{s.limit} B)") if s else "bandwidth unshaped (the veth's speed)"
    latency = {"none": "no latency added",
               "netem": f"latency {c.latency_s * 1e6:g} us by the kernel (netem)",
               "socket": f"latency {c.latency_s * 1e6:g} us by psgd's pacer at the sockets (no netem in this "
                         f"kernel; psgd run adds --link {c.pacer_link()})"}[c.latency_by]
    state = "" if c.complete else " [INCOMPLETE: an `up` is running or died; `psgd cluster down` cleans up]"
    lines = [f"cluster {c.name!r}: {len(c.hosts)} host(s) on a bridge in {c.switch}, link {c.link or 'unshaped'}: "
             f"{bandwidth}, {latency}{state}"]
    for h in c.hosts:
        mark = "" if there is None else ("  present" if h.namespace in there else "  MISSING")
        lines.append(f"  {h.name:<4} {h.address:<12} {h.namespace}{mark}")
    return "\n".join(lines)


def _status(a: argparse.Namespace) -> int:
    clusters = [c for c in netns.all_clusters() if not a.name or c.name == a.name]
    there = netns.present()
    if a.json:
        print(json.dumps([dict(plan.to_dict(c), present={ns: ns in there for ns in c.namespaces},
                               pacer_link=c.pacer_link()) for c in clusters], indent=1))
    elif not clusters:
        print(f"no cluster{f' named {a.name!r}' if a.name else ''} is up (psgd cluster up --hosts H makes one)")
    for c in [] if a.json else clusters:
        print(describe(c, there))
    return 0 if clusters else 1


def _exec(a: argparse.Namespace, cmd: list[str]) -> int:
    if not cmd:
        raise UsageError("give the command after --: psgd cluster exec HOST -- CMD ...")
    netns.need_privileges()
    c = netns.load(a.name)
    if c is None:
        raise UsageError(f"no cluster named {a.name!r} is up (psgd cluster up --hosts H --name {a.name})")
    try:
        argv = plan.exec_argv(c, a.host, cmd)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rc = subprocess.run(argv).returncode
    return rc if rc >= 0 else 128 - rc  # killed by signal S: 128 + S, as a shell says it
