"""End to end: `psgd run` starts real server and worker processes on 127.0.0.1."""

import hashlib
import math
import signal
import subprocess
import sys

import pytest
import torch

from psgd.core.errors import UsageError
from tests.helpers import ENV, events, processes_mentioning, psgd, psgd_main, summary

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

COMMON = ["--dataset", "synthetic", "--num-samples", "3000", "--model", "mlp", "--batch-size", "16"]

SUMMARY_KEYS = {"mode", "workers", "servers", "clock_gap_bound", "model", "dataset", "params", "global_updates",
                "worker_steps", "wall_time_s", "updates_per_s", "samples_per_s", "final_train_loss",
                "final_test_loss", "final_test_accuracy", "staleness", "max_clock_gap", "bytes_pushed",
                "bytes_pulled", "time_breakdown_s", "params_sha256", "worker_devices", "torch_version",
                "cuda_version"}


def test_sync_run_writes_everything(tmp_path):
    out = tmp_path / "sync"
    # --threads 2: an intra-op pool starts as torch loads, and the servers must still take the
    # launcher's SIGTERM in their own sigwait (every thread blocks it), never die of it unsaved.
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--servers", "2", "--steps", "30", "--eval-every", "10",
                  "--threads", "2", "--out", str(out), *COMMON)
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["config"]["threads"] == 2
    assert SUMMARY_KEYS <= set(s)
    assert s["global_updates"] == 30 and s["worker_steps"] == 60
    # Each worker's device (--device auto: the CPU here, cuda:r % GPUs on a GPU host) and versions.
    from psgd.train.worker import worker_device

    assert s["torch_version"] == torch.__version__ and s["cuda_version"] == torch.version.cuda
    assert {r: d["device"] for r, d in s["worker_devices"].items()} == {str(r): str(worker_device("auto", r))
                                                                        for r in range(2)}
    assert all(d["device_name"] and d["torch_version"] == torch.__version__ for d in s["worker_devices"].values())
    # No terminal, no live line (tests/test_progress.py follows it); the summary line compares modes
    # on equal terms.
    assert r.stderr == ""
    line = r.stdout.strip()
    assert line.startswith("sync, 2 workers: ") and line.endswith(f" -> {out / 'summary.json'}"), line
    assert f"{s['samples_per_s']:,.0f} samples/s, {s['worker_steps_per_s']:,.0f} gradients/s, mean staleness 0.00, " \
           f"start-up {s['startup_s']:.1f} s" in line
    assert s["staleness"]["max"] == 0 and s["max_clock_gap"] == 0
    assert set(s["staleness"]) >= {"mean", "p50", "p99", "max", "hist"}
    assert set(s["time_breakdown_s"]) == {"compute", "push", "pull", "wait"}
    final = torch.load(out / "final_params.pt")
    assert s["params"] == final.numel()
    assert s["params_sha256"] == hashlib.sha256(final.numpy().tobytes()).hexdigest()
    # Each worker pulls and pushes the whole model once per step (fp32).
    assert s["bytes_pushed"] == s["bytes_pulled"] == 60 * 4 * s["params"]
    kinds = [e["event"] for e in events(out)]
    assert kinds.count("worker_end") == 2 and kinds.count("shard_end") == 2 and kinds[0] == "launch"
    # Start-up (the first process's start, the launcher's, to the start barrier's release) is apart
    # from wall time. Each process reads its start from /proc (clock ticks against /proc/uptime's
    # 10 ms), so a child's can read a hair before the launcher's: the first of them all counts
    # (psgd/train/metrics.py; measured once, 0.27 ms apart).
    first = min(e["process_start"] for e in events(out) if "process_start" in e)
    assert "process_start" in events(out)[0]  # the launcher's among them
    assert s["startup_s"] == pytest.approx(min(e["train_start"] for e in events(out) if e["event"] == "worker_end")
                                           - first)
    assert s["startup_s"] > 0
    assert [e["version"] for e in events(out) if e["event"] == "eval"] == [0, 10, 20, 30]
    assert (out / "config.json").exists()
    assert s["final_test_accuracy"] > 0.3  # 10 classes: well above chance after 30 steps
    assert s["final_val_loss"] is None and s["final_val_accuracy"] is None  # no --val-fraction
    assert processes_mentioning(str(out)) == []


def test_local_sgd_run_with_a_validation_split_and_dirichlet_shards(tmp_path):
    out = tmp_path / "local"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--servers", "2", "--local-steps", "3", "--steps", "10",
                  "--eval-every", "1", "--val-fraction", "0.2", "--shard-data", "dirichlet", "--dirichlet-alpha", "0.5",
                  "--out", str(out), *COMMON)
    assert r.returncode == 0, r.stderr
    s = summary(out)
    # 10 local steps round down to 3 rounds of 3: one pull and one delta push per worker per round.
    assert s["global_updates"] == 3 and s["per_worker_steps"] == {"0": 9, "1": 9}
    assert s["bytes_pushed"] == s["bytes_pulled"] == 3 * 2 * 4 * s["params"]
    evals = [e for e in events(out) if e["event"] == "eval"]
    assert [(e["version"], e["samples"]) for e in evals] == [(v, v * 2 * 16 * 3) for v in range(4)]
    assert all(0 <= e["val_accuracy"] <= 1 and e["val_loss"] > 0 for e in evals)
    assert s["final_val_loss"] == evals[-1]["val_loss"] and s["final_val_accuracy"] == evals[-1]["val_accuracy"]
    assert processes_mentioning(str(out)) == []


def test_async_staleness_is_about_n_minus_1(tmp_path):
    out = tmp_path / "async"
    r = psgd_main("run", "--mode", "async", "--workers", "4", "--servers", "1", "--steps", "40", "--out", str(out),
                  *COMMON)
    assert r.returncode == 0, r.stderr
    st = summary(out)["staleness"]
    assert 1.5 <= st["mean"] <= 4.5, st   # N - 1 = 3, give or take the scheduler


def test_killed_worker_fails_the_run_and_leaves_no_process(tmp_path):
    out = tmp_path / "killed"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--servers", "1", "--steps", "200", "--fail-at", "1=5",
                  "--out", str(out), *COMMON)
    assert r.returncode == 1
    assert "worker 1" in r.stderr and "SIGKILL" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert processes_mentioning(str(out)) == []


def test_with_a_lease_an_async_run_survives_a_killed_worker(tmp_path):
    out = tmp_path / "lost"
    r = psgd_main("run", "--mode", "async", "--workers", "3", "--servers", "1", "--steps", "30", "--fail-at", "1=3",
                  "--worker-lease", "2", "--out", str(out), *COMMON)
    assert (r.returncode, processes_mentioning(str(out))) == (0, []), r.stderr
    lost, s = summary(out)["lost_workers"], summary(out)
    assert [(w["worker"], w["how"]) for w in lost] == [(1, "signal SIGKILL")]
    assert s["global_updates"] == 90 and math.isfinite(s["final_test_loss"])  # the others spent the budget
    # The killed worker's steps are in metrics.jsonl and in the summary (issue 54, item 2: they were not,
    # 1,150 worker steps against 1,200 updates): async, every counted step is an update (a push the
    # shards refused once the budget was spent says `counted: false`).
    steps = {str(r): len({e["clock"] for e in events(out)
                          if e.get("event") == "step" and e["rank"] == r and e.get("counted", True)}) for r in range(3)}
    assert s["per_worker_steps"] == steps and s["worker_steps"] == sum(steps.values()) == 90


def test_a_restarted_worker_rejoins_at_its_clock(tmp_path):
    out = tmp_path / "rejoined"
    # SSP with bound 0: the others cannot get past clock 3 until worker 1 is back, so the run can only
    # end if the restarted process rejoins at its clock, 3 (a pull at 0 would be refused).
    r = psgd_main("run", "--mode", "ssp", "--staleness", "0", "--workers", "2", "--servers", "1", "--steps", "8",
                  "--fail-at", "1=3", "--restart-workers", "1", "--out", str(out), *COMMON)
    assert (r.returncode, processes_mentioning(str(out))) == (0, []), r.stderr
    s = summary(out)
    assert s["restarted_workers"] == [{"worker": 1, "how": "signal SIGKILL"}] and s["global_updates"] == 16
    clocks = [e["clock"] for e in events(out) if e.get("event") == "step" and e["rank"] == 1]
    assert clocks == list(range(8))  # steps 0-2, then the restarted process's 3-7
    assert s["per_worker_steps"] == {"0": 8, "1": 8} and s["worker_steps"] == 16  # both of its processes' steps


def test_ctrl_c_stops_everything(tmp_path):
    out = tmp_path / "interrupted"
    # Python leaves SIGINT ignored when its parent ignored it (a `make test &` of a shell without job
    # control does): then Ctrl-C would reach nothing. The launcher is started with Python's own
    # handler, as from a terminal, whatever this test's parent did.
    terminal = "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); " \
               "runpy.run_module('psgd', run_name='__main__')"
    proc = subprocess.Popen([sys.executable, "-c", terminal, "run", "--mode", "ssp", "--workers", "2", "--steps",
                             "100000", "--out", str(out), *COMMON], env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        # Wait for training to be under way: the first step event (bounded by the timeout).
        metrics = out / "metrics.jsonl"
        for _ in range(1200):  # at most 120 s
            if metrics.exists() and '"step"' in metrics.read_text():
                break
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)  # the run must still be going
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip() == "psgd run: failed: interrupted; stopped all servers and workers"
    assert processes_mentioning(str(out)) == []


@pytest.mark.parametrize("args,message", [
    (["run", "--workers", "0"], "--workers must be >= 1"),
    (["run", "--straggler", "5=10"], "--straggler"),
    (["run", "--straggler", "x"], "RANK=NUMBER"),
    (["run", "--mode", "bogus"], "invalid choice"),
    (["run", "--no-such-flag"], "unrecognized argument --no-such-flag (see psgd run -h)"),
    (["worker", "--no-such-flag"], "psgd worker: error: unrecognized argument --no-such-flag (see psgd worker -h)"),
    (["run", "--wokers", "4"], "psgd run: error: unrecognized argument --wokers (did you mean --workers?)"),
    (["run", "--step", "50"], "unrecognized argument --step (did you mean --steps?)"),  # no abbreviations
    (["run", "--servers", "-1"], "psgd run: error: --servers must be >= 1, got -1"),
    (["run", "--mode", "allreduce", "--servers", "3"], "--mode allreduce has no servers"),
    (["run", "--servers", "h:1"], "count"),
    (["run", "--lr", "-1"], "--lr must be > 0"),
    (["worker", "--rank", "0"], "--servers HOST:PORT"),
    (["server", "--shard", "3", "--num-shards", "2"], "--shard must be"),
])
def test_usage_errors_are_one_line_exit_2(args, message):
    r = psgd_main(*args)   # in this process: psgd.cli.main is all a usage error goes through
    assert r.returncode == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_device_cuda_without_cuda_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # whatever this machine has
    out = tmp_path / "run"
    r = psgd_main("run", "--device", "cuda", "--steps", "1", "--out", str(out))
    assert r.returncode == 2 and "--device cuda, but torch sees no CUDA device" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()   # no run folder: no server or worker was started


def test_device_cuda_is_accepted_where_torch_sees_one(monkeypatch):
    from psgd.core.config import RunConfig
    from psgd.train.preflight import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device(RunConfig(device="cuda"))   # no UsageError
    check_device(RunConfig(device="cuda:1"))
    with pytest.raises(UsageError, match=r"--device cuda:2, but this host has 2 CUDA device\(s\), cuda:0..cuda:1"):
        check_device(RunConfig(device="cuda:2"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_device(RunConfig(device="auto"))   # auto falls back to the CPU: nothing to refuse


def test_usage_error_of_the_real_command_is_one_line_exit_2():
    r = psgd("run", "--workers", "0", timeout=60)   # `python -m psgd`, its own process
    assert r.returncode == 2 and "--workers must be >= 1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_unreachable_server_is_one_line(tmp_path):
    r = psgd("worker", "--rank", "0", "--workers", "1", "--servers", "127.0.0.1:9", "--rpc-timeout", "1",
             "--out", str(tmp_path), timeout=60)
    assert r.returncode == 1
    assert "shard 0 at 127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr


def test_port_in_use_is_one_line(shards, tmp_path):
    from psgd.core.config import RunConfig

    (address,), _ = shards(RunConfig(servers=1))
    r = psgd("server", "--shard", "0", "--port", address.rsplit(":", 1)[1], "--out", str(tmp_path), timeout=60)
    assert r.returncode == 1 and "in use" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def wait_until(condition, timeout: float = 60.0) -> bool:
    """Poll an observable condition (not a guess at a duration) until it holds or time runs out."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_killed_launcher_takes_its_children_with_it(tmp_path):
    out = tmp_path / "killed"
    launcher = subprocess.Popen([sys.executable, "-m", "psgd", "run", "--mode", "async", "--workers", "2", "--servers",
                                 "1", "--steps", "100000", "--out", str(out), "--quiet", *COMMON],
                                env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: (out / "metrics.jsonl").exists()
                          and '"step"' in (out / "metrics.jsonl").read_text()), "no worker ever trained"
        # The launcher, its warm parent (psgd/train/zygote.py) and its forks: one server, two workers.
        assert len(processes_mentioning(str(out))) == 5
    finally:
        launcher.kill()
        launcher.wait()
    # PR_SET_PDEATHSIG: the kernel kills the children when the launcher dies, with no cleanup of ours.
    assert wait_until(lambda: processes_mentioning(str(out)) == []), processes_mentioning(str(out))


def test_a_child_whose_launcher_is_gone_exits_at_once(tmp_path):
    """A child that finds another parent than the launcher named in its environment (the launcher
    died before the child asked to die with it) exits instead of running on as an orphan."""
    r = subprocess.run([sys.executable, "-m", "psgd", "worker", "--rank", "0", "--servers", "127.0.0.1:1"],
                       env=dict(ENV, PSGD_LAUNCHER_PID="1"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr == ""


def test_the_thread_budget_shares_the_cores_once():
    from psgd.core.config import RunConfig
    from psgd.train.threads import thread_budget

    assert thread_budget(RunConfig(mode="async", workers=4, servers=2), cores=2) == 1     # never 0
    assert thread_budget(RunConfig(mode="ssp", workers=2, servers=2), cores=16) == 4
    # Sync takes turns (workers compute, then shards apply): the workers get the cores, each shard
    # one thread (two sides that both held every core spun against each other: 10x slower at N = 1).
    assert thread_budget(RunConfig(mode="sync", workers=2, servers=1), cores=2) == 1
    assert thread_budget(RunConfig(mode="sync", workers=1, servers=1), cores=2) == 2
    assert thread_budget(RunConfig(mode="sync", workers=2, servers=1), cores=2, role="server") == 1
    assert thread_budget(RunConfig(mode="sync", workers=4, servers=2), cores=16) == 4
    assert thread_budget(RunConfig(mode="sync", workers=4, servers=2), cores=16, role="server") == 1
    assert thread_budget(RunConfig(mode="sync", workers=2, servers=1, overlap=True), cores=2, role="server") == 1
    assert thread_budget(RunConfig(mode="async", workers=1, servers=1), cores=2) == 2  # 1 worker: turns
    assert thread_budget(RunConfig(mode="async", workers=1, servers=1), cores=2, role="server") == 1
    assert thread_budget(RunConfig(mode="allreduce", workers=4, servers=2), cores=16) == 4  # no servers
    assert thread_budget(RunConfig(mode="sync", workers=2, servers=2, threads=3), cores=16) == 3


def test_an_evaluation_killed_after_training_is_made_by_the_launcher(tmp_path, monkeypatch):
    """Issue 54, item 18: a storm's last fault took the warm parent, and the evaluation forked from
    it, after training had ended: the run failed "(no output)". Now the launcher evaluates itself."""
    from psgd.train import finish

    monkeypatch.setenv(finish.FAULT, "kill")  # the evaluation's child SIGKILLs its warm parent, and so itself
    out = tmp_path / "run"
    # Its own warm parent (not the tests' shared one, which the fault would take down).
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--steps", "10", "--eval-every", "5", "--out", str(out),
                  "--quiet", *COMMON)
    assert r.returncode == 0, r.stderr
    assert "the evaluation's warm parent died (and with it the evaluation, signal SIGKILL); evaluating in the " \
           "launcher" in r.stderr
    from tests.helpers import events

    assert summary(out)["global_updates"] == 10 and summary(out)["final_test_accuracy"] is not None
    assert [e["version"] for e in events(out) if e.get("event") == "eval"] == [0, 5, 10]
