"""Apply a cluster plan (psgd/cluster/plan.py) with `ip` and `tc`, record it, and undo it.

Contract:
- `up(name, hosts, link)` makes the cluster and returns it; `down(name)` deletes it; `load(name)`
  reads what is up; `present()` lists the namespaces that exist; `host_here(c)` says which of
  c's hosts this process runs on. Every `ip` / `tc` call runs with
  a timeout (COMMAND_TIMEOUT_S) and a failing one is a ClusterError naming the command.
- The state file, STATE_DIR/cluster-NAME.json (/run/psgd: a tmpfs, emptied at boot like the
  namespaces it describes), is created before anything else, exclusively: it is the lock that
  makes a second `up` of the same name say so, and the record that `down` deletes exactly what
  psgd made (the namespaces it names, always psgd-NAME-*), nothing else. While `up` runs it says
  complete=false; a `psgd run` refuses such a cluster.
- `up` failing midway, or interrupted (Ctrl-C, SIGTERM, SIGHUP), deletes the namespaces it had made
  and the state file before it re-raises (holding those signals meanwhile): nothing is left behind.
  A namespace of the cluster's names that exists without a state file is not psgd's to delete:
  `up` refuses and says so.
- Needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN (`ip netns add` mounts): `need_privileges`
  says so in one line, and what to run without them (`psgd run --link`, pacing in Python).
- The root namespace is only read (the /run/netns listing), never changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from psgd.cluster import plan
from psgd.core.errors import UsageError

STATE_DIR = Path("/run/psgd")
NETNS_DIR = Path("/run/netns")   # where `ip netns add` mounts a namespace by name
COMMAND_TIMEOUT_S = 10.0         # one `ip` or `tc` call takes milliseconds
KILL_WAIT_S = 5.0
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


class ClusterError(RuntimeError):
    """An `ip` / `tc` command failed; the message names it and gives its error line."""


def need_privileges() -> None:
    """UsageError (exit 2) unless this process may make network namespaces, and ip / tc exist."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"psgd cluster needs iproute2's {' and '.join(missing)} (e.g. apt-get install iproute2)")
    if os.geteuid() != 0 and not _has_caps(_CAP_NET_ADMIN, _CAP_SYS_ADMIN):
        raise UsageError("psgd cluster needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to make network namespaces; "
                         "without them, `psgd run --link 1gbit,200us` emulates links in Python on loopback")


def _has_caps(*bits: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            eff = int(line.split()[1], 16)
            return all(eff >> b & 1 for b in bits)
    return False


def run(step: plan.Step | list[str] | tuple[str, ...], timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run one command; its stdout, or ClusterError naming it and its error line."""
    argv = list(step.argv if isinstance(step, plan.Step) else step)
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from None
    except OSError as e:
        raise ClusterError(f"`{' '.join(argv)}`: {e}") from None
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        raise ClusterError(f"`{' '.join(argv)}` failed: {lines[-1] if lines else f'exit code {r.returncode}'}")
    return r.stdout


def present(netns_dir: Path = NETNS_DIR) -> set[str]:
    """The named network namespaces on this machine (read-only)."""
    try:
        return {p.name for p in netns_dir.iterdir()}
    except FileNotFoundError:
        return set()


# -- the state file -------------------------------------------------------------------------------
def state_path(name: str, state_dir: Path | None = None) -> Path:
    return (state_dir or STATE_DIR) / f"cluster-{name}.json"


def load(name: str, state_dir: Path | None = None) -> plan.Cluster | None:
    """The cluster of that name psgd made (complete or not), or None. UsageError for a damaged file."""
    path = state_path(name, state_dir)
    try:
        return plan.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except ValueError as e:  # json's errors are ValueErrors too
        raise UsageError(f"{path}: {e}; move it away if psgd did not write it") from None


def all_clusters(state_dir: Path | None = None) -> list[plan.Cluster]:
    names = sorted(p.name[len("cluster-"):-len(".json")] for p in (state_dir or STATE_DIR).glob("cluster-*.json"))
    return [c for c in (load(n, state_dir) for n in names) if c is not None]


def _write(c: plan.Cluster, state_dir: Path | None, exclusive: bool = False) -> None:
    path = state_path(c.name, state_dir)
    text = json.dumps(plan.to_dict(c), indent=1)
    if exclusive:
        with open(path, "x") as f:  # FileExistsError: another `up` made it, or the cluster is up
            f.write(text)
        return
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


# -- up / down ------------------------------------------------------------------------------------
def up(name: str, hosts: int, link: str = "", state_dir: Path | None = None) -> plan.Cluster:
    """Make the cluster (see the module docstring); UsageError for bad input or one already up."""
    try:
        c = plan.describe(name, hosts, link)
    except ValueError as e:
        raise UsageError(str(e)) from None
    need_privileges()
    state_path(name, state_dir).parent.mkdir(parents=True, exist_ok=True)
    try:
        _write(c, state_dir, exclusive=True)
    except FileExistsError:
        raise UsageError(f"a cluster named {name!r} is already up ({_summary(load(name, state_dir))}): "
                         f"`psgd cluster down --name {name}` first, or choose another --name") from None
    created: list[str] = []
    try:
        with signals_raise():
            taken = sorted(set(c.namespaces) & present())
            if taken:
                raise UsageError(f"namespace {taken[0]} exists but no psgd cluster state names it: not psgd's to "
                                 f"delete; remove it by hand (ip netns del {taken[0]}) or choose another --name")
            for step in plan.namespace_steps(c):
                run(step)
                if step.creates:
                    created.append(step.creates)
            if c.latency_s > 0:
                c = dataclasses.replace(c, latency_by="netem" if _has_netem(c) else "socket")
            for step in plan.wire_steps(c):
                run(step)
            c = dataclasses.replace(c, complete=True)
            _write(c, state_dir)
    except BaseException:
        with _signals_held():  # a second Ctrl-C must not cut the undoing short
            _undo(created)
            state_path(name, state_dir).unlink(missing_ok=True)
        raise
    return c


def _has_netem(c: plan.Cluster) -> bool:
    add, remove = plan.netem_probe(c)
    try:
        run(add)
    except ClusterError:
        return False  # "Specified qdisc kind is unknown": the kernel was built without sch_netem
    run(remove)
    return True


def _undo(created: list[str]) -> None:
    """Delete the namespaces this `up` made, newest first; every one is tried."""
    failed = []
    for ns in reversed(created):
        try:
            run(["ip", "netns", "del", ns])
        except ClusterError as e:
            failed.append(str(e))
    if failed:
        raise ClusterError(f"could not undo everything: {'; '.join(failed)}")


@contextlib.contextmanager
def signals_raise():
    """SIGTERM and SIGHUP raise KeyboardInterrupt here (as Ctrl-C does), so that `up` undoes its
    work on them too (and a benchmark that holds clusters takes them down: psgd/bench/cluster.py).
    Only the main thread may set handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP until the block is done (then they are delivered): the block
    deletes namespaces, and stopping halfway would leave some behind."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def down(name: str, kill: bool = False, state_dir: Path | None = None) -> plan.Cluster:
    """Delete the cluster's namespaces and its state file; returns what was deleted. Processes still
    running in its namespaces are refused (UsageError naming them) unless `kill`: then they get
    SIGTERM, and SIGKILL after KILL_WAIT_S."""
    need_privileges()
    c = load(name, state_dir)
    if c is None:
        stray = sorted(ns for ns in present() if ns.startswith(f"{plan.PREFIX}{name}-"))
        hint = f"; {', '.join(stray)} exist without one: not psgd's to delete" if stray else ""
        raise UsageError(f"no cluster named {name!r} is up (no {state_path(name, state_dir)}){hint}")
    there = present()
    busy = {ns: pids(ns) for ns in c.namespaces if ns in there}
    busy = {ns: p for ns, p in busy.items() if p}
    if busy and not kill:
        listing = "; ".join(f"{ns}: pids {' '.join(map(str, p))}" for ns, p in busy.items())
        raise UsageError(f"processes still run in the cluster ({listing}): stop them, or "
                         f"`psgd cluster down --name {name} --kill`")
    if busy:
        _terminate([p for ps in busy.values() for p in ps])
    with _signals_held():
        for step in plan.down_steps(c, there):
            run(step)
        state_path(name, state_dir).unlink(missing_ok=True)
    return c


def host_here(c: plan.Cluster, netns_dir: Path = NETNS_DIR) -> plan.Host | None:
    """The host of c whose namespace this process runs in, or None (read-only: compares this
    process's network namespace with the ones mounted in /run/netns, as `ip netns identify` does)."""
    mine = os.stat("/proc/self/ns/net")
    for h in c.hosts:
        try:
            there = os.stat(netns_dir / h.namespace)
        except OSError:
            continue
        if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            return h
    return None


def pids(ns: str) -> list[int]:
    """The processes running in a namespace (`ip netns pids`)."""
    return [int(p) for p in run(["ip", "netns", "pids", ns]).split()]


def _terminate(victims: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + KILL_WAIT_S
        while victims and time.monotonic() < deadline:
            victims = [p for p in victims if Path(f"/proc/{p}").exists() and not _zombie(p)]
            time.sleep(0.05)  # polling the processes' exit: they are not ours to wait for
        if not victims:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (OSError, IndexError):
        return True


def routes(ns: str) -> list[dict]:
    """Every route of a namespace, both families, all tables (read-only)."""
    return [r for family in ("-4", "-6") for r in json.loads(run(["ip", family, "-n", ns, "-j", "route", "show",
                                                                  "table", "all"]) or "[]")]


def _summary(c: plan.Cluster | None) -> str:
    if c is None:
        return "its state file just vanished"
    return f"{len(c.hosts)} host(s), link {c.link or 'unshaped'}" + ("" if c.complete else ", still being made")
