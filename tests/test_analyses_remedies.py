"""E11's analysis (psgd/lab/analyses_remedies.py backup_workers) on made-up runs: the verdict's share
is the part of sync's straggler loss that the backup arm avoids, measured from the backup arm's own
run without the straggler, so a backup arm that is faster than sync anyway does not pass 100%."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from psgd.core.config import OptimConfig, RunConfig, to_dict
from psgd.lab import analyses


def runs(root: Path, label: str, samples_per_s: list[float], backup: int = 0, straggler: bool = False,
         acc: float = 0.62) -> list:
    out = []
    for seed, rate in enumerate(samples_per_s):
        folder = root / f"{label.replace(' ', '_').replace('=', '')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(mode="sync", seed=seed, workers=4, backup_workers=backup,
                                straggler=((0, 10),) if straggler else (), optim=OptimConfig(lr=0.1)))
        (folder / "summary.json").write_text(json.dumps({
            "mode": "sync", "config": cfg, "servers": 1, "worker_steps": 3000, "global_updates": 750,
            "dropped_gradients": 0, "bytes_pushed": 3000 * 92200, "samples_per_s": rate,
            "updates_per_s": rate / 128, "staleness": {"mean": 0.0}}))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": acc, "samples": 1000 * v, "elapsed_s": v * 96 / rate}
        ) for v in range(7)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


@pytest.mark.parametrize("backup_hurt, verdict", [([29000.0, 29500.0, 28800.0], "confirmed"),   # costs it 1/10
                                                  ([12000.0, 12500.0, 11800.0], "depends")])     # 2/3 of sync's
def test_the_backup_arms_share_is_measured_from_its_own_footing(tmp_path, backup_hurt, verdict):
    summaries = (runs(tmp_path, "sync", [27000.0, 27500.0, 26800.0])
                 + runs(tmp_path, "sync straggler", [5000.0, 5200.0, 5100.0], straggler=True)
                 + runs(tmp_path, "sync b=1", [32000.0, 32400.0, 31900.0], backup=1)
                 + runs(tmp_path, "sync b=1 straggler", backup_hurt, backup=1, straggler=True))
    exp = SimpleNamespace(id="E11", path="e11.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="backup_workers", seeds=(0, 1, 2), params={"target_accuracy": 0.55})
    (tmp_path / "E11").mkdir()
    section = analyses.analyse(exp, summaries, tmp_path / "E11")
    assert section.verdict == verdict, section.headline
    share = next(e for e in section.effects if "avoided" in e.label)
    # 1 - (b=1's own loss) / (sync's loss): 1 - (32100 - 29100) / (27100 - 5100) = 0.864 for the first
    expected = 1 - (32100 - sum(backup_hurt) / 3) / (27100 - 5100)
    assert share.ci.estimate == pytest.approx(expected)
    assert "with the straggler sync b=1 runs at" in section.headline
    # Against sync's own baseline the first case "recovers" 109%: the share the verdict no longer uses.
    assert ("recovers 109" in section.headline) == (verdict == "confirmed")
