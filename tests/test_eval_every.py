"""Evaluation that says what it is doing (issue 33): the default --eval-every scales with the run's
budget (a long run is evaluated about 16 times, not once per 20 updates), the suites keep the
interval they were made with, and the live line says "evaluating k/n" while the snapshots are."""

from __future__ import annotations

import dataclasses

import pytest

from psgd.core import config as C
from psgd.train import evaluate, progress


@pytest.mark.parametrize("changes,interval", [
    ({}, 20),                                          # 100 sync steps: every 20, as before
    ({"steps": 300}, 20),                              # README's first runs: unchanged
    ({"steps": 1500}, 100),                            # README's transformer: 16 snapshots, not 76
    ({"steps": 300, "mode": "async", "workers": 4}, 80),  # async: one update per gradient, 1,200 of them
    ({"steps": 1500, "local_steps": 10}, 20),          # 150 averaging rounds
    ({"steps": 1500, "eval_every": 7}, 7),             # a given interval is kept
    ({"steps": 1500, "eval_every": 0}, 0),             # and 0: the end only
])
def test_the_default_interval_scales_with_the_budget(changes, interval):
    cfg = dataclasses.replace(C.RunConfig(), **changes)
    assert C.eval_interval(cfg) == interval
    snapshots = C.updates(cfg) // interval + 1 if interval else 1
    assert cfg.eval_every != C.AUTO or snapshots <= C.EVALS + 1 or interval == C.EVAL_EVERY_MIN


def test_auto_is_a_flag_value_and_the_default():
    assert C.RunConfig().eval_every == C.AUTO
    leaf = next(f for f in dataclasses.fields(C.RunConfig) if f.name == "eval_every")
    parse = leaf.metadata["flag"].parse
    assert parse("auto") == C.AUTO and parse("250") == 250
    C.validate(C.RunConfig())
    with pytest.raises(ValueError, match="--eval-every must be >= 0 or auto"):
        C.validate(dataclasses.replace(C.RunConfig(), eval_every=-2))


def test_a_suite_run_keeps_the_interval_it_was_made_with(tmp_path):
    """E1 read alone (without the suite's eval_samples) relies on the default: it stays 20."""
    from pathlib import Path

    from psgd.lab import loader

    source = (Path(__file__).resolve().parent.parent / "experiments" / "e01_modes.toml").read_text()
    (tmp_path / "e.toml").write_text(source.replace("\n[params]", "\n[base]\nval_fraction = 0.2\n\n[params]", 1))
    ex = loader.load_experiment(tmp_path / "e.toml", "default", tmp_path)
    assert {s.cfg.eval_every for s in ex.planned_specs()} == {C.EVAL_EVERY_MIN}


def test_each_snapshot_tells_the_live_line(monkeypatch):
    said = []

    class Bar:
        def set_description_str(self, text):
            said.append(text)

    monkeypatch.setattr(progress, "_drawn", [(Bar(), "psgd run sync")])
    snaps = [(0, 0.0, "p0"), (20, 1.0, "p1"), (40, 2.0, "p2")]
    assert list(evaluate.each_snapshot(snaps, progress.evaluating)) == snaps
    assert said == [f"psgd run sync: evaluating {k}/3" for k in (1, 2, 3)]
    assert list(evaluate.each_snapshot(snaps)) == snaps  # no callback: just the snapshots
    monkeypatch.setattr(progress, "_drawn", [])
    progress.evaluating(1, 3)  # no live line (a log, a test, --quiet): nothing to say it on
