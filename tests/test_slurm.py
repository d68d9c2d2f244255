"""psgd under Slurm, on a real (throw-away) two-node Slurm 22.05 cluster on this machine
(tools/slurm/cluster.py: slurmctld, `slurmd -N n1`, `slurmd -N n2`, munged, all on 127.0.0.1 in a
network namespace with only lo, all in one temporary directory, all stopped and removed after).

- deploy/slurm/psgd_ps.sbatch, submitted with sbatch, runs a 1-shard 2-worker sync job across
  both nodes (srun places the tasks; `psgd node` takes its role from SLURM_PROCID) and ends 0,
  with the parameters (params_sha256) of the same job under `psgd run`;
- a worker killed on one node is survived under --worker-lease, and the job completes;
- scancel of the running job stops every psgd process on both nodes, and Slurm reports CANCELLED.

Where Slurm cannot be had (not root, no apt-get, apt-get fails, no network namespace), the tests
skip and say why. As root with apt-get, a missing slurm-wlm / munge is installed (about 10-20 s
once; PSGD_SLURM_INSTALL=0 forbids it, and then the tests skip).
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import ENV, processes_mentioning, processes_with_env, psgd_main, summary
from tools.slurm.cluster import LocalSlurm, SlurmUnavailable

TINY = ["--model", "mlp", "--dataset", "synthetic", "--num-samples", "600", "--batch-size", "16", "--threads", "1"]
JOB = "deploy/slurm/psgd_ps.sbatch"
REPO = Path(__file__).resolve().parents[1]
MARK = "PSGD_TEST_SLURM"  # in every process a job of these tests starts (sbatch passes it on)


@pytest.fixture(scope="module")
def slurm():
    try:
        cluster = LocalSlurm.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm here: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.leftovers()


def job_processes(out: Path, marker: str) -> list[str]:
    """A job's live processes: by the marker in their environment, and by the run folder in their
    titles (a titled psgd process's environment is overwritten by its title: setproctitle)."""
    return processes_with_env(MARK, marker) + [c for c in processes_mentioning(str(out))
                                               if c.startswith(("psgd shard ", "psgd worker "))]


def submit(slurm, out, *flags, marker):
    """sbatch the job exactly as docs/deploy.md shows it: `psgd` on PATH (as in an activated venv), and no
    variable the docs do not set (PSGD itself is left to the script's default)."""
    env = {k: v for k, v in ENV.items() if k != "PSGD"}
    env.update({"PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}", MARK: marker})
    return slurm.sbatch("--nodes", "2", "--ntasks", "3", "--output", f"{out}.log", JOB, str(out), *flags,
                        env=env, cwd=str(REPO))


@pytest.mark.usefixtures("warm_runs")  # psgd run's reference: forked from the tests' warm parent
def test_a_sync_job_under_sbatch_ends_0_with_psgd_runs_parameters(slurm, tmp_path):
    flags = ["--servers", "1", "--mode", "sync", "--steps", "4", *TINY]
    marker = uuid.uuid4().hex
    job = submit(slurm, tmp_path / "slurm", *flags, marker=marker)
    r = psgd_main("run", "--workers", "2", *flags, "--out", str(tmp_path / "run"), "--quiet")  # meanwhile
    assert r.returncode == 0, r.stderr
    state = slurm.wait(job, timeout_s=150)
    log = (tmp_path / "slurm.log").read_text()
    assert state == "COMPLETED", log
    info = slurm.job(job)
    assert info["ExitCode"] == "0:0" and info["NodeList"] == "n[1-2]", info
    assert slurm.jobcomp(job).get("JobState") == "COMPLETED"
    # Slurm placed the tasks: 0 (the shard) and 1 on n1, 2 on n2.
    assert "task 0 on n1" in log and "task 1 on n1" in log and "task 2 on n2" in log, log
    s, ref = summary(tmp_path / "slurm"), summary(tmp_path / "run")
    assert (s["mode"], s["workers"], s["servers"], s["global_updates"]) == ("sync", 2, 1, 4)
    assert s["params_sha256"] == ref["params_sha256"]
    assert not job_processes(tmp_path / "slurm", marker)


def test_a_worker_killed_on_one_node_is_survived_under_a_lease(slurm, tmp_path):
    """Worker 1 (task 2, on n2) kills itself (SIGKILL) at step 5; with --worker-lease the shard on
    n1 declares it lost when its lease runs out, worker 0 trains to the end, and the job completes."""
    marker = uuid.uuid4().hex
    flags = ["--servers", "1", "--mode", "sync", "--steps", "20", "--worker-lease", "3", "--fail-at", "1=5", *TINY]
    job = submit(slurm, tmp_path / "slurm", *flags, marker=marker)
    state = slurm.wait(job, timeout_s=150)
    log = (tmp_path / "slurm.log").read_text()
    assert state == "COMPLETED", log
    assert "task 2 on n2" in log and "the run went on under --worker-lease" in log, log
    s = summary(tmp_path / "slurm")
    assert [w["worker"] for w in s["lost_workers"]] == [1], s["lost_workers"]
    assert s["global_updates"] == 20 and s["per_worker_steps"]["0"] == 20, s["per_worker_steps"]
    assert not job_processes(tmp_path / "slurm", marker)


def test_scancel_stops_every_psgd_process_on_every_node(slurm, tmp_path):
    marker = uuid.uuid4().hex
    job = submit(slurm, tmp_path / "slurm", "--servers", "1", "--mode", "sync", "--steps", "1000000", *TINY,
                 marker=marker)
    deadline = time.monotonic() + 90
    while len({c for c in job_processes(tmp_path / "slurm", marker) if " node " in c or c.startswith("psgd ")}) < 3:
        assert time.monotonic() < deadline, (tmp_path / "slurm.log").read_text()  # the 3 tasks: psgd node, titled
        assert slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), (tmp_path / "slurm.log").read_text()
        time.sleep(0.3)
    slurm.run("scancel", str(job))
    assert slurm.wait(job, timeout_s=60) == "CANCELLED"
    deadline = time.monotonic() + 20  # KillWait=5: SIGTERM, then SIGKILL 5 s later
    while job_processes(tmp_path / "slurm", marker):
        assert time.monotonic() < deadline, job_processes(tmp_path / "slurm", marker)
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while slurm.jobcomp(job).get("JobState") != "CANCELLED":
        assert time.monotonic() < deadline, slurm.jobcomp(job)
        time.sleep(0.3)
