"""E23's analysis (psgd/lab/analyses_goyal.py) on made-up runs: the scaled arm must end within the
margin of the small batch and of the large batch's own tuned rate; arms found by batch and warmup."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from psgd.core.config import OptimConfig, RunConfig, to_dict
from psgd.lab import analyses


def runs(root: Path, label: str, acc: float, batch: int, warmup: int = 0) -> list:
    out = []
    for seed, jiggle in enumerate((0.0, 0.002, -0.002)):
        folder = root / f"{label.replace(' ', '_')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(mode="sync", seed=seed, workers=4, batch_size=batch,
                                optim=OptimConfig(lr=0.1, warmup=warmup)))
        (folder / "summary.json").write_text(json.dumps({
            "mode": "sync", "config": cfg, "servers": 1, "worker_steps": 400, "global_updates": 100,
            "samples_per_s": 1000.0, "updates_per_s": 10.0, "staleness": {"mean": 0.0}}))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": acc + jiggle, "samples": 1000 * v, "elapsed_s": v})
            for v in range(6)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


@pytest.mark.parametrize("scaled, verdict", [(0.615, "confirmed"), (0.55, "refuted")])
def test_the_scaled_arm_against_the_small_batch_and_its_own_tuned_rate(tmp_path, scaled, verdict):
    summaries = (runs(tmp_path, "small", 0.62, 32) + runs(tmp_path, "scaled", scaled, 256, warmup=15)
                 + runs(tmp_path, "tuned", 0.61, 256))
    exp = SimpleNamespace(id="E23", path="e23.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="linear_scaling", seeds=(0, 1, 2), params={})
    (tmp_path / "E23").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E23")
    assert section.verdict == verdict, section.headline
    assert section.key["k"] == 8 and section.key["batch"] == 1024
    assert section.key["vs_small"] == pytest.approx(scaled - 0.62)
