"""E21's analysis (psgd/lab/analyses_staleness_aware.py) on made-up runs: the staleness-aware arm's
accuracy minus plain async's, paired by seed, against one point; arms found by their configs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from psgd.core.config import OptimConfig, RunConfig, to_dict
from psgd.lab import analyses


def runs(root: Path, label: str, accs: list[float], aware: bool) -> list:
    out = []
    for seed, acc in enumerate(accs):
        folder = root / f"{label.replace(' ', '_')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(mode="async", seed=seed, workers=16, staleness_lr=aware, optim=OptimConfig(lr=0.1)))
        (folder / "summary.json").write_text(json.dumps({
            "mode": "async", "config": cfg, "servers": 1, "worker_steps": 3000, "global_updates": 3000,
            "samples_per_s": 10000.0, "updates_per_s": 300.0, "staleness": {"mean": 15.0}}))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": acc, "samples": 1000 * v, "elapsed_s": v})
            for v in range(6)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


@pytest.mark.parametrize("aware, verdict", [([0.60, 0.61, 0.62], "confirmed"), ([0.55, 0.56, 0.57], "refuted"),
                                            ([0.55, 0.61, 0.57], "inconclusive")])
def test_the_gain_over_plain_async_decides(tmp_path, aware, verdict):
    summaries = runs(tmp_path, "plain", [0.56, 0.57, 0.58], False) + runs(tmp_path, "aware", aware, True)
    exp = SimpleNamespace(id="E21", path="e21.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="staleness_aware", seeds=(0, 1, 2), params={})
    (tmp_path / "E21").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E21")
    assert section.verdict == verdict, section.headline
    assert "mean staleness 15.0" in section.headline
