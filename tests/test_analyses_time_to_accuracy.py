"""E20's analysis (psgd/lab/analyses_time_to_accuracy.py) on made-up runs: each part is the ratio of
seconds to the target, paired by seed; under a persistent straggler SSP must gain little over BSP."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from psgd.core.config import OptimConfig, RunConfig, to_dict
from psgd.lab import analyses

ACCS = [0.30, 0.45, 0.55, 0.58, 0.61, 0.63]   # reaches 0.60 at the 5th evaluation (index 4)


def runs(root: Path, label: str, mode: str, seconds_per_eval: list[float], jitter: float = 0.0,
         straggler: bool = False, evals: int = len(ACCS)) -> list:
    out = []
    for seed, dt in enumerate(seconds_per_eval):
        folder = root / f"{label.replace(' ', '_').replace(',', '')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(mode=mode, seed=seed, workers=4, staleness=2 if mode == "ssp" else 0,
                                jitter=jitter, straggler=((0, 10),) if straggler else (), optim=OptimConfig(lr=0.1)))
        (folder / "summary.json").write_text(json.dumps({
            "mode": mode, "config": cfg, "servers": 1, "worker_steps": 3000, "global_updates": 750,
            "samples_per_s": 10000.0, "updates_per_s": 80.0, "staleness": {"mean": 0.0}}))
        accs = (ACCS * 2)[:evals]
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": a, "samples": 1000 * v, "elapsed_s": v * dt})
            for v, a in enumerate(accs)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


def judge(tmp_path: Path, ssp_straggler_dt: list[float], targets: list[float] | None = None):
    s = [1.0, 1.05, 0.95]
    summaries = (runs(tmp_path, "sync", "sync", s, evals=3)   # the tuning's arm, evaluated sparsely: not timed
                 + runs(tmp_path, "sync, timed", "sync", s)
                 + runs(tmp_path, "async, timed", "async", [0.5, 0.55, 0.45])
                 + runs(tmp_path, "sync jitter, timed", "sync", [2.0, 2.1, 1.9], jitter=5.0)
                 + runs(tmp_path, "ssp jitter, timed", "ssp", [1.0, 1.1, 0.9], jitter=5.0)
                 + runs(tmp_path, "sync straggler, timed", "sync", [3.0, 3.1, 2.9], straggler=True)
                 + runs(tmp_path, "ssp straggler, timed", "ssp", ssp_straggler_dt, straggler=True))
    exp = SimpleNamespace(id="E20", path="e20.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="time_to_accuracy", seeds=(0, 1, 2),
                          params={"target_accuracy": 0.60, **({"targets": targets} if targets else {})})
    (tmp_path / "E20").mkdir()
    return analyses.analyse(exp, summaries, tmp_path / "E20")


def test_faster_async_and_ssp_under_jitter_but_not_under_a_persistent_straggler_confirm_it(tmp_path):
    section = judge(tmp_path, [3.0, 3.05, 2.95])
    assert section.verdict == "confirmed", section.headline
    dean = next(e for e in section.effects if e.label.startswith("Dean"))
    assert abs(dean.ci.estimate - 2.0) < 1e-9 and dean.ci.n == 3   # 4.0 s / 2.0 s at the 5th evaluation


def test_ssp_much_faster_under_a_persistent_straggler_refutes_the_labs_corollary_not_the_papers(tmp_path):
    """Issue 57: the lab's corollary is a verdict of its own; before, it turned the papers' two
    confirmations into "depends"."""
    section = judge(tmp_path, [1.5, 1.55, 1.45])
    part = next(e for e in section.effects if "persistent" in e.label)
    assert part.outcome == "refuted" and section.verdict == "confirmed"
    assert section.key["corollary"] == "refuted" and set(section.key["papers"].values()) == {"confirmed"}
    assert "The lab's corollary, a verdict of its own" in section.body


def test_a_range_of_targets_stated_in_advance_and_kept_below_every_plateau(tmp_path):
    from psgd.lab import targets

    assert targets.targets_of({"targets": [0.6, 0.5]}) == (0.5, 0.6) and targets.targets_of({}) == (0.6,)
    assert targets.split_by_plateau((0.5, 0.58, 0.62), {"sync": 0.61, "async": 0.65}) == ((0.5, 0.58), (0.62,))
    assert targets.over_range(["confirmed", "refuted"]) == "depends"
    section = judge(tmp_path, [3.0, 3.05, 2.95], targets=[0.50, 0.55, 0.60, 0.64])
    assert section.key["targets"] == [0.50, 0.55, 0.60] and section.key["targets_dropped"] == [0.64]
    assert sum(e.label.startswith("Dean") for e in section.effects) == 3
    assert "targets 50% to 60% (50%, 55%, 60%), stated in the experiment file" in section.body
    assert "left out, at or above that plateau: 64%" in section.body


def test_every_target_above_a_plateau_is_inconclusive_and_says_so(tmp_path):
    """Every target at or above some arm's plateau (0.63 here): nothing is timed, and the verdict
    says so instead of failing the analysis."""
    section = judge(tmp_path, [3.0, 3.05, 2.95], targets=[0.64, 0.70])
    assert section.verdict == "inconclusive" and section.key["targets"] == [] and not section.effects
    assert section.key["corollary"] is None and "not judged" in section.body
