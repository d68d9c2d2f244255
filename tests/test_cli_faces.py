"""The faces a newcomer meets first (issue 33): flags, Ctrl-C, the summary line, missing data files,
reruns into a run folder, and a worker death the launcher sees.

Ctrl-C tests start `psgd run` as its own process, wait until the phase under test shows in the run
folder (the launcher's first line, a worker's step line, an evaluation line: written as they
happen), send SIGINT once, and check the one line, exit 130, and that no process of the run is left
(the descendants seen just before the signal, and any process naming the run folder).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from psgd import cli
from psgd.cli import summary_line
from psgd.core.errors import UsageError
from tests.helpers import ENV, events, processes_mentioning, psgd_main, summary

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

COMMON = ["--dataset", "synthetic", "--num-samples", "3000", "--model", "mlp", "--batch-size", "16"]
INTERRUPTED = "psgd run: failed: interrupted; stopped all servers and workers"


# -- flags -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,line", [
    (["run", "--wokers", "4"], "psgd run: error: unrecognized argument --wokers (did you mean --workers?)"),
    (["run", "--step", "50"], "psgd run: error: unrecognized argument --step (did you mean --steps?)"),
    (["run", "--mode=sync", "--stalenes=2"], "psgd run: error: unrecognized argument --stalenes "
                                             "(did you mean --staleness?)"),
    (["server", "--shard", "0", "--prot", "1"], "psgd server: error: unrecognized argument --prot "
                                                "(did you mean --port?)"),
    (["run", "--zqxjv", "1"], "psgd run: error: unrecognized argument --zqxjv (see psgd run -h)"),  # nothing close
    (["model", "--worker", "8"], "psgd model: error: unrecognized argument --worker (did you mean --workers?)"),
])
def test_an_unknown_or_abbreviated_flag_is_one_line_naming_the_closest_real_one(args, line):
    r = psgd_main(*args)
    assert (r.returncode, r.stderr) == (2, line + "\n")


# -- Ctrl-C ------------------------------------------------------------------------------------------
def _descendants(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc (the drill's own walk, psgd/train/storm.py)."""
    from psgd.train.storm import descendants

    return set(descendants(pid))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except OSError:
        return False
    return state != "Z"


def _interrupt_when(out: Path, args: list[str], reached) -> subprocess.CompletedProcess:
    """Start `psgd run ARGS --out OUT`, SIGINT it once `reached(lines of OUT/metrics.jsonl)` holds
    (checked as the file grows, the run still going), and return how it ended; asserts that every
    process of the run is gone."""
    # Python leaves SIGINT ignored when its parent ignored it (a `make test &`): start the launcher
    # with Python's own handler, as from a terminal.
    terminal = "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); " \
               "runpy.run_module('psgd', run_name='__main__')"
    proc = subprocess.Popen([sys.executable, "-c", terminal, "run", *args, "--out", str(out)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        for _ in range(2400):  # at most 240 s
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if reached([json.loads(x) for x in lines if x.endswith("}")]):
                break
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)  # the run must still be going
        family = _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert [p for p in family if _alive(p)] == []
    assert processes_mentioning(str(out)) == []
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _kinds(lines: list[dict]) -> list[str]:
    return [e.get("event") for e in lines]


def test_ctrl_c_in_start_up_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "startup"
    # The launcher's first line is written, the children's logs are made: they are starting (no step yet).
    r = _interrupt_when(out, ["--workers", "2", "--steps", "100000", *COMMON],
                        lambda lines: "launch" in _kinds(lines) and (out / "logs" / "server-0.log").exists())
    assert (r.returncode, r.stderr) == (130, INTERRUPTED + "\n")
    assert "worker_end" not in _kinds(events(out)) and not (out / "summary.json").exists()


def test_ctrl_c_in_training_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "training"
    r = _interrupt_when(out, ["--mode", "ssp", "--workers", "2", "--steps", "100000", *COMMON],
                        lambda lines: "step" in _kinds(lines))
    assert (r.returncode, r.stderr) == (130, INTERRUPTED + "\n")
    assert "worker_end" not in _kinds(events(out))  # it was stopped in training


def test_ctrl_c_in_evaluation_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "evaluation"
    # A snapshot per update: evaluating them all takes several seconds after training.
    r = _interrupt_when(out, ["--workers", "2", "--steps", "400", "--eval-every", "1", "--width", "256",
                              "--dataset", "synthetic", "--num-samples", "20000", "--model", "mlp"],
                        lambda lines: "eval" in _kinds(lines))
    assert (r.returncode, r.stderr) == (130, INTERRUPTED + "\n")
    assert "Traceback" not in r.stderr and not (out / "summary.json").exists()


# -- the summary line ----------------------------------------------------------------------------------
def test_the_summary_line_is_in_readme_words():
    s = {"mode": "async", "workers": 4, "samples_per_s": 12345.4, "worker_steps_per_s": 1087.2,
         "staleness": {"mean": 2.994}, "startup_s": 0.52, "wall_time_s": 1.44, "final_test_accuracy": 0.8751}
    assert summary_line(s, "results/runs/a") == ("async, 4 workers: 12,345 samples/s, 1,087 gradients/s, mean "
                                                 "staleness 2.99, start-up 0.5 s, training 1.4 s, test accuracy "
                                                 "0.875 -> results/runs/a/summary.json")
    ring = dict(s, mode="allreduce", workers=1, staleness=None)  # no staleness in all-reduce: left out
    assert summary_line(ring, "o") == ("allreduce, 1 worker: 12,345 samples/s, 1,087 gradients/s, start-up 0.5 s, "
                                       "training 1.4 s, test accuracy 0.875 -> o/summary.json")
    # A regression run has no accuracy: its result is its test loss, named by its loss (issue 54, item 3).
    mse = dict(s, final_test_accuracy=None, final_test_loss=0.60308, config={"model": {"loss": "mse"}})
    assert summary_line(mse, "o").endswith("training 1.4 s, test loss 0.6031 (mse) -> o/summary.json")


# -- data files ----------------------------------------------------------------------------------------
def test_mnist_without_its_files_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the default --data-dir, ~/.cache/psgd, is empty here
    out = tmp_path / "run"
    r = psgd_main("run", "--dataset", "mnist", "--steps", "1", "--out", str(out))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{tmp_path / '.cache' / 'psgd'} has no train-images-idx3-ubyte[.gz]" in r.stderr
    assert "https://" in r.stderr and "--data-dir FOLDER" in r.stderr
    assert not out.exists()  # nothing started, no folder made
    r = psgd_main("run", "--dataset", "mnist", "--data-dir", str(tmp_path / "mine"), "--out", str(out))
    assert r.returncode == 2 and f"{tmp_path / 'mine'} has no" in r.stderr and not out.exists()


# -- limits and misuse (psgd/train/preflight.py, psgd/train/limits.py) --------------------------------
@pytest.mark.parametrize("flags, says", [
    (["--workers", "100000"], "this host has"),           # processes (pid_max / RLIMIT_NPROC) or memory
    (["--width", "1000000000"], "available (MemAvailable)"),
    (["--workers", "3", "--max-workers", "1"], "--max-workers is every worker slot"),
    (["--token-file", "/nonexistent"], "--token-file /nonexistent: cannot read it"),
])
def test_each_misuse_is_one_line_exit_2_before_any_folder(tmp_path, flags, says):
    out = tmp_path / "run"
    r = psgd_main("run", "--steps", "1", "--out", str(out), *flags)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()  # nothing started, no folder made


def test_an_out_it_cannot_write_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    r = psgd_main("run", "--steps", "1", "--out", str(tmp_path / "a-file" / "run"))
    assert r.returncode == 2 and r.stderr.strip().endswith("cannot make the run folder there (Not a directory)")
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_limits_come_from_the_host_and_are_stated():
    from psgd.core.config import RunConfig
    from psgd.train import limits

    cfg = RunConfig(mode="async", workers=10, servers=2)
    roomy = limits.Host(pid_room=10_000, pid_source="pid_max 32768, 100 pids in use", mem_available=64 << 30)
    limits.check(cfg, 1_000_000, roomy)  # 13 processes, 11 MB of parameters x 44 copies: room enough
    tight = limits.Host(pid_room=100, pid_source="RLIMIT_NPROC 200, 100 pids in use", mem_available=64 << 30)
    with pytest.raises(UsageError, match=r"start 13 processes .* room for 6 \(RLIMIT_NPROC 200, 100 pids in use\)"):
        limits.check(cfg, None, tight)
    small = limits.Host(pid_room=10_000, pid_source="", mem_available=1 << 30)
    with pytest.raises(UsageError, match=r"need about 16.8 GiB \(100,000,000 parameters x 44 copies and 13 "
                                         r"processes\); this host has 1.0 GiB available"):
        limits.check(cfg, 100_000_000, small)


# -- reruns --------------------------------------------------------------------------------------------
def test_a_rerun_removes_every_file_psgd_wrote_there_and_only_those(tmp_path):
    out = tmp_path / "run"
    assert psgd_main("run", "--workers", "3", "--steps", "5", "--out", str(out), *COMMON).returncode == 0
    assert psgd_main("trace", str(out)).returncode == 0  # psgd's too: trace.png and trace.csv
    assert (out / "trace.png").exists() and (out / "trace.csv").exists()
    (out / "notes.txt").write_text("mine")  # not psgd's: stays
    r = psgd_main("run", "--workers", "2", "--steps", "5", "--out", str(out), *COMMON)
    assert r.returncode == 0, r.stderr
    assert not (out / "trace.png").exists() and not (out / "trace.csv").exists()
    assert not (out / "logs" / "worker-2.log").exists()  # the earlier run's third worker
    assert (out / "notes.txt").read_text() == "mine"
    assert summary(out)["workers"] == 2


# -- a worker death the launcher sees --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_dead_worker_is_acted_on_at_once_not_after_its_lease(tmp_path, mode):
    out = tmp_path / mode
    # A lease of 600 s: the run can end within the test's time only if the death reached the shards at once
    # (sync's quorum waits for worker 1's gradient of step 20, SSP's bound for its clock).
    r = psgd_main("run", "--mode", mode, "--staleness", "1", "--workers", "2", "--steps", "60",
                  "--worker-lease", "600", "--fail-at", "1=20", "--out", str(out), *COMMON)
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["lost_workers"] == [{"worker": 1, "clock": 20, "how": "signal SIGKILL"}]
    stats = json.loads((out / "shard-0.json").read_text())
    assert stats["lost_workers"] == {"1": 20} and stats["departed_workers"] == {}
    assert processes_mentioning(str(out)) == []


def test_the_launchers_warnings_go_through_logging_and_psgd_prints_them_as_its_own_lines(capsys):
    import logging

    from psgd.train import supervise

    cli._show_warnings()
    cli._show_warnings()  # main runs many times in one process (the tests): still one line a warning
    assert supervise.log.name == "psgd.train.supervise"  # a library user's logging config reaches it
    supervise.log.warning("psgd run: %s died with %s; restarting it (--restart-workers)", "worker 1/2", "code 1")
    supervise.log.info("not the command's to show")
    assert capsys.readouterr().err == "psgd run: worker 1/2 died with code 1; restarting it (--restart-workers)\n"
    assert logging.getLogger("psgd").level == logging.NOTSET  # the library's own level is the program's choice
