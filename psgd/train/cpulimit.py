"""`--cpu-quota C`: every emulated device (each shard, each worker) gets C cores of its own, enforced by the kernel.

Why: on a few shared cores, a straggler that sleeps lends its core to the others, so sync's loss to
a straggler and async's immunity both look unlike independent devices (issue 24: E2's async slowdown
was much smaller shared than on devices of their own, docs/architecture.md). A CPU quota per
process makes a core that one process does not use go unused, as Mininet's CPULimitedHost does.

Contract:
- The kernel's cgroup v1 cpu controller, CFS bandwidth control: a group per process under
  /sys/fs/cgroup/cpu/psgd-<launcher pid>-<run>/<name>, with cpu.cfs_quota_us = C x cpu.cfs_period_us
  (100 ms). `unavailable()` says in one line why it cannot be used here (no controller, no right to
  write it), and `psgd run` refuses then (exit 2) before anything starts.
- The launcher makes the groups (`Quotas.group(name)`) and gives each child its group's path in
  $PSGD_CPU_CGROUP; the child moves itself in first thing (`enter_from_env`, psgd/cli.py), before
  it does any work: forked by the zygote or exec'd, on loopback or on a cluster host.
- `Quotas.stats()`: each group's CFS counters (cpu.stat: periods, periods throttled, time
  throttled); `close(record=OUT/cpu-quota.json)` writes them there first (the launcher does: how
  much the quota held each process back, psgd bench sim-vs-real's "why").
- `Quotas.close()` removes every group it made (the launcher calls it however the run ends, once its
  children are gone); groups left by a launcher that was killed (its pid no longer alive) are
  removed by the next `Quotas` (`sweep`). psgd touches no group it did not make.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
ENV = "PSGD_CPU_CGROUP"
PREFIX = "psgd-"


def unavailable(root: Path = ROOT) -> str | None:
    """Why CPU quotas cannot be used here, or None."""
    if not (root / "cpu.cfs_quota_us").exists():
        return f"--cpu-quota needs the kernel's cgroup v1 cpu controller with CFS quotas ({root}/cpu.cfs_quota_us " \
               "is missing)"
    if not os.access(root, os.W_OK):
        return f"--cpu-quota needs the right to make cgroups in {root} (run as root)"
    return None


def enter_from_env() -> None:
    """In a child of `psgd run --cpu-quota`: move this process into its group (else nothing)."""
    group = os.environ.get(ENV)
    if group:
        (Path(group) / "cgroup.procs").write_text(str(os.getpid()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(group: Path, root: Path) -> None:
    """Move any task left in `group` back to the root, then remove it (and its subgroups)."""
    for sub in [p for p in group.iterdir() if p.is_dir()]:
        _remove(sub, root)
    procs = group / "cgroup.procs"
    if procs.exists():
        for pid in procs.read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
    group.rmdir()


def sweep(root: Path = ROOT) -> list[str]:
    """Remove the groups of launchers that are gone (a SIGKILLed `psgd run`); returns their names."""
    gone = []
    for group in root.glob(f"{PREFIX}*"):
        pid = group.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(group, root)
            gone.append(group.name)
    return gone


class Quotas:
    """The groups of one run (see the module docstring); one thread uses it."""

    def __init__(self, tag: str, cores: float, root: Path = ROOT) -> None:
        assert cores > 0, "a quota of 0 cores would stop the process"
        reason = unavailable(root)
        if reason:
            raise OSError(reason)
        sweep(root)
        self.root, self.cores = root, cores
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)[-60:]
        self.parent = root / f"{PREFIX}{os.getpid()}-{safe}"
        self.parent.mkdir(exist_ok=True)
        self.groups: list[Path] = []

    def group(self, name: str) -> Path:
        path = self.parent / "".join(c if c.isalnum() else "-" for c in name)
        path.mkdir(exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(self.cores * PERIOD_US))))
        self.groups.append(path)
        return path

    def stats(self) -> dict[str, dict[str, int]]:
        """Each group's CFS counters so far (cpu.stat): periods, periods throttled, time throttled (ns)."""
        got = {}
        for g in self.groups:
            try:
                pairs = dict(line.split() for line in (g / "cpu.stat").read_text().splitlines() if line.strip())
            except (OSError, ValueError):
                continue
            got[g.name] = {k: int(pairs.get(k, 0)) for k in ("nr_periods", "nr_throttled", "throttled_time")}
        return got

    def close(self, record: Path | None = None) -> None:
        """Remove the groups; first, with `record`, write their counters there (JSON: `stats`)."""
        if record is not None and self.groups:
            try:
                record.write_text(json.dumps({"cores": self.cores, "period_us": PERIOD_US, "groups": self.stats()},
                                             indent=1))
            except OSError:
                pass  # the counters are a record of the run, not part of it
        if self.parent.exists():
            _remove(self.parent, self.root)
