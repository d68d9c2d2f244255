"""Tuning on several seeds, and grids that grow until the pick is inside (psgd/lab/tuning.py), on
made-up validation curves: no run is made."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from psgd.lab import experiment, loader, tuning

TOML = """id = "T"
title = "t"
claim = "c"
analysis = "modes"
seeds = [0, 1]
[tune]
lr = [0.1, 0.3]
{tune_extra}
[base]
dataset = "synthetic"
num_samples = 400
model = "logreg"
workers = 1
steps = 4
batch_size = 8
val_fraction = 0.25
[[runs]]
label = "sync"
mode = "sync"
[[runs]]
label = "half"
mode = "sync"
wire_dtype = "fp16"
lr_from = "sync"
"""


def load(tmp_path: Path, tune_extra: str = "") -> experiment.Experiment:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "t.toml"
    path.write_text(TOML.format(tune_extra=tune_extra))
    return loader.load_experiment(path, "default", tmp_path / "results")


def maker(val):
    """A stand-in for the suite's runner: writes each tuning run's validation curve, val(lr, seed)."""
    made = []

    def make(specs):
        for s in specs:
            folder = Path(s.cfg.out)
            folder.mkdir(parents=True, exist_ok=True)
            acc = val(s.cfg.optim.lr, s.seed)
            (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
                {"event": "eval", "version": v, "val_accuracy": acc}) for v in range(4)))
            made.append((s.cfg.optim.lr, s.seed))
    return make, made


def peaked(best: float):
    return lambda lr, seed: 0.9 - (math.log(lr) - math.log(best)) ** 2 / 10


def test_tuning_scores_the_mean_over_three_seeds_by_default(tmp_path):
    """Issue 57: one tuning seed picked rates on differences of 0.003 that flip between machines.
    The rule before tuned on seed 100 alone; here seed 100 prefers 0.1 by 0.003, the mean 0.3."""
    exp = load(tmp_path)
    assert exp.tune_seeds == (100, 101, 102)
    assert sorted({s.seed for s in exp.tune_specs()}) == [100, 101, 102]

    def val(lr, seed):
        if seed == 100:
            return 0.603 if lr == 0.1 else 0.600
        return 0.600 if lr == 0.1 else 0.610
    scores = {}
    for s in exp.tune_specs():
        scores.setdefault(("sync", s.cfg.optim.lr), []).append(val(s.cfg.optim.lr, s.seed))
    assert experiment.choose(exp, scores)["sync"] == 0.3
    assert experiment.choose(exp, {k: v[:1] for k, v in scores.items()})["sync"] == 0.1   # seed 100 alone


def test_a_rate_whose_every_seed_diverged_is_never_chosen_whatever_the_metric(tmp_path):
    """A loss's score is minus the loss (-2.7); "diverged" stood for -1.0, above it, so E17's plain
    SGD control chose the rate at which all three tuning seeds diverged."""
    exp = load(tmp_path)
    nan = float("nan")
    by_loss = {("sync", 0.1): [-2.70, -2.69, -2.71], ("sync", 0.3): [nan, nan, nan]}
    assert experiment.choose(exp, by_loss)["sync"] == 0.1
    by_accuracy = {("sync", 0.1): [0.60, 0.61, 0.60], ("sync", 0.3): [nan, nan, nan]}
    assert experiment.choose(exp, by_accuracy)["sync"] == 0.1


@pytest.mark.parametrize("seeds", ["seeds = [100]", "seeds = [1, 2]", "seeds = [5, 5, 5]"])
def test_fewer_than_three_tuning_seeds_is_an_error_naming_the_key(tmp_path, seeds):
    with pytest.raises(experiment.SuiteError, match="'tune.seeds' needs at least 3 different seeds"):
        load(tmp_path, seeds)


def test_a_pick_at_the_top_of_the_grid_grows_it_until_the_pick_is_inside(tmp_path):
    exp = load(tmp_path)
    make, made = maker(peaked(1.0))
    settled, chosen, scores, grown = tuning.settle(exp, make)
    grid = next(t for t in settled.templates if t.label == "sync").lr_grid
    assert grid == (0.1, 0.3, 0.9, 2.7) and chosen["sync"] == 0.9 and grown == {"sync": 2}
    assert settled.tune_added == {"sync": (0.9, 2.7)} and not tuning.still_at_edge(settled, chosen)
    assert {lr for lr, _ in made} == {0.1, 0.3, 0.9, 2.7} and len(set(made)) == 4 * 3   # each rate on 3 seeds
    assert len(scores[("sync", 2.7)]) == 3
    # The derived rate follows the settled pick; the file's experiment is unchanged.
    assert {s.label: s.cfg.optim.lr for s in settled.final_specs(chosen)}["half"] == 0.9
    assert next(t for t in exp.templates if t.label == "sync").lr_grid == (0.1, 0.3)


def test_a_pick_at_the_bottom_grows_the_grid_downwards_and_all_diverged_goes_down(tmp_path):
    settled, chosen, _, _ = tuning.settle(load(tmp_path), maker(peaked(0.03))[0])
    assert chosen["sync"] == pytest.approx(0.0333333) and min(settled.templates[0].lr_grid) < chosen["sync"]
    # Every rate diverged (nan): the tie goes to the smallest, so the grid grows down, at most 3 rates.
    settled, chosen, _, grown = tuning.settle(load(tmp_path / "nan"), maker(lambda lr, s: float("nan"))[0])
    assert grown == {"sync": tuning.MAX_EXTENSIONS} and tuning.still_at_edge(settled, chosen) == ["sync"]


def test_the_report_reads_the_grid_as_far_as_its_runs_were_made(tmp_path):
    exp = load(tmp_path)
    tuning.settle(exp, maker(peaked(1.0))[0])
    settled, chosen, _, _ = tuning.settle(exp, None)              # --report: every run is there
    assert settled.templates[0].lr_grid == (0.1, 0.3, 0.9, 2.7) and chosen["sync"] == 0.9
    settled, chosen, _, _ = tuning.settle(exp, None, ready=lambda s: False)   # none of the added ones made
    assert settled is exp and chosen["sync"] == 0.3
