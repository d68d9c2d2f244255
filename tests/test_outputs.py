"""psgd never deletes or overwrites what it did not write; every run gets a folder of its own."""

from __future__ import annotations

import os

import pytest

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
    assert left == [rundir.MARKER, "logs", "logs/mine.txt", "notes.md"]


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
