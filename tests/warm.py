"""One warm parent per test process for the `psgd run`s a test makes in this process.

`psgd suite` forks every run's shards and workers from one warm parent (psgd/lab/suite.py
`_WarmParent`, psgd/train/launch.py `warm_parent`): torch is imported once, not once per run (about
1.5 s of CPU per run here). Tests that run many `psgd run` commands in this process (psgd_main) and
do not test the run's own zygote use the fixture `warm_runs`: while the test runs, `launch.run`
gets this process's warm parent (started by the first such test, replaced if it died, closed when
the test session ends) unless a zygote is passed. The commands are parsed and run as written; only who
forks their children changes, as in the suite (tests/test_zygote.py holds that a warm parent's run
equals a cold one's bit for bit)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import pytest

from psgd.lab.suite import _WarmParent

ROOT = Path(__file__).resolve().parent.parent


class _Warm(_WarmParent):
    """The suite's warm parent (psgd/lab/suite.py), started from the repository's root, as `python -m
    psgd` from `make test`: the forks import module specs such as tests.user_workload:make_model from there."""

    def get(self):
        with contextlib.chdir(ROOT):
            return super().get()


@pytest.fixture(scope="session")
def warm_parent():
    warm = _Warm("psgd-tests")
    yield warm
    warm.close()


@pytest.fixture
def warm_runs(warm_parent, monkeypatch):
    """`launch.run` (what `psgd run` calls) forks from this process's warm parent during the test."""
    from psgd.train import launch

    plain = launch.run
    warm_parent.get()  # started here, on the main thread: it dies with the thread that started it

    @functools.wraps(plain)
    def run(cfg, *args, zygote=None, **kwargs):
        return plain(cfg, *args, zygote=zygote if zygote is not None else warm_parent.get(), **kwargs)

    monkeypatch.setattr(launch, "run", run)
    yield
