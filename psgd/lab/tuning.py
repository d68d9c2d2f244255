"""Learning rates chosen on several seeds, on grids that grow until the pick is inside them.

Contract (issue 57):
- `MIN_SEEDS` (3): tuning scores the mean validation result over at least 3 seeds (`[tune] seeds`,
  default 100, 101, 102; fewer is a SuiteError: psgd/lab/experiment.py). One seed picked rates on
  differences of a few thousandths that flip between machines.
- `extended(exp, chosen, grown)`: where a tuned label's pick sits at an end of its grid (the
  smallest or the largest rate of a grid of two or more, or the only rate of one), one more rate
  one step beyond that end (the step: the ratio of the end's two rates; 3x for a one-rate grid);
  `grown` counts each label's added rates and stops a label at `MAX_EXTENSIONS` (the report then
  says it is still at the edge). The same experiment object where nothing grows.
- `settle(exp, make, ready)`: sweep, choose (experiment.choose), extend, and again, until every pick
  is inside its grid or stopped: (the experiment with its grown grids, the chosen rates, the scores).
  `make(specs)` runs tuning runs (the suite's runner); with `make` None (`--report`) a grid grows
  only as far as its runs are `ready` (already made), so a report re-reads what the suite did.
- `still_at_edge(exp, chosen)`: the labels whose pick is at an end of their (grown) grid.
- The grown experiment's `tune_added` holds, per label, the rates the sweep added (the report's
  tuning table marks them).

Pure but for `make` and reading the finished runs' metrics (experiment.score).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from psgd.lab.experiment import TUNE_MIN_SEEDS, Experiment, RunSpec, choose, score

MIN_SEEDS = TUNE_MIN_SEEDS
MAX_EXTENSIONS = 3     # rates added past one end of a grid before the sweep stops and says so
ONE_POINT_STEP = 3.0   # a one-rate grid grows by about half a decade, as the suites' grids step


def _step(grid: tuple[float, ...], low: bool) -> float:
    if len(grid) < 2:
        return ONE_POINT_STEP
    a, b = (grid[0], grid[1]) if low else (grid[-2], grid[-1])
    return b / a if a > 0 and b > a else ONE_POINT_STEP


def _at_edge(grid: tuple[float, ...], pick: float) -> str:
    """"low" / "high" where `pick` is an end of the (sorted) grid, else ""."""
    if pick == grid[0]:
        return "low"
    if pick == grid[-1]:
        return "high"
    return ""


def still_at_edge(exp: Experiment, chosen: dict[str, float]) -> list[str]:
    return [t.label for t in exp.templates if t.lr_grid and t.label in chosen
            and _at_edge(tuple(sorted(t.lr_grid)), chosen[t.label])]


def extended(exp: Experiment, chosen: dict[str, float], grown: dict[str, int]) -> Experiment:
    """One more rate past the end where a pick sits (see the contract); `grown` is updated."""
    templates, changed, added_now = [], False, dict(exp.tune_added)
    for t in exp.templates:
        grid = tuple(sorted(t.lr_grid))
        side = _at_edge(grid, chosen[t.label]) if grid and t.label in chosen else ""
        if side and grown.get(t.label, 0) < MAX_EXTENSIONS:
            step = _step(grid, side == "low")
            new = grid[0] / step if side == "low" else grid[-1] * step
            new = float(f"{new:.6g}")
            t = dataclasses.replace(t, lr_grid=tuple(sorted({*grid, new})))
            added_now[t.label] = (*added_now.get(t.label, ()), new)
            grown[t.label] = grown.get(t.label, 0) + 1
            changed = True
        templates.append(t)
    return dataclasses.replace(exp, templates=tuple(templates), tune_added=added_now) if changed else exp


def scores_of(exp: Experiment) -> dict[tuple[str, float], list[float]]:
    """Every finished tuning run's score, by (label, rate), over the tuning seeds."""
    scores: dict[tuple[str, float], list[float]] = {}
    for spec in exp.tune_specs():
        scores.setdefault((spec.label, spec.cfg.optim.lr), []).append(score(spec.cfg.out, exp.tune_last_k,
                                                                             exp.tune_metric))
    return scores


def settle(exp: Experiment, make: Callable[[list[RunSpec]], object] | None,
           ready: Callable[[RunSpec], bool] = lambda s: True
           ) -> tuple[Experiment, dict[str, float], dict[tuple[str, float], list[float]], dict[str, int]]:
    """(the experiment with its grids grown, chosen rates, scores, rates added per label)."""
    grown: dict[str, int] = {}
    if not exp.tuned:
        return exp, {}, {}, grown
    while True:
        if make is not None:
            make(exp.tune_specs())
        scores = scores_of(exp)
        chosen = choose(exp, scores)
        trial = dict(grown)
        nxt = extended(exp, chosen, trial)
        if nxt is exp:
            return exp, chosen, scores, grown
        if make is None and not all(ready(s) for s in nxt.tune_specs()):
            return exp, chosen, scores, grown   # --report: the grid as far as its runs were made
        exp, grown = nxt, trial
