"""E16's analysis (psgd/lab/analyses_optim.py) on made-up runs: the verdict is AdamW's staleness
cost minus SGD's, paired by seed, and can come out either way."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from psgd.core.config import OptimConfig, RunConfig, to_dict
from psgd.lab import analyses


def runs(root: Path, label: str, acc: list[float], mode: str, workers: int, optimizer: str,
         loss: list[float] | None = None, momentum: float = 0.9, reach: float = 0.0) -> list:
    """`reach`: the evaluation (of 0-5) by which the accuracy has risen linearly to its final value
    (0: flat from the start)."""
    out = []
    for seed, a in enumerate(acc):
        folder = root / f"{label.replace(' ', '_').replace(',', '')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(mode=mode, seed=seed, workers=workers, optim=OptimConfig(optimizer=optimizer,
                                                                                             momentum=momentum)))
        (folder / "summary.json").write_text(json.dumps({"mode": mode, "config": cfg, "staleness": {"mean": 3.0}}))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": a * min(1.0, v / reach) if reach else a,
             "samples": 100 * v,
             **({"test_loss": 4.5 - (4.5 - loss[seed]) * min(1.0, v / reach) if reach else loss[seed]}
                if loss else {})}) for v in range(6)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


@pytest.mark.parametrize("adam_async, verdict", [([0.50, 0.52, 0.51], "confirmed"), ([0.60, 0.61, 0.60], "refuted")])
def test_adam_staleness_weighs_adams_cost_against_sgds(tmp_path, adam_async, verdict):
    summaries = (runs(tmp_path, "one worker", [0.62, 0.63, 0.62], "sync", 1, "sgd")
                 + runs(tmp_path, "async", [0.60, 0.61, 0.60], "async", 4, "sgd")
                 + runs(tmp_path, "one worker, AdamW", [0.62, 0.63, 0.62], "sync", 1, "adamw")
                 + runs(tmp_path, "async, AdamW", adam_async, "async", 4, "adamw"))
    exp = SimpleNamespace(id="E16", path="e16.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="adam_staleness", seeds=(0, 1, 2),
                          params={"sgd": ["one worker", "async"], "adamw": ["one worker, AdamW", "async, AdamW"],
                                  "margin": 0.02})
    (tmp_path / "E16").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E16")
    assert section.verdict == verdict, section.headline
    assert "SGD +0.020" in section.headline and (tmp_path / "E16" / "staleness_cost.png").exists()


def test_each_stale_arm_is_a_part_and_the_verdict_combines_them(tmp_path):
    """Async costs AdamW clearly more than SGD, SSP (s=2) clearly not: the claim depends on the arm."""
    summaries = (runs(tmp_path, "one worker", [0.62, 0.63, 0.62], "sync", 1, "sgd")
                 + runs(tmp_path, "async", [0.60, 0.61, 0.60], "async", 4, "sgd")
                 + runs(tmp_path, "ssp", [0.61, 0.62, 0.61], "ssp", 4, "sgd")
                 + runs(tmp_path, "one worker, AdamW", [0.62, 0.63, 0.62], "sync", 1, "adamw")
                 + runs(tmp_path, "async, AdamW", [0.50, 0.52, 0.51], "async", 4, "adamw")
                 + runs(tmp_path, "ssp, AdamW", [0.61, 0.62, 0.61], "ssp", 4, "adamw"))
    exp = SimpleNamespace(id="E16", path="e16.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="adam_staleness", seeds=(0, 1, 2),
                          params={"sgd": ["one worker", "async", "ssp"],
                                  "adamw": ["one worker, AdamW", "async, AdamW", "ssp, AdamW"], "margin": 0.02})
    (tmp_path / "E16").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E16")
    assert section.verdict == "depends", section.headline
    assert "async: SGD +0.020" in section.headline and "ssp s=2: SGD +0.010" in section.headline
    with pytest.raises(ValueError, match="the same stale arms"):
        analyses.analyse(SimpleNamespace(**{**vars(exp), "params": {**exp.params, "adamw": exp.params["adamw"][:2]}}),
                         summaries, tmp_path / "E16")


@pytest.mark.parametrize("adam_async, verdict", [([1.9, 1.95, 1.9], "confirmed"), ([1.6, 1.62, 1.61], "refuted")])
def test_a_language_models_damage_is_the_test_loss_staleness_adds(tmp_path, adam_async, verdict):
    acc = [0.3, 0.3, 0.3]
    summaries = (runs(tmp_path, "one worker", acc, "sync", 1, "sgd", [1.5, 1.52, 1.51])
                 + runs(tmp_path, "async", acc, "async", 4, "sgd", [1.6, 1.62, 1.61])
                 + runs(tmp_path, "one worker, AdamW", acc, "sync", 1, "adamw", [1.5, 1.52, 1.51])
                 + runs(tmp_path, "async, AdamW", acc, "async", 4, "adamw", adam_async))
    exp = SimpleNamespace(id="E17", path="e17.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="adam_staleness", seeds=(0, 1, 2),
                          params={"sgd": ["one worker", "async"], "adamw": ["one worker, AdamW", "async, AdamW"],
                                  "margin": 0.05, "metric": "test_loss"})
    (tmp_path / "E17").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E17")
    assert section.verdict == verdict, section.headline
    assert "test loss (nats) added" in section.headline and "SGD +0.100" in section.headline
    assert (tmp_path / "E17" / "loss_vs_samples.png").exists()


@pytest.mark.parametrize("plain_async, verdict", [([0.61, 0.62, 0.61], "confirmed"), ([0.51, 0.52, 0.51], "refuted")])
def test_with_a_plain_sgd_arm_the_damages_are_weighed_against_plain_sgds(tmp_path, plain_async, verdict):
    """Dai et al.'s baseline is SGD without momentum (issue 57): AdamW's cost is weighed against
    plain SGD's, and momentum SGD's cost minus plain SGD's is reported beside it."""
    summaries = (runs(tmp_path, "one worker", [0.62, 0.63, 0.62], "sync", 1, "sgd")
                 + runs(tmp_path, "async", [0.56, 0.57, 0.56], "async", 4, "sgd")
                 + runs(tmp_path, "one worker, AdamW", [0.62, 0.63, 0.62], "sync", 1, "adamw")
                 + runs(tmp_path, "async, AdamW", [0.55, 0.56, 0.55], "async", 4, "adamw")
                 + runs(tmp_path, "one worker, plain", [0.62, 0.63, 0.62], "sync", 1, "sgd", momentum=0.0)
                 + runs(tmp_path, "async, plain", plain_async, "async", 4, "sgd", momentum=0.0))
    exp = SimpleNamespace(id="E16", path="e16.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="adam_staleness", seeds=(0, 1, 2),
                          params={"sgd": ["one worker", "async"], "adamw": ["one worker, AdamW", "async, AdamW"],
                                  "plain": ["one worker, plain", "async, plain"], "margin": 0.02})
    (tmp_path / "E16").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E16")
    assert section.verdict == verdict, section.headline
    assert "AdamW's minus plain SGD's" in section.headline and "momentum SGD's minus plain SGD's" in section.headline
    assert section.key["async_momentum_minus_plain"] == pytest.approx(0.06 - (0.01 if verdict == "confirmed" else 0.11))
    assert "| one worker, plain | sgd | 0 |" in section.body


@pytest.mark.parametrize("adam_reach, verdict", [(5.0, "confirmed"), (2.0, "depends")])
def test_updates_to_a_target_is_the_claims_second_measure(tmp_path, adam_reach, verdict):
    """Dai et al. also count updates to a target (issue 57): stale AdamW ends lower than plain SGD
    (the budget confirms); where it also gets to the targets later, relative to its control, the
    claim is confirmed; where it gets there as soon as plain SGD does, the two measures disagree."""
    summaries = (runs(tmp_path, "one worker", [0.62, 0.63, 0.62], "sync", 1, "sgd", reach=2.0)
                 + runs(tmp_path, "async", [0.62, 0.63, 0.62], "async", 4, "sgd", reach=2.0)
                 + runs(tmp_path, "one worker, AdamW", [0.62, 0.63, 0.62], "sync", 1, "adamw", reach=2.0)
                 + runs(tmp_path, "async, AdamW", [0.55, 0.56, 0.55], "async", 4, "adamw", reach=adam_reach)
                 + runs(tmp_path, "one worker, plain", [0.62, 0.63, 0.62], "sync", 1, "sgd", momentum=0.0, reach=2.0)
                 + runs(tmp_path, "async, plain", [0.62, 0.63, 0.62], "async", 4, "sgd", momentum=0.0, reach=2.0))
    exp = SimpleNamespace(id="E16", path="e16.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="adam_staleness", seeds=(0, 1, 2),
                          params={"sgd": ["one worker", "async"], "adamw": ["one worker, AdamW", "async, AdamW"],
                                  "plain": ["one worker, plain", "async, plain"], "margin": 0.02,
                                  "targets": [0.3, 0.4, 0.6], "slowdown_margin": 0.2})
    (tmp_path / "E16").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E16")
    assert section.verdict == verdict, section.body
    assert "left out, at or above that plateau: 60%" in section.body   # AdamW's async arm ends at 0.553
    no_margin = {k: v for k, v in exp.params.items() if k != "slowdown_margin"}
    with pytest.raises(ValueError, match="targets needs slowdown_margin too"):
        analyses.analyse(SimpleNamespace(**{**vars(exp), "params": no_margin}), summaries, tmp_path / "E16")
    assert "in updates to the target" in section.body


def test_a_language_models_updates_to_a_target_loss_count_down_to_it(tmp_path):
    """E17: the targets are losses, reached from above; AdamW's stale arm takes about 2.9 times its
    control's samples to each, plain SGD's as many as its control: confirmed by both measures."""
    acc = [0.3, 0.3, 0.3]
    summaries = (runs(tmp_path, "one worker", acc, "sync", 1, "sgd", [2.3, 2.31, 2.3], reach=2.0)
                 + runs(tmp_path, "async", acc, "async", 4, "sgd", [2.4, 2.41, 2.4], reach=2.0)
                 + runs(tmp_path, "one worker, AdamW", acc, "sync", 1, "adamw", [2.0, 2.01, 2.0], reach=2.0)
                 + runs(tmp_path, "async, AdamW", acc, "async", 4, "adamw", [2.3, 2.32, 2.31], reach=5.0)
                 + runs(tmp_path, "one worker, plain", acc, "sync", 1, "sgd", [2.3, 2.31, 2.3], momentum=0.0,
                        reach=2.0)
                 + runs(tmp_path, "async, plain", acc, "async", 4, "sgd", [2.3, 2.31, 2.3], momentum=0.0,
                        reach=2.0))
    exp = SimpleNamespace(id="E17", path="e17.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="adam_staleness", seeds=(0, 1, 2),
                          params={"sgd": ["one worker", "async"], "adamw": ["one worker, AdamW", "async, AdamW"],
                                  "plain": ["one worker, plain", "async, plain"], "margin": 0.05,
                                  "metric": "test_loss", "targets": [2.2, 3.0, 3.4], "slowdown_margin": 0.2})
    (tmp_path / "E17").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E17")
    assert section.verdict == "confirmed", section.body
    assert "target losses 3 to 3.4" in section.body and "left out, at or below that loss: 2.2" in section.body
    # AdamW's control reaches 3.0 at 120 samples, its stale arm at 342; plain SGD's two alike.
    assert "async at 3: 2.85" in section.body
