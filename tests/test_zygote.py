"""The run's warm parent (psgd/train/zygote.py): one torch import, every child forked from it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from psgd.train import supervise, zygote
from psgd.train.warm import Forked, Zygote, ZygoteError
from tests.helpers import ENV, processes_mentioning, psgd_main, summary


@pytest.fixture
def warm(tmp_path):
    """A zygote of the test's own: its exit-report count starts at zero (what the wake-up test needs)."""
    z = Zygote.start(f"zygote-test-{tmp_path.name}", dict(ENV))
    yield z
    z.close()


@pytest.fixture
def serving(warm_parent):
    """This test process's warm parent (tests/warm.py), a zygote like any other: the tests that only ask
    it to fork and reap a child use it as they find it, instead of loading torch into one more zygote
    (about 1.5 s of CPU each). Its forks get the environment each request names, as a fresh one's do."""
    return warm_parent.get()


def spawn(z: Zygote, log, *args: str) -> Forked:
    with open(log, "wb") as f:
        return z.spawn(list(args), dict(ENV), os.open(os.devnull, os.O_RDONLY), f.fileno(), f.fileno())


def test_a_forked_child_runs_psgd_with_its_own_argv_log_and_exit_code(serving, tmp_path):
    log = tmp_path / "a.log"
    child = spawn(serving, log, "summarize", str(tmp_path / "nothing-here"))
    assert child.wait(60) == 2, log.read_text()
    assert "is not a psgd run folder" in log.read_text()
    assert child.poll() == 2 and child.pid not in (os.getpid(), serving.proc.pid)


def test_a_killed_child_is_reported_with_its_signal_and_the_zygote_serves_on(serving, tmp_path):
    child = spawn(serving, tmp_path / "b.log", "run", "--steps", "100000", "--out", str(tmp_path / "run"), "--quiet")
    child.send_signal(signal.SIGKILL)
    assert child.wait(60) == -signal.SIGKILL
    again = spawn(serving, tmp_path / "c.log", "summarize", str(tmp_path / "none"))
    assert again.wait(60) == 2


def test_children_die_with_the_zygote(tmp_path):
    tag = f"zygote-orphans-{tmp_path.name}"
    z = Zygote.start(tag, dict(ENV))
    r, w = os.pipe()  # the child blocks reading stdin for ever: it ends only if killed
    child = z.spawn(["worker", "--rank", "0", "--servers-on-stdin", "--servers", "1"], dict(ENV), r, w, w)
    os.close(r)
    os.close(w)
    assert child.poll() is None
    pidfd = os.pidfd_open(child.pid)  # readable once that process has exited (it is not our child)
    try:
        os.kill(z.proc.pid, signal.SIGKILL)
        z.proc.wait()
        readable, _, _ = select.select([pidfd], [], [], 60)
        assert readable, "the child outlived its zygote"
    finally:
        if not select.select([pidfd], [], [], 0)[0]:
            os.kill(child.pid, signal.SIGKILL)  # the test failed: leave no orphan behind
        os.close(pidfd)
        z.sock.close()


def test_the_zygote_refuses_to_fork_once_grpc_or_cuda_is_loaded():
    """Fork safety: a parent with gRPC loaded (its atfork handlers, its poller thread) must not fork."""
    # One interpreter (torch is loaded once): gRPC is not loaded with torch nor with any preloaded
    # module, and loading it makes the zygote refuse.
    preloads = [m for m in zygote.PRELOAD]
    code = ("import importlib, sys\nfrom psgd.train import zygote\nassert zygote.unsafe_to_fork() is None\n"
            "import torch\nassert zygote.unsafe_to_fork() is None\n" +
            "".join(f"importlib.import_module({m!r})\n" for m in preloads) +
            "print([m for m in sys.modules if m.split('.')[0] == 'grpc' or m.endswith('_pb2_grpc')])\n"
            "print('psgd._proto.parameter_server_pb2' in sys.modules)\n"
            "assert zygote.unsafe_to_fork() is None\nimport grpc\nprint(zygote.unsafe_to_fork())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    preloaded, has_stubs, refusal = done.stdout.strip().split("\n", 2)
    assert [preloaded, has_stubs] == ["[]", "True"], "the preloaded modules pull in gRPC: " + done.stdout
    assert refusal.startswith("grpc is loaded in the zygote")
    # The stubs import grpc: loaded, they are refused like grpc itself.
    code = ("from psgd.train import zygote\nimport psgd._proto.parameter_server_pb2\n"
            "assert zygote.unsafe_to_fork() is None\nimport psgd._proto.parameter_server_pb2_grpc\n"
            "print(zygote.unsafe_to_fork())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.stdout.strip().startswith("grpc is loaded in the zygote"), done.stdout + done.stderr[-2000:]


def test_a_refusing_zygote_fails_the_run_in_one_line(tmp_path):
    z = Zygote(*_fake_start(tmp_path))
    with pytest.raises(ZygoteError, match="grpc is loaded in the zygote"):
        z.spawn(["summarize", "x"], dict(ENV), 0, 1, 2)
    z.close()


def _fake_start(tmp_path):
    """A zygote whose preload imports gRPC (what a careless PRELOAD would do)."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    code = ("import socket, sys\nfrom psgd.train import zygote\nzygote.PRELOAD = ('grpc',)\n"
            f"zygote.serve(socket.socket(fileno={theirs.fileno()}))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=ENV)
    theirs.close()
    return proc, ours


def test_warm_and_cold_start_give_the_same_run_bit_for_bit(tmp_path):
    # Two workers on two shards (each cold process imports torch: 1.7 s of CPU): the shards sum each
    # step's gradients in worker order (psgd/core/stepsum.py), so however the processes' start-up and
    # arrivals interleave, the sums are the same.
    flags = ["run", "--mode", "sync", "--workers", "2", "--servers", "2", "--steps", "15", "--batch-size", "8",
             "--quiet"]
    # The launchers run in this process (psgd_main); their children are what differs: forked from the
    # run's own zygote, or each exec'd.
    warm_run = psgd_main(*flags, "--out", str(tmp_path / "warm"))
    cold_run = psgd_main(*flags, "--out", str(tmp_path / "cold"), "--cold-start")
    assert warm_run.returncode == 0 and cold_run.returncode == 0, warm_run.stderr + cold_run.stderr
    assert summary(tmp_path / "warm")["params_sha256"] == summary(tmp_path / "cold")["params_sha256"]
    assert processes_mentioning(str(tmp_path)) == []
    assert supervise.Child  # the launcher's one way to start a child, forked or exec'd


def test_a_restarted_run_forks_again_from_the_warm_parent_that_loaded_torch(tmp_path, monkeypatch):
    """A shard killed mid-run and restarted (--restart-servers): the new attempt's processes fork from
    the run's own warm parent, which outlives the attempt; it is started once per run, not per attempt."""
    from psgd.train import launch

    started = []
    real = Zygote.start

    def start(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launch.Zygote, "start", start)
    out = tmp_path / "run"
    r = psgd_main("run", "--mode", "sync", "--workers", "1", "--servers", "1", "--steps", "12", "--checkpoint-every",
                  "5", "--dataset", "synthetic", "--num-samples", "600", "--model", "mlp", "--width", "16",
                  "--batch-size", "8", "--eval-every", "0", "--fail-shard-at", "0=7", "--restart-servers", "1",
                  "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert len(summary(out)["restarts"]) == 1 and len(started) == 1
    assert started[0].proc.poll() is not None and processes_mentioning(str(out)) == []  # closed at the end


def test_an_exit_read_by_a_poll_still_wakes_the_next_wait(warm, tmp_path):
    """No lost wake-up: the launcher polls its children after each wait_any, and a poll may read an
    exit report before the wait that would have woken on it; wait_any still returns for it."""
    a = spawn(warm, tmp_path / "a.log", "summarize", str(tmp_path / "none-a"))
    b = spawn(warm, tmp_path / "b.log", "summarize", str(tmp_path / "none-b"))
    assert a.wait(60) == 2 and b.wait(60) == 2  # both reports read here, by the waits
    warm.wait_any()  # returns at once: the exits it did not report yet are counted, not lost


def test_a_dead_zygote_reports_its_children_killed_instead_of_raising(tmp_path):
    z = Zygote.start(f"zygote-dead-{tmp_path.name}", dict(ENV))
    r, w = os.pipe()
    child = z.spawn(["worker", "--rank", "0", "--servers-on-stdin", "--servers", "1"], dict(ENV), r, w, w)
    os.close(r)
    os.close(w)
    pidfd = os.pidfd_open(child.pid)
    os.kill(z.proc.pid, signal.SIGKILL)
    z.proc.wait()
    z.wait_any()
    assert child.poll() == -signal.SIGKILL and child.wait(5) == -signal.SIGKILL
    gone = select.select([pidfd], [], [], 60)[0]
    if not gone:
        os.kill(child.pid, signal.SIGKILL)
    os.close(pidfd)
    assert gone, "the child outlived its zygote"
    with pytest.raises(ZygoteError, match="the zygote is gone"):
        spawn(z, tmp_path / "after.log", "summarize", "x")
    z.close()


def test_a_torn_report_stream_falls_back_to_asking_the_kernel(monkeypatch):
    """Ctrl-C inside the launcher's read of an exit report can leave the stream mid-frame: the zygote
    handle marks it torn and from then on waits for its children by asking the kernel (a hang on
    Ctrl-C, about one full make test in six, before)."""
    import subprocess as sp

    from psgd.train import warm as z
    from psgd.train import zygote as wire

    ours, theirs = __import__("socket").socketpair()
    handle = z.Zygote(sp.Popen(["true"]), ours)
    gone = sp.Popen(["true"])
    gone.wait()  # exited and reaped: the kernel no longer knows its pid
    child = z.Forked(handle, gone.pid)
    handle.children[child.pid] = child

    def interrupted(sock):
        raise KeyboardInterrupt
    monkeypatch.setattr(wire, "recv", interrupted)
    theirs.send(b"\0\0")  # half a frame's length: the read is under way when Ctrl-C comes
    with pytest.raises(KeyboardInterrupt):
        handle.wait_any()
    assert handle.torn
    assert child.wait(timeout=5) == -signal.SIGTERM and child.poll() == -signal.SIGTERM
    handle.proc.wait()
    theirs.close()
    ours.close()


def test_a_child_that_could_write_nothing_is_explained_by_the_first_log_that_says_why(tmp_path):
    """A full disk: the worker dies with exit code 1 and an empty log (its log could not be
    written), ENOSPC is only in a shard's log. Before, the run failed with "(no output)"; now the
    failure quotes the shard's error line, naming the shard."""
    shard = supervise.Child("shard 0/1", [sys.executable, "-c", (
        "import sys; print('INFO a line that is no error', file=sys.stderr); "
        "print(\"OSError: [Errno 28] No space left on device: 'shard-0.ckpt'\", file=sys.stderr, flush=True); "
        "print('READY 127.0.0.1:1', flush=True); sys.stdin.read()")], tmp_path / "server-0.log",
        capture_stdout=True, stdin_pipe=True)
    try:
        supervise.read_ready(shard)  # its error line is in its log by now
        worker = supervise.Child("worker 1/2", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path / "worker-1.log")
        with pytest.raises(supervise.RunFailed) as failed:
            supervise.wait_workers([worker], [shard])
        assert str(failed.value) == (f"worker 1/2 (pid {worker.proc.pid}) died with exit code 1: (no output); shard "
                                     "0/1 said: OSError: [Errno 28] No space left on device: 'shard-0.ckpt'")
    finally:
        shard.proc.stdin.close()
        supervise.stop([shard])
