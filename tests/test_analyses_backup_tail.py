"""E19's analysis (psgd/lab/analyses_backup_tail.py) on made-up runs: sync N+b is judged on its time
to the target against sync N (paired by seed, over the seeds where both reached it) and on its
accuracy against async; arms are found by their configs, not their labels."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from psgd.core.config import OptimConfig, RunConfig, to_dict
from psgd.lab import analyses


def runs(root: Path, label: str, seconds_per_eval: list[float], mode: str = "sync", backup: int = 0,
         acc: float = 0.62) -> list:
    """One run per seed: test accuracy climbs 0.40, 0.50, ..., 0.60, `acc` with an evaluation every
    `seconds_per_eval[seed]` seconds (inf: it never reaches 0.58)."""
    out = []
    for seed, dt in enumerate(seconds_per_eval):
        folder = root / f"{label.replace(' ', '_').replace('+', 'p')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(mode=mode, seed=seed, workers=4 + backup, backup_workers=backup, jitter=10.0,
                                jitter_tail="pareto", optim=OptimConfig(lr=0.1)))
        (folder / "summary.json").write_text(json.dumps({
            "mode": mode, "config": cfg, "servers": 1, "worker_steps": 2000, "global_updates": 500,
            "samples_per_s": 5000.0, "updates_per_s": 40.0, "staleness": {"mean": 0.0}}))
        accs = [0.40, 0.50, 0.55, 0.57, 0.60, acc] if dt != float("inf") else [0.40, 0.45, 0.50, 0.52, 0.53, 0.54]
        step = 1.0 if dt == float("inf") else dt
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": a, "val_accuracy": a, "samples": 1000 * v,
             "elapsed_s": v * step}) for v, a in enumerate(accs)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


def judge(tmp_path: Path, sync_dt, b1_dt, b1_acc=0.62, async_acc=0.62):
    summaries = (runs(tmp_path, "sync N=4, heavy tail", sync_dt)
                 + runs(tmp_path, "sync 4+1, heavy tail", b1_dt, backup=1, acc=b1_acc)
                 + runs(tmp_path, "async N=4, heavy tail", [1.0, 1.0, 1.0], mode="async", acc=async_acc))
    exp = SimpleNamespace(id="E19", path="e19.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="backup_tail", seeds=(0, 1, 2), params={"target_accuracy": 0.58},
                          scoring="end")
    (tmp_path / "E19").mkdir()
    return analyses.analyse(exp, summaries, tmp_path / "E19")


def test_backups_that_reach_the_target_sooner_and_end_as_async_confirm_it(tmp_path):
    section = judge(tmp_path, [2.0, 2.1, 1.9], [1.0, 1.1, 0.9])
    assert section.verdict == "confirmed", section.headline
    speedup = next(e for e in section.effects if "time to" in e.label)
    # sync N reaches 0.60 at its 4th evaluation: 8.0 / 4.0 s in all.
    assert speedup.ci.estimate == pytest.approx(6.0 / 3.0) and speedup.null == 1.0
    assert section.key["b1"]["seeds_not_reaching"] == 0


def test_backups_as_slow_as_sync_refute_it_and_a_seed_that_never_reached_is_counted(tmp_path):
    section = judge(tmp_path, [2.0, 2.1, float("inf")], [2.0, 2.1, 1.9])
    speedup = next(e for e in section.effects if "time to" in e.label)
    assert speedup.ci.n == 2 and speedup.outcome == "refuted"
    assert section.key["b1"]["seeds_not_reaching"] == 1
    assert section.verdict in ("refuted", "depends")


def test_backups_that_end_below_async_are_refuted_on_that_part(tmp_path):
    section = judge(tmp_path, [2.0, 2.1, 1.9], [1.0, 1.1, 0.9], b1_acc=0.55, async_acc=0.62)
    acc = next(e for e in section.effects if "accuracy" in e.label)
    assert acc.outcome == "refuted" and section.verdict == "depends"


def test_a_missing_role_is_one_line_naming_the_runs(tmp_path):
    summaries = runs(tmp_path, "sync N=4, heavy tail", [1.0, 1.0, 1.0])
    exp = SimpleNamespace(id="E19", path="e19.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="backup_tail", seeds=(0, 1, 2), params={"target_accuracy": 0.58})
    (tmp_path / "E19").mkdir()
    with pytest.raises(ValueError, match="needs one sync, one async and sync N\\+b runs"):
        analyses.analyse(exp, summaries, tmp_path / "E19")
