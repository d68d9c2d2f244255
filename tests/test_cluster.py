"""`psgd cluster`: the plan (pure, no privileges), and with root real namespaces, links and runs across them.

The real tests share one 2-host cluster (module fixture) with a name of their own, so that test
processes running side by side never meet; it is taken down in the fixture's teardown whatever
happened. Nothing here sends a byte anywhere but between the cluster's own hosts: isolation is
checked by reading the routing tables, never by trying an outside address.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import secrets
import subprocess
import sys

import pytest
import torch

from psgd.cluster import netns, placement, plan, probe
from psgd.core import config as C
from psgd.core import link
from psgd.core.errors import UsageError
from psgd.train import evaluate
from tests.helpers import ENV, processes_mentioning, processes_with_env, psgd_main, summary, train_in_threads

pytestmark = pytest.mark.xdist_group("cluster")  # one worker runs them all: one cluster, made once

RATE = "200mbit"
LINK = f"{RATE},100us"  # no netem here: the latency goes to psgd's pacer (latency_by "socket")
TIMEOUT_S = 60
TINY = ["--dataset", "synthetic", "--num-samples", "2000", "--model", "mlp", "--width", "32", "--batch-size", "16",
        "--steps", "10", "--seed", "3", "--device", "cpu", "--threads", "1", "--eval-every", "0", "--quiet"]


def unique_name() -> str:
    return f"t{os.getpid()}p{secrets.token_hex(2)}"  # the test process's pid: see remove_stale_test_clusters


def remove_stale_test_clusters() -> None:
    """Clusters these tests made in a test process that is gone (killed before its teardown ran)."""
    for c in netns.all_clusters():
        m = re.fullmatch(r"t(\d+)p[0-9a-f]{4}", c.name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            netns.down(c.name, kill=True)


def privileges() -> str | None:
    try:
        netns.need_privileges()
    except UsageError as e:
        return str(e)
    return None


needs_root = pytest.mark.skipif(privileges() is not None, reason=f"not root: {privileges()}")


# -- the plan: pure ---------------------------------------------------------------------------------
def test_hosts_get_addresses_of_the_benchmarking_block_and_names_of_their_own():
    c = plan.describe("lab", 5, "1gbit,200us")
    addresses = [ipaddress.ip_address(h.address) for h in c.hosts]
    assert all(a in plan.RESERVED and a in plan.SUBNET for a in addresses)
    assert plan.SUBNET.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
    assert [str(a) for a in addresses] == [f"198.18.0.{i}" for i in range(1, 6)]
    assert c.namespaces == ("psgd-lab-sw", *(f"psgd-lab-h{i}" for i in range(5)))
    assert c.latency_by == "socket" and plan.describe("lab", 5, "1gbit,200us", netem=True).latency_by == "netem"
    assert plan.describe("lab", 2, "1gbit").latency_by == "none"
    assert c.host("2") == c.host("h2") == c.host("psgd-lab-h2") == c.hosts[2]
    with pytest.raises(ValueError, match="no host 'h5': give 0..4"):
        c.host("h5")


@pytest.mark.parametrize("name,hosts,link_,message", [
    ("Lab", 2, "", "--name must be"), ("a-b", 2, "", "--name must be"), ("lab", 0, "", "--hosts must be in 1..250"),
    ("lab", 251, "", "--hosts must be in"), ("lab", 2, "fast", "--link expects"),
])
def test_bad_input_is_one_line(name, hosts, link_, message):
    with pytest.raises(ValueError, match=message):
        plan.describe(name, hosts, link_)


def test_every_command_acts_inside_the_clusters_own_namespaces():
    """No step touches the root namespace: each names one of the cluster's namespaces as where it
    acts (ip -n / tc -n NS, ip netns add|exec NS), and a veth's peer goes straight into a host."""
    for netem in (False, True):
        c = plan.describe("lab", 3, LINK, netem=netem)
        steps = plan.namespace_steps(c) + plan.wire_steps(c) + list(plan.netem_probe(c))
        for step in steps:
            argv = step.argv
            where = argv[2] if argv[1] == "-n" else argv[3]
            assert argv[0] in ("ip", "tc") and where in c.namespaces, argv
            if "veth" in argv:
                assert argv[argv.index("netns") + 1] in c.namespaces
        assert [s.creates for s in steps if s.creates] == list(c.namespaces)


def test_both_directions_of_every_link_are_shaped():
    c = plan.describe("lab", 2, RATE)
    tbf = [s.argv for s in plan.wire_steps(c) if "tbf" in s.argv]
    assert {(a[2], a[6]) for a in tbf} == {("psgd-lab-h0", "eth0"), ("psgd-lab-sw", "h0"),
                                          ("psgd-lab-h1", "eth0"), ("psgd-lab-sw", "h1")}
    assert all(a[a.index("rate") + 1] == "200000000bit" for a in tbf)
    assert not [s for s in plan.wire_steps(plan.describe("lab", 2, "")) if s.argv[0] == "tc"]  # unshaped


def test_netem_takes_half_the_latency_on_each_side_and_tbf_below_it():
    c = plan.describe("lab", 2, "1gbit,200us", netem=True)
    assert plan.qdiscs(c)[0][:6] == ("root", "handle", "1:", "netem", "delay", "100us")
    assert plan.qdiscs(c)[1][:5] == ("parent", "1:1", "handle", "10:", "tbf")
    assert plan.qdiscs(plan.describe("lab", 2, "1gbit,200us"))[0][:2] == ("root", "tbf")  # socket: tbf only


def test_burst_and_queue_follow_the_rate():
    slow, fast = plan.shaping(200e6), plan.shaping(1e9)
    assert slow.burst == 64 * 1024 and fast.burst == 250_000      # a GSO segment; 2 ms of 1 Gbit/s
    assert fast.limit == fast.burst + 625_000                     # + 5 ms of the rate
    assert plan.shaping(10e9).burst == 2_500_000


def test_the_pacer_adds_only_the_latency_the_kernel_does_not():
    c = plan.describe("lab", 2, LINK)
    assert c.pacer_link() == "unlimited,100us"
    paced = link.parse(c.pacer_link())
    assert paced.latency_s == pytest.approx(100e-6) and math.isinf(paced.bits_per_s) and paced.seconds_per_byte == 0
    assert plan.describe("lab", 2, LINK, netem=True).pacer_link() == plan.describe("lab", 2, RATE).pacer_link() == ""


def test_the_state_round_trips_and_names_only_psgds_namespaces():
    c = dataclasses.replace(plan.describe("lab", 3, LINK), complete=True)
    assert plan.from_dict(json.loads(json.dumps(plan.to_dict(c)))) == c
    tampered = plan.to_dict(c)
    tampered["hosts"][1]["namespace"] = "eth0-of-someone-else"
    with pytest.raises(ValueError, match="would not have made"):
        plan.from_dict(tampered)
    with pytest.raises(ValueError, match="version"):
        plan.from_dict({**plan.to_dict(c), "version": 99})


def test_state_files_are_read_back(tmp_path):
    c = dataclasses.replace(plan.describe("lab", 2, RATE), complete=True)
    (tmp_path / "cluster-lab.json").write_text(json.dumps(plan.to_dict(c)))
    assert netns.load("lab", tmp_path) == c and netns.load("other", tmp_path) is None
    assert netns.all_clusters(tmp_path) == [c]
    (tmp_path / "cluster-bad.json").write_text("{")
    with pytest.raises(UsageError, match="cluster-bad.json"):
        netns.load("bad", tmp_path)


def test_routes_out_flags_everything_but_the_subnet_and_loopback():
    ours = [{"dst": "198.18.0.0/24", "dev": "eth0", "protocol": "kernel", "scope": "link", "prefsrc": "198.18.0.1"},
            {"type": "local", "dst": "127.0.0.0/8", "dev": "lo", "table": "local"},
            {"type": "local", "dst": "198.18.0.1", "dev": "eth0", "table": "local"},
            {"type": "broadcast", "dst": "198.18.0.255", "dev": "eth0", "table": "local"}]
    assert plan.routes_out(ours) == []
    bad = [{"dst": "default", "gateway": "198.18.0.254", "dev": "eth0"}, {"dst": "10.0.0.0/8", "dev": "eth0"},
           {"dst": "198.18.1.0/24", "dev": "eth0"}, {"dst": "198.18.0.0/24", "dev": "eth1"},
           {"type": "multicast", "dst": "ff00::/8", "dev": "eth0", "table": "local"}]
    assert plan.routes_out(ours + bad) == bad


def test_placement_gives_shards_hosts_of_their_own():
    p = placement.place("sync", servers=2, workers=3, hosts=5)
    assert p.servers == (0, 1) and p.workers == (2, 3, 4)
    shared = placement.place("async", servers=1, workers=4, hosts=3)   # workers share the hosts left
    assert shared.servers == (0,) and shared.workers == (1, 2, 1, 2) and shared.local(2) == (1, 2)
    assert placement.place("allreduce", servers=1, workers=3, hosts=2).workers == (0, 1, 0)
    with pytest.raises(ValueError, match="--hosts 2 is too few for 2 shard"):
        placement.place("sync", servers=2, workers=1, hosts=2)


def test_hosts_and_link_do_not_mix():
    with pytest.raises(ValueError, match="psgd cluster up --link"):
        C.validate(C.RunConfig(hosts=2, link="1gbit"))
    with pytest.raises(ValueError, match="--hosts must be >= 0"):
        C.validate(C.RunConfig(hosts=-1))


def test_without_privileges_it_says_what_to_run_instead(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns, "_has_caps", lambda *bits: False)
    for args in (["cluster", "up", "--hosts", "2", "--name", unique_name()], ["run", "--hosts", "2"]):
        r = psgd_main(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)" in r.stderr and "psgd run --link" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["cluster", "up", "--hosts", "0"], "--hosts must be in 1..250"),
    (["cluster", "up", "--hosts", "2", "--link", "1gb"], "--link expects"),
    (["cluster", "exec", "h0"], "give the command after --"),
    (["cluster", "down", "--", "ls"], "takes no command"),
    (["cluster", "bogus"], "invalid choice"),
])
def test_cluster_usage_errors_are_one_line_exit_2(args, message):
    r = psgd_main(*args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_run_on_hosts_without_a_cluster_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "need_privileges", lambda: None)
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)  # an empty state folder: no cluster is up
    r = psgd_main("run", "--hosts", "2", "--cluster", "nosuch", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "no cluster named 'nosuch' is up: `psgd cluster up --hosts 2 --name nosuch`" \
        in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


# -- real namespaces (root) ---------------------------------------------------------------------------
def ours(prefix: str) -> set[str]:
    return {ns for ns in netns.present() if ns.startswith(prefix)}


def root_namespace() -> tuple[str, ...]:
    """What a cluster must never change: the root namespace's devices, qdiscs and routes (read-only)."""
    return tuple(netns.run(argv) for argv in (["ip", "-o", "link", "show"], ["tc", "qdisc", "show"],
                                              ["ip", "route", "show", "table", "all"]))


@pytest.fixture(scope="module")
def cluster():
    remove_stale_test_clusters()
    name = unique_name()
    before = root_namespace()
    c = netns.up(name, 2, LINK)
    try:
        yield c
    finally:
        netns.down(name, kill=True)
        assert ours(f"psgd-{name}-") == set() and not netns.state_path(name).exists()
        assert root_namespace() == before


@needs_root
def test_up_status_down_leaves_nothing_behind():
    name = unique_name()
    others = netns.present() - ours(f"psgd-{name}-")
    r = psgd_main("cluster", "up", "--hosts", "1", "--link", RATE, "--name", name)
    try:
        assert r.returncode == 0, r.stderr
        assert ours(f"psgd-{name}-") == {f"psgd-{name}-sw", f"psgd-{name}-h0"}
        s = psgd_main("cluster", "status", "--name", name, "--json")
        (state,) = json.loads(s.stdout)
        assert s.returncode == 0 and state["complete"] and all(state["present"].values())
        assert state["hosts"][0]["address"] == "198.18.0.1" and state["latency_by"] == "none"
    finally:
        d = psgd_main("cluster", "down", "--name", name)
    assert d.returncode == 0, d.stderr
    assert ours(f"psgd-{name}-") == set() and not netns.state_path(name).exists()
    assert {ns for ns in netns.present() if not ns.startswith("psgd-")} == {n for n in others if
                                                                              not n.startswith("psgd-")}
    again = psgd_main("cluster", "down", "--name", name)
    assert again.returncode == 2 and f"no cluster named {name!r} is up" in again.stderr


@needs_root
def test_a_second_up_says_so_and_leaves_the_first_alone(cluster):
    r = psgd_main("cluster", "up", "--hosts", "3", "--name", cluster.name)
    assert r.returncode == 2 and f"a cluster named {cluster.name!r} is already up (2 host(s)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert netns.load(cluster.name) == cluster and ours(f"psgd-{cluster.name}-") == set(cluster.namespaces)


@needs_root
@pytest.mark.parametrize("failure", ["a failing command", "Ctrl-C"])
def test_an_up_that_fails_midway_undoes_what_it_made(monkeypatch, failure):
    name = unique_name()
    calls = []
    real_run = netns.run

    def run(step, timeout=netns.COMMAND_TIMEOUT_S):
        calls.append(step)
        if len(calls) == 9:  # after the namespaces, while wiring the first host
            if failure == "Ctrl-C":
                raise KeyboardInterrupt
            step = ["ip", "-n", f"psgd-{name}-h0", "link", "set", "no-such-device", "up"]
        return real_run(step, timeout)

    monkeypatch.setattr(netns, "run", run)
    with pytest.raises(KeyboardInterrupt if failure == "Ctrl-C" else netns.ClusterError):
        netns.up(name, 2, RATE)
    assert ours(f"psgd-{name}-") == set() and not netns.state_path(name).exists()


@needs_root
def test_no_route_leads_out_of_the_cluster(cluster):
    for h in cluster.hosts:
        table = netns.routes(h.namespace)
        assert plan.routes_out(table) == [] and not [r for r in table if r.get("dst") == "default"], table
        assert {"dst": "198.18.0.0/24", "dev": "eth0"}.items() <= next(r for r in table if "table" not in r).items()
    assert netns.routes(cluster.switch) == []  # the switch has no address, so no route at all


@needs_root
def test_a_shaped_link_carries_its_rate(cluster):
    """A raw TCP transfer from h0 to h1 crosses h0's shaped upload and h1's shaped download."""
    nbytes, seconds = probe.goodput(cluster, "h0", "h1", 8 << 20)
    measured = nbytes * 8 / seconds
    assert nbytes == 8 << 20 and abs(measured / link.parse(RATE).bits_per_s - 1) < 0.15, measured
    before = probe.wire_bytes(cluster, "h1")
    probe.goodput(cluster, "h0", "h1", 1 << 20)
    assert probe.wire_bytes(cluster, "h1") - before > 1 << 20  # the kernel's count, headers included


@needs_root
def test_a_process_knows_which_host_it_runs_on_and_calibrate_wants_another_than_the_shards(cluster):
    where = f"from psgd.cluster import netns; print(netns.host_here(netns.load({cluster.name!r})))"
    seen = [subprocess.run(["ip", "netns", "exec", h.namespace, sys.executable, "-c", where], capture_output=True,
                           text=True, timeout=TIMEOUT_S, env=ENV).stdout for h in cluster.hosts]
    assert [f"name='{h.name}'" in s for h, s in zip(cluster.hosts, seen, strict=True)] == [True, True], seen
    assert netns.host_here(cluster) is None  # this process: the root namespace
    r = psgd_main("bench", "calibrate", "--cluster", cluster.name, "--shard-host", "h0", "--no-ring")
    assert r.returncode == 2 and f"psgd cluster exec h1 --name {cluster.name} --" in r.stderr, r.stderr


@needs_root
def test_exec_runs_on_the_host_and_passes_the_exit_code(cluster, tmp_path):
    seen = tmp_path / "addr"
    r = psgd_main("cluster", "exec", "h1", "--name", cluster.name, "--", "sh", "-c",
                  f"ip -br -4 addr show eth0 > {seen}; exit 3")
    assert r.returncode == 3 and "198.18.0.2/24" in seen.read_text()


@needs_root
def test_down_refuses_while_a_host_runs_a_process(cluster):
    proc = subprocess.Popen(["ip", "netns", "exec", cluster.hosts[1].namespace, "sleep", "600"])
    try:
        r = psgd_main("cluster", "down", "--name", cluster.name)
        assert r.returncode == 2 and f"pids {proc.pid}" in r.stderr and "--kill" in r.stderr, r.stderr
        assert netns.load(cluster.name) == cluster
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_a_sync_ps_run_across_hosts_equals_the_run_on_loopback(cluster, tmp_path, shards):
    flags = ["--mode", "sync", "--workers", "1", "--servers", "1", *TINY]  # 2 processes: the cheapest real run
    out = tmp_path / "cluster"
    r = psgd_main("run", *flags, "--hosts", "2", "--cluster", cluster.name, "--out", str(out))
    assert r.returncode == 0, r.stderr
    across = torch.load(out / "final_params.pt")
    # The same flags on loopback, the workers as threads against in-process shards (tests/helpers.py).
    from psgd.cli import build_parser

    cfg = C.from_namespace(build_parser().parse_args(["run", *flags]))
    addresses, cores = shards(cfg)
    assert torch.equal(across, train_in_threads(cfg, addresses, cores))
    s = summary(out)
    assert s["config"]["hosts"] == 2 and s["config"]["cluster"] == cluster.name
    assert s["cluster"]["placement"] == {"server 0": "h0 198.18.0.1", "worker 0": "h1 198.18.0.2"}
    assert s["cluster"]["link"] == LINK and s["cluster"]["latency_by"] == "socket"
    assert s["cluster"]["pacer_link"] == "unlimited,100us" and s["cluster"]["bandwidth_by"] == "kernel (tbf)"
    assert processes_mentioning(str(out)) == []


@needs_root
@pytest.mark.usefixtures("warm_runs")  # the loopback run forks from the warm parent (hosts exec)
def test_an_allreduce_run_across_hosts_equals_the_run_on_loopback(cluster, tmp_path):
    flags = ["--mode", "allreduce", "--workers", "2", *TINY]
    runs = {}
    for where, extra in (("loopback", []), ("cluster", ["--hosts", "2", "--cluster", cluster.name])):
        r = psgd_main("run", *flags, *extra, "--out", str(tmp_path / where))
        assert r.returncode == 0, r.stderr
        runs[where] = summary(tmp_path / where)
    assert runs["cluster"]["params_sha256"] == runs["loopback"]["params_sha256"]
    assert runs["cluster"]["cluster"]["placement"] == {"worker 0": "h0 198.18.0.1", "worker 1": "h1 198.18.0.2"}
    assert runs["cluster"]["cluster"]["latency_applied"] is False  # gloo's sockets: no netem, no pacer
    assert processes_mentioning(str(tmp_path)) == []


@needs_root
def test_torchrun_across_two_hosts_runs_a_sync_job_that_equals_psgd(cluster, tmp_path, shards):
    """docs/deploy.md's form for network-namespace hosts: one torchrun per host, its rendezvous store
    on h0 (`--rdzv-conf is_host=1`; the hosts share one host name, so torchrun cannot tell by name),
    each process bound to its host's address, one token file. 1 shard + 2 workers as 1 + 2 processes:
    the rendezvous numbers nodes in the order of their --local-addr (torch 2.13 sorts its node
    descriptors), so h0's process is rank 0, the shard, and both workers on h1 reach it across the
    link. Inside the namespaces c10d's reverse-DNS queries find no route: nothing leaves the machine."""
    out, token = tmp_path / "node", tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    flags = ["--mode", "sync", "--servers", "1", "--workers", "2", *(f for f in TINY if f != "--quiet")]
    marker = secrets.token_hex(8)
    store = cluster.hosts[0].address
    procs = []
    for h, nproc in zip(cluster.hosts, (1, 2), strict=True):
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", h.namespace, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{store}:29400",
             "--rdzv-id", "ns1", "--rdzv-conf", f"is_host={int(h.address == store)}", "--local-addr", h.address,
             "-m", "psgd", "node", *flags, "--bind", h.address, "--token-file", str(token), "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(ENV, PSGD_TEST_TORCHRUN=marker)))
    try:
        # Meanwhile, the same job in this process (threads against in-process shards).
        from psgd.cli import build_parser

        cfg = C.from_namespace(build_parser().parse_args(["run", *flags]))
        addresses, cores = shards(cfg)
        expected = train_in_threads(cfg, addresses, cores)
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # torchrun stops its processes on SIGTERM
                p.terminate()
                p.wait(30)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert not processes_with_env("PSGD_TEST_TORCHRUN", marker)
    assert f"READY {store}:" in outputs[0], outputs  # the shard serves on h0's eth0; the workers ran on h1
    # The shard's last snapshot is what `psgd summarize` would evaluate (left out: a process's start-up).
    assert json.loads((out / "shard-0.json").read_text())["version"] == 10
    assert torch.equal(evaluate.load_final_params(out, 1), expected)
