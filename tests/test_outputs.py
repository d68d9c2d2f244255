"""psgd never deletes or overwrites what it did not write; every run gets a folder of its own."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psgd import bench, cli
from psgd.bench import record
from psgd.core.config import RunConfig
from psgd.core.errors import UsageError
from psgd.train import rundir
from tests.helpers import psgd_main


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "important.txt").write_text("mine")
    (tmp_path / "config.json").write_text("mine too")
    r = psgd_main("run", "--steps", "3", "--dataset", "synthetic", "--out", str(tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "psgd did not write" in r.stderr
    assert (tmp_path / "logs" / "important.txt").read_text() == "mine"
    assert (tmp_path / "config.json").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "important.txt", "logs"]


def test_a_file_as_out_is_refused(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep")
    r = psgd_main("run", "--steps", "3", "--dataset", "synthetic", "--out", str(f))
    assert r.returncode == 2 and "is a file" in r.stderr and f.read_text() == "keep"


def test_a_rerun_replaces_psgd_files_only(tmp_path):
    rundir.prepare_out(tmp_path)  # an empty folder is taken, and marked
    for name in ("metrics.jsonl", "summary.json", "shard-0.pt", "logs/server-0.log", "notes.md", "logs/mine.txt"):
        (tmp_path / name).write_text("old")
    rundir.prepare_out(tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == [rundir.LOCK, rundir.MARKER, "logs", "logs/mine.txt", "notes.md"]


def test_a_folder_a_run_is_writing_is_refused_to_a_second_run_naming_the_first(tmp_path):
    """Two runs into one folder at once: before, both "succeeded" into one mixed metrics.jsonl; now
    the second is refused (one line, exit 2, the holder's pid) and touches nothing of the first's."""
    out = tmp_path / "run"
    holder = subprocess.Popen(  # another launcher holding the folder: it locks it as psgd run does
        [sys.executable, "-c", "import sys; from pathlib import Path; from psgd.train import rundir; "
         f"rundir.prepare_out(Path({str(out)!r})); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        (out / "metrics.jsonl").write_text("the first run's\n")
        r = psgd_main("run", "--steps", "3", "--dataset", "synthetic", "--out", str(out))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"--out {out} is being written by another run (pid {holder.pid})" in r.stderr
        assert (out / "metrics.jsonl").read_text() == "the first run's\n"
    finally:
        holder.communicate("")  # it ends, and its lock with it
    rundir.lock(out)  # free again
    rundir.unlock(out)


def test_without_out_every_run_gets_a_new_folder_and_latest_follows(tmp_path):
    first = rundir.with_out_resolved(RunConfig(mode="ssp"), runs=tmp_path)
    second = rundir.with_out_resolved(RunConfig(mode="ssp"), runs=tmp_path)
    assert first.out != second.out
    assert os.path.basename(first.out).startswith("ssp-")
    assert (tmp_path / "latest").resolve() == (tmp_path / os.path.basename(second.out)).resolve()
    rundir.prepare_out(tmp_path / os.path.basename(second.out))  # psgd's own, empty: taken
    assert rundir.with_out_resolved(RunConfig(out="given"), runs=tmp_path).out == "given"


def test_an_empty_new_folder_is_taken(tmp_path):
    rundir.prepare_out(tmp_path / "new" / "run")
    assert (tmp_path / "new" / "run" / rundir.MARKER).exists()
    with pytest.raises(UsageError):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "x").write_text("")
        rundir.prepare_out(tmp_path / "other")


@pytest.mark.usefixtures("warm_runs")
def test_a_fresh_run_prepares_its_folder_once_in_the_cli_and_in_fit(tmp_path, monkeypatch):
    """The pre-flight (psgd/train/preflight.py) prepares a fresh run's folder, and the first attempt
    takes it as it is: `psgd run` and `psgd.fit` each empty the folder once (before, the CLI and the
    launcher's attempt both did, and a fit too)."""
    import psgd

    prepared = []
    real = rundir.prepare_out
    monkeypatch.setattr(rundir, "prepare_out", lambda out, keep=(): (prepared.append(out), real(out, keep))[1])
    r = psgd_main("run", "--steps", "2", "--workers", "1", "--quiet", "--out", str(tmp_path / "cli"))
    assert r.returncode == 0, r.stderr
    psgd.fit(steps=2, workers=1, out=str(tmp_path / "fit"))
    assert prepared == [tmp_path / "cli", tmp_path / "fit"]


def test_psgd_run_and_fit_share_one_pre_flight(tmp_path, monkeypatch):
    """Both go through psgd/train/preflight.py `prepare`: what it refuses, both refuse, before any process."""
    import psgd
    from psgd.train import preflight

    def refuse(cfg, **_):
        raise UsageError(f"pre-flight saw {cfg.mode}")
    monkeypatch.setattr(preflight, "prepare", refuse)
    r = psgd_main("run", "--mode", "ssp", "--steps", "2", "--out", str(tmp_path / "cli"))
    assert r.returncode == 2 and r.stderr.strip() == "psgd run: error: pre-flight saw ssp", r.stderr
    with pytest.raises(ValueError, match="pre-flight saw async"):
        psgd.fit(mode="async", steps=2, out=str(tmp_path / "fit"))
    assert not (tmp_path / "cli").exists() and not (tmp_path / "fit").exists()


# Every command psgd dispatches that takes an --out (or --runs) folder: its argv up to its parser.
WRITERS = [("run",), ("summarize",), ("node",), *(("bench", name) for name in bench.NAMES), ("model",),
           ("doctor",), ("trace",), ("plot",), ("suite",), ("drill", "--chaos", "1:1")]


class _Parsed(Exception):
    """Raised by parse_args in the test below: the parser a command built, before it parses anything."""


def _parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    found = {}
    for argv in WRITERS:
        if argv[0] in cli.DELEGATED:
            with pytest.raises(_Parsed) as e:
                importlib.import_module(cli.MODULES[argv[0]]).main(list(argv[1:]))
            found[" ".join(argv[:2] if argv[0] == "bench" else argv[:1])] = e.value.args[0]
        else:
            sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
            found[argv[0]] = sub.choices[argv[0]]
    return found


def test_no_command_writes_a_committed_folder_unless_told_every_out_default_is_git_ignored(monkeypatch):
    """Issue 54, item 7: `psgd model --bandwidth ... --workers 8..1024`, as docs/measure.md shows it,
    rewrote the committed results/model/; every benchmark's default --out was a committed folder too.
    Each folder default of each command lies under a path .gitignore ignores (an empty default is a run
    folder of its own under results/runs/; None, a path the command derives: plot's and suite's are
    results/, trace's the run's own folder)."""
    root = Path(__file__).resolve().parents[1]
    defaults = {}
    for command, parser in _parsers(monkeypatch).items():
        for action in parser._actions:
            if {"--out", "--runs", "--results"} & set(action.option_strings) and action.default not in (None, ""):
                defaults[f"psgd {command} {action.option_strings[0]}"] = str(action.default)
    assert len(defaults) >= 18, defaults  # nine benchmarks, seven runs folders, model, doctor
    tracked = [f"{flag} {path}" for flag, path in defaults.items()
               if subprocess.run(["git", "-C", str(root), "check-ignore", "-q", f"{path}/x"]).returncode != 0]
    assert not tracked, f"defaults git does not ignore: {tracked}"
    assert defaults["psgd model --out"] == "results/tmp/model"


def test_the_cost_models_calibration_is_the_committed_one_unless_a_newer_one_was_made_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    committed, mine = tmp_path / record.COMMITTED_CALIBRATION, tmp_path / "results/tmp/bench/calibration.json"
    committed.parent.mkdir(parents=True)
    committed.write_text("{}")
    assert record.calibration() == record.COMMITTED_CALIBRATION  # nothing calibrated here yet
    mine.parent.mkdir(parents=True)
    mine.write_text("{}")  # `psgd bench calibrate` (its default --out) after the checkout
    os.utime(committed, (1_000_000, 1_000_000))
    assert record.calibration() == "results/tmp/bench/calibration.json"
    os.utime(mine, (500_000, 500_000))  # a checkout (git pull) of a newer committed calibration wins again
    assert record.calibration() == record.COMMITTED_CALIBRATION
