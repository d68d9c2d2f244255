"""One warm parent per test process for the `psgd run`s a test makes in this process.

`psgd suite` forks every run's shards and workers from one warm parent (psgd/lab/runner.py
`WarmParent`, psgd/train/launch.py `warm_parent`): torch is imported once, not once per run (about
1.5 s of CPU per run here). Tests that run many `psgd run` commands in this process (psgd_main) and
do not test the run's own zygote use the fixture `warm_runs`: while the test runs, `launch.run`
gets this process's warm parent (started by the first such test, replaced if it died, closed when
the test session ends) unless a zygote is passed. The commands are parsed and run as written; only who
forks their children changes, as in the suite (tests/test_zygote.py holds that a warm parent's run
equals a cold one's bit for bit).

`warm_benches` does the same for the psgd processes a benchmark starts (psgd.bench.ZYGOTE), `warm_suites`
for the runs of a `psgd suite` (psgd.lab.runner.WARM), and
`script_parent` is a second warm parent whose forks run Python scripts, as `python SCRIPT ARGS` would
(tests/script_zygote.py; `run_script`): the examples' tests run them through it."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from psgd.lab.runner import WarmParent

ROOT = Path(__file__).resolve().parent.parent


class _Warm(WarmParent):
    """The suite's warm parent (psgd/lab/runner.py), started from the repository's root, as `python -m
    psgd` from `make test`: the forks import module specs such as tests.user_workload:make_model from there."""

    def get(self):
        with contextlib.chdir(ROOT):
            return super().get()


@pytest.fixture(scope="session")
def warm_parent():
    warm = _Warm("psgd-tests")
    yield warm
    warm.close()


def fork_runs_from(warm_parent, monkeypatch) -> None:
    """From here to the end of `monkeypatch`'s scope (the test, or a `monkeypatch.context()` block),
    `launch.run` (what `psgd run` calls) forks from this process's warm parent."""
    from psgd.train import launch

    plain = launch.run
    warm_parent.get()  # started here, on the main thread: it dies with the thread that started it

    @functools.wraps(plain)
    def run(cfg, *args, zygote=None, **kwargs):
        return plain(cfg, *args, zygote=zygote if zygote is not None else warm_parent.get(), **kwargs)

    monkeypatch.setattr(launch, "run", run)


@pytest.fixture
def warm_runs(warm_parent, monkeypatch):
    """`launch.run` (what `psgd run` calls) forks from this process's warm parent during the test."""
    fork_runs_from(warm_parent, monkeypatch)
    yield


@pytest.fixture
def warm_suites(warm_parent, monkeypatch):
    """The runs a `psgd suite` makes in this process during the test fork from this process's warm parent
    instead of a warm parent of the suite's own (psgd/lab/runner.py `WARM`, started at the suite's first
    run and closed at its end): one torch import fewer per suite. The suite asks and closes `WARM` as
    ever; closing leaves this process's warm parent to the session (tests/test_suite.py keeps the
    suite's own)."""
    from psgd.lab import runner

    warm_parent.get()  # started here, on the main thread: it dies with the thread that started it
    monkeypatch.setattr(runner.WARM, "get", warm_parent.get)
    monkeypatch.setattr(runner.WARM, "close", lambda: None)
    yield


@pytest.fixture
def warm_benches(warm_parent, monkeypatch):
    """The psgd processes a benchmark starts fork from this process's warm parent during the test
    (psgd.bench.ZYGOTE: its shard servers, and its `psgd run`s launched in this process)."""
    import psgd.bench

    monkeypatch.setattr(psgd.bench, "ZYGOTE", warm_parent.get())  # started here, on the main thread
    yield


# -- scripts: `python SCRIPT ARGS` forked from a warm parent ---------------------------------------------
class _ScriptParent(WarmParent):
    """A warm parent whose forks run Python scripts (tests/script_zygote.py), started from the
    repository's root like the other, at its first use (by a test, on the main thread); it dies with
    this process (PR_SET_PDEATHSIG) and is closed when the session ends."""

    def get(self):
        from psgd.train import lifeline
        from psgd.train.warm import Zygote

        if self.zygote is None or self.zygote.gone:
            self.close()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:   # as psgd/train/warm.py _launch, with the script zygote's module
                proc = subprocess.Popen([sys.executable, "-m", "tests.script_zygote", self.tag, str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        env=dict(os.environ, **lifeline.env_for_children()),  # dies with us
                                        cwd=ROOT, start_new_session=True)
            finally:
                theirs.close()
            self.zygote = Zygote(proc, ours, self.tag)
        return self.zygote


@pytest.fixture(scope="session")
def script_parent():
    parent = _ScriptParent("psgd-tests-scripts")
    yield parent
    parent.close()


def run_script(parent: _ScriptParent, argv: list[str], env: dict, cwd: Path,
               timeout: float) -> tuple[subprocess.CompletedProcess, int]:
    """`python ARGV` (a script and its arguments) forked from `parent`, as subprocess.run(..., env=env,
    cwd=cwd, capture_output=True, text=True, timeout=timeout) runs it, stdin /dev/null; returns the
    CompletedProcess and the child's pid (a session leader: what it leaves behind is in its session,
    tests/helpers.py `processes_in_session`)."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null:
        with contextlib.chdir(cwd):   # the zygote's child starts in the requester's working folder
            child = parent.get().spawn(argv, env, null.fileno(), out.fileno(), err.fileno())
        try:
            rc = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise

        def text(f) -> str:   # as text=True reads it: universal newlines
            f.seek(0)
            return f.read().decode().replace("\r\n", "\n").replace("\r", "\n")

        return subprocess.CompletedProcess(["python", *argv], rc, text(out), text(err)), child.pid
