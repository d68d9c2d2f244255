"""--cpu-quota (psgd/train/cpulimit.py): every shard and worker in a kernel CPU quota of its own, removed after."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from psgd.train import cpulimit
from tests.helpers import ENV, events, psgd_main

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

REASON = cpulimit.unavailable()


def test_unavailable_says_why_in_one_line(tmp_path):
    reason = cpulimit.unavailable(tmp_path)
    assert reason is not None and "cgroup v1 cpu controller" in reason and "\n" not in reason
    assert psgd_main("run", "--cpu-quota", "-1").returncode == 2


# Not a skip: this machine (and CI, as root) has the controller; elsewhere the test says why it failed.
def test_a_quota_is_enforced_by_the_kernel_and_removed_after():
    assert REASON is None, REASON
    quotas = cpulimit.Quotas("test-enforced", 0.05)
    try:
        group = quotas.group("busy")
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "5000"
        code = "import os\nfrom psgd.train import cpulimit\ncpulimit.enter_from_env()\nsum(range(4_000_000))\n"
        done = subprocess.run([sys.executable, "-c", code], env={**ENV, cpulimit.ENV: str(group)}, timeout=120,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) > 0, "the kernel never held the busy process back"
    finally:
        quotas.close()
    assert not quotas.parent.exists()


def test_psgd_run_puts_each_worker_in_its_group_and_leaves_none(tmp_path):
    assert REASON is None, REASON
    out = tmp_path / "run"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--steps", "20", "--cpu-quota", "0.5", "--dataset",
                  "synthetic", "--num-samples", "600", "--batch-size", "8", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    groups = sorted(e["cpu_cgroup"] for e in events(out) if e.get("event") == "worker_end")
    parent = f"/psgd-{os.getpid()}-"
    assert len(groups) == 2 and all(g.startswith(parent) for g in groups), groups
    assert groups[0].endswith("/worker-0") and groups[1].endswith("/worker-1")
    assert not [p for p in cpulimit.ROOT.glob(f"psgd-{os.getpid()}-*")], "the run left its groups behind"
    # What the quotas did, as the kernel counted it, kept in the run folder (sim-vs-real's "why").
    record = json.loads((out / "cpu-quota.json").read_text())
    assert record["cores"] == 0.5 and {"worker-0", "worker-1", "server-0"} <= set(record["groups"])
    assert all(g["nr_periods"] >= g["nr_throttled"] >= 0 and g["nr_periods"] > 0 for g in record["groups"].values())


def test_sweep_removes_the_groups_of_a_launcher_that_is_gone():
    assert REASON is None, REASON
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = cpulimit.ROOT / f"psgd-{dead.pid}-left-behind"
    (stale / "worker-0").mkdir(parents=True)
    assert stale.name in cpulimit.sweep()
    assert not stale.exists()
