"""A two-node Slurm cluster on this one machine, made and unmade by a test: `make slurm-check`,
tests/test_slurm.py.

    with LocalSlurm.start() as slurm:          # SlurmUnavailable (say why, skip) where it cannot be had
        slurm.run("sinfo")                     # any Slurm command, against this cluster only
        job = slurm.sbatch("deploy/slurm/psgd_ps.sbatch", "OUT", ...)
        slurm.wait(job)                        # -> the end state: COMPLETED, FAILED, CANCELLED, ...

What it starts, all in one temporary directory that is removed afterwards, nothing under /etc:
- Debian's slurm-wlm and munge, installed with apt-get where missing (as root; otherwise, or when
  apt-get fails, SlurmUnavailable says so; PSGD_SLURM_INSTALL=0 forbids installing);
- a fresh munge key and munged on its own socket (slurm.conf's AuthInfo=socket=...);
- slurm.conf (SLURM_CONF for every command, -f for the daemons): SlurmctldHost THISHOST(127.0.0.1),
  nodes n1 and n2, both NodeAddr=127.0.0.1 and NodeHostname THISHOST, explicit ports (free ones,
  so two clusters can coexist), 2 CPUs each (SlurmdParameters=config_overrides: both share this
  machine's cores), JobCompType=jobcomp/filetxt for the jobs' end states, KillWait=5;
- slurmctld and `slurmd -N n1`, `slurmd -N n2`, in the foreground (-D), stopped at the end.

Every daemon, every Slurm command and so every job runs inside a network namespace of its own
with only lo up (a holder process made with `unshare -n`, entered with `nsenter`), and no route:
Slurm reaches 127.0.0.1 only (lo also carries 198.18.255.1/32, a benchmarking address, because
glibc's getaddrinfo with AI_ADDRCONFIG, which Slurm uses, finds nothing where 127.0.0.1 is the
only IPv4 address), and torch's c10d store, which asks the resolver for the name of every
connection's address (psgd/train/node.py), finds no route to it, so nothing leaves the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
NEEDED = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "munged", "unshare", "nsenter")
SBIN = ("/usr/sbin", "/sbin")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be had here; the message says why (a test skips with it)."""


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def ensure_installed(timeout_s: float = 180) -> None:
    """slurm-wlm and munge present, installed with apt-get where missing (root only)."""
    missing = [n for n in NEEDED if _which(n) is None]
    if not missing:
        return
    if os.environ.get("PSGD_SLURM_INSTALL", "1") == "0":
        raise SlurmUnavailable(f"{', '.join(missing)} missing and PSGD_SLURM_INSTALL=0")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(missing)} missing, and installing slurm-wlm and munge needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(missing)} missing, and no apt-get to install slurm-wlm and munge")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                           capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} took over {timeout_s:g}s") from None
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {tail}")
    still = [n for n in NEEDED if _which(n) is None]
    if still:
        raise SlurmUnavailable(f"{', '.join(still)} still missing after apt-get install")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/slurmd-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
LaunchParameters=use_interactive_step
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=30
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """One slurmctld and two slurmd (n1, n2) on 127.0.0.1, in a lo-only network namespace."""

    def __init__(self, root: Path) -> None:
        self.dir = root
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.holder: subprocess.Popen | None = None
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for name in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if name != "SLURM_CONF":
                del self.env[name]  # this cluster's, not an outer allocation's

    # -- start and stop --------------------------------------------------------------------------

    @classmethod
    def start(cls, timeout_s: float = 30) -> LocalSlurm:
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd runs its jobs as their users: this cluster needs root")
        probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise SlurmUnavailable(f"cannot make a network namespace (unshare -n): {probe.stderr.strip()}")
        self = cls(Path(tempfile.mkdtemp(prefix="psgd-slurm-")))
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        d = self.dir
        d.chmod(0o755)  # slurmd runs jobs as their users; munged wants no group/other-writable dirs
        (d / "ctld").mkdir()
        netns = "ip link set lo up && ip addr add 198.18.255.1/32 dev lo && exec sleep infinity"
        self.holder = subprocess.Popen(["unshare", "-n", "sh", "-c", netns],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        self._await(lambda: self._lo_up(), timeout_s, "the network namespace's lo")
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon("munged", [_which("munged"), "-F", "-f", f"--socket={d}/munge.socket", f"--key-file={key}",
                                f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                                f"--seed-file={d}/munged.seed"])
        self._await(lambda: (d / "munge.socket").exists(), timeout_s, "munged's socket")
        ctld, n1, n2 = _free_ports(3)
        self.conf.write_text(SLURM_CONF.format(cluster=f"psgd{os.getpid()}", host=socket.gethostname().split(".")[0],
                                               dir=d, ctld_port=ctld, n1_port=n1, n2_port=n2))
        self._daemon("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in ("n1", "n2"):
            self._daemon(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._await(self._nodes_idle, timeout_s, "n1 and n2 idle in sinfo")

    def _lo_up(self) -> bool:
        r = subprocess.run(self.nsenter("ip", "-o", "link", "show", "lo"), capture_output=True, text=True)
        r2 = subprocess.run(self.nsenter("ip", "-o", "-4", "addr", "show", "lo"), capture_output=True, text=True)
        return ("UP" in r.stdout or "UNKNOWN" in r.stdout) and "198.18.255.1" in r2.stdout

    def _nodes_idle(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise SlurmUnavailable(f"{name} exited {p.returncode}: {self.log_tail(name)}")
        r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return states.get("n1") == "idle" and states.get("n2") == "idle"

    def _await(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"{what} not ready within {timeout_s:g}s; logs in {self.dir}: "
                                       + "; ".join(f"{n}: {self.log_tail(n)}" for n in self.procs))
            time.sleep(0.2)

    def log_tail(self, name: str) -> str:
        for f in (self.dir / f"{name}.log", self.dir / f"{name}.out"):
            if f.exists():
                lines = f.read_text(errors="replace").strip().splitlines()
                return " | ".join(lines[-3:])
        return "(no log)"

    def nsenter(self, *argv: str) -> list[str]:
        """argv run inside this cluster's network namespace."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "--", *argv]

    def _daemon(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115 - the daemon's, closed by the child's end
        self.procs[name] = subprocess.Popen(self.nsenter(*argv), stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        out.close()

    def stop(self) -> None:
        """Stops the daemons (slurmd first, then slurmctld, then munged) and removes the directory."""
        for name in sorted(self.procs, key=lambda n: ("slurmd" not in n, n == "munged")):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            try:  # what it left in its session (slurmctld's slurmscriptd, a slurmstepd)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._sweep()
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self) -> list[int]:
        """Live processes this cluster started, found by SLURM_CONF in their environment: the
        daemons' slurmstepd (each a session of its own) and every job's processes."""
        needle = f"SLURM_CONF={self.conf}".encode()
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:  # a slurmstepd has a cleaned environment, but its cwd is in the spool dir
                    if needle in (d / "environ").read_bytes().split(b"\0") or \
                            os.readlink(d / "cwd").startswith(str(self.dir)):
                        found.append(int(d.name))
                except OSError:
                    pass
        return found

    def _sweep(self, grace_s: float = 5) -> None:
        deadline = time.monotonic() + grace_s
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> LocalSlurm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- use -------------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30, env: dict | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """A Slurm command (sinfo, sbatch, scontrol, ...) against this cluster."""
        r = subprocess.run(self.nsenter(*argv), capture_output=True, text=True, timeout=timeout,
                           env={**self.env, **(env or {})}, cwd=cwd)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, *argv: str, env: dict | None = None, cwd: str | None = None) -> int:
        r = self.run("sbatch", "--parsable", *argv, env=env, cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (JobState, ExitCode, NodeList, ...)."""
        r = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def wait(self, job_id: int, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                        "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"),
             timeout_s: float = 120) -> str:
        """Polls until the job is in one of `states` (by default any end state); that state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.job(job_id).get("JobState", "")
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s:g}s")
            time.sleep(0.3)

    def jobcomp(self, job_id: int) -> dict[str, str]:
        """The job's line in jobcomp/filetxt's file (JobState=..., written when it ends)."""
        f = self.dir / "jobcomp.txt"
        for line in f.read_text().splitlines() if f.exists() else []:
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("JobId") == str(job_id):
                return fields
        return {}
