"""Processes that say what they are (psgd/train/proctitle.py): every process of a run, read from /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import ENV, processes_with_env

DEADLINE_S = 120.0
MARK = "PSGD_PROCTITLE_TEST"


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below `root` (by /proc's parent links)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        rest = stat.rsplit(") ", 1)[1].split()
        if rest[0] != "Z":
            parents[int(name)] = int(rest[1])
    below, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in below}
        for pid in frontier:
            try:
                below[pid] = cmdline(pid)
            except OSError:
                pass
    return below


def wait_for(what, found, proc: subprocess.Popen | None = None):
    """Poll `found()` until it returns something truthy; fail at the deadline (or if `proc` ended)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = found()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (code {proc.returncode}) before {what}: {proc.stderr.read()}")
        time.sleep(0.05)  # polling /proc for a condition, with a deadline
    raise AssertionError(f"no {what} within {DEADLINE_S:.0f}s; last seen: {found()}")


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_every_process_of_a_run_names_itself_and_the_launcher_names_them_alike(tmp_path):
    out, mark = tmp_path / "run", uuid.uuid4().hex
    run = subprocess.Popen([sys.executable, "-m", "psgd", "run", "--mode", "async", "--workers", "2", "--servers", "2",
                            "--steps", "1000000", "--dataset", "synthetic", "--num-samples", "600", "--batch-size", "8",
                            "--out", str(out), "--quiet"], env={**ENV, MARK: mark}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    want = {f"psgd zygote {out}", f"psgd shard 0/2 {out}", f"psgd shard 1/2 {out}", f"psgd worker 0/2 {out}",
            f"psgd worker 1/2 {out}"}
    try:
        titles = wait_for("five named processes",
                          lambda: d if want <= set((d := descendants(run.pid)).values()) else None, run)
        assert sorted(titles.values()) == sorted(want), "the zygote, two shards and two workers, nothing else"
        # The launcher's messages name a process as ps shows it: kill worker 1, read the failure.
        worker = next(pid for pid, t in titles.items() if t == f"psgd worker 1/2 {out}")
        os.kill(worker, signal.SIGKILL)
        assert run.wait(60) == 1
        err = run.stderr.read()
        assert f"worker 1/2 (pid {worker}) died with signal SIGKILL" in err, err
    finally:
        stop(run)
    wait_for("the run's processes gone", lambda: not processes_with_env(MARK, mark) or None)


def test_a_shard_and_a_worker_started_by_hand_name_themselves(tmp_path):
    out = tmp_path / "hand"
    flags = ["--mode", "async", "--workers", "1", "--servers", "1", "--steps", "1000000", "--dataset", "synthetic",
             "--num-samples", "600", "--batch-size", "8", "--out", str(out)]
    server = subprocess.Popen([sys.executable, "-m", "psgd", "server", *flags, "--shard", "0", "--port", "0"],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    worker = None
    try:
        line = server.stdout.readline()
        assert line.startswith("READY "), line
        assert cmdline(server.pid) == f"psgd shard 0/1 {out}"
        worker = subprocess.Popen([sys.executable, "-m", "psgd", "worker", *flags[:-2], "--out", str(out),
                                   "--servers", line.split()[1], "--rank", "0"],
                                  env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for("the worker's title", lambda: cmdline(worker.pid) == f"psgd worker 0/1 {out}", worker)
    finally:
        stop(*(p for p in (worker, server) if p is not None))


def test_without_setproctitle_the_kernel_name_is_set():
    code = ("import builtins; real = builtins.__import__\n"
            "def imp(n, *a, **k):\n"
            "    if n == 'setproctitle': raise ImportError(n)\n"
            "    return real(n, *a, **k)\n"
            "builtins.__import__ = imp\n"
            "from psgd.train import proctitle; proctitle.set_title('psgd worker 3/4 /x')\n"
            "print(open('/proc/self/comm').read().strip())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "psgd-worker-3/4", "prctl(PR_SET_NAME): the kernel keeps 15 bytes, no spaces"


def test_a_titled_process_reads_whole_in_proc_stat_as_slurm_reads_it():
    # Slurm's process tracker (proctrack/linuxproc, kill_tree.c) reads /proc/PID/stat with
    # sscanf("%ld %s %*s %ld"): pid, name, state, parent. With setproctitle's kernel name
    # "psgd shard 0/1 " it read the parent as 0, so scancel never reached a job's psgd tasks.
    code = ("import os; from psgd.train import proctitle; proctitle.set_title('psgd shard 0/1 /x/run')\n"
            "print(open('/proc/self/stat').read())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    pid, name, state, parent = r.stdout.split()[:4]
    assert name == "(psgd-shard-0/1)" and state.isalpha() and int(parent) == os.getpid()


TORCHRUN = {"WORLD_SIZE": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_NTASKS": "5", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node1"}


@pytest.mark.parametrize("env,title", [
    ({**TORCHRUN, "RANK": "1"}, "psgd shard 1/2 /x/run"),     # ranks 0..K-1 serve
    ({**TORCHRUN, "RANK": "4"}, "psgd worker 2/3 /x/run"),    # the rest train: worker RANK - K of WORLD_SIZE - K
    ({**SRUN, "SLURM_PROCID": "0"}, "psgd shard 0/2 /x/run"),  # srun without torchrun: Slurm's variables
    ({**SRUN, "SLURM_PROCID": "2"}, "psgd worker 0/3 /x/run"),
])
def test_a_node_under_torchrun_or_srun_titles_itself_by_its_role(env, title, monkeypatch):
    from psgd.cli import build_parser
    from psgd.train import proctitle

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    said = []
    monkeypatch.setattr(proctitle, "set_title", said.append)
    args = build_parser().parse_args(["node", "--servers", "2", "--out", "/x/run"])
    assert proctitle.name_from_args(args) == title and said == [title]
    for name in env:  # neither launcher's variables: no role, no title (cmd_node refuses it in one line)
        monkeypatch.delenv(name)
    assert proctitle.name_from_args(args) is None and said == [title]


def test_a_node_process_is_titled_by_its_role_before_it_reaches_the_store(tmp_path):
    """Under torchrun every rank was `python -u -m psgd node ...`: a worker rank waiting for a store
    that never answers shows as `psgd worker 0/1 OUT` in ps."""
    out = tmp_path / "node"
    with socket.socket() as silent:  # a store that accepts and never answers: the worker waits on it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = {**ENV, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(silent.getsockname()[1])}
        node = subprocess.Popen([sys.executable, "-u", "-m", "psgd", "node", "--servers", "1", "--mode", "async",
                                 "--dataset", "synthetic", "--shards-timeout", "60", "--out", str(out)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_for("the node's title", lambda: cmdline(node.pid) == f"psgd worker 0/1 {out}", node)
        finally:
            node.kill()
            node.wait()
