"""E15's analysis (psgd/lab/analyses_elastic.py) on made-up runs: the verdict comes from the paired
accuracy gap to the fixed job of the final size, and throughput per segment is read from
summary.json's membership segments."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from psgd.core.config import RunConfig, to_dict
from psgd.lab import analyses


def runs(root: Path, label: str, acc: list[float], workers: int, elastic: str = "", segments=()) -> list:
    out = []
    for seed, a in enumerate(acc):
        folder = root / f"{label.replace(' ', '_')}-{seed}"
        folder.mkdir(parents=True)
        cfg = to_dict(RunConfig(seed=seed, workers=workers, elastic=elastic, batch_size=32))
        summary = {"mode": "sync", "config": cfg, "samples_per_s": 1000.0 * workers + seed, "global_updates": 900,
                   "worker_steps": 3000, "membership": {"segments": list(segments),
                                                        "joiners": [{"worker": 2, "first_step_s": 0.01}]}}
        (folder / "summary.json").write_text(json.dumps(summary))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"event": "eval", "version": v, "test_accuracy": a, "elapsed_s": v, "samples": 100 * v})
            for v in range(6)))
        out.append((SimpleNamespace(label=label, cfg=SimpleNamespace(out=str(folder))), {}))
    return out


def test_elastic_analysis_judges_the_gap_to_the_fixed_large_job_and_reads_the_segments(tmp_path):
    segs = [{"workers": 2, "samples_per_s": 1800.0}, {"workers": 4, "samples_per_s": 4400.0}]
    summaries = (runs(tmp_path, "fixed 2", [0.60, 0.61, 0.60], 2) + runs(tmp_path, "sync", [0.62, 0.62, 0.63], 4)
                 + runs(tmp_path, "elastic", [0.62, 0.625, 0.63], 4, "0:2,300:4", segs))
    exp = SimpleNamespace(id="E15", path="e15.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="elastic", seeds=(0, 1, 2),
                          params={"elastic": "elastic", "small": "fixed 2", "large": "sync"})
    out = tmp_path / "E15"
    out.mkdir()
    section = analyses.analyse(exp, summaries, out)
    assert section.verdict == "confirmed", section.headline   # +0.002 [-0.004, +0.008] vs margin -0.01
    assert "accuracy minus fixed 4 +0.002" in section.headline
    assert "before the change 0.90" in section.headline and "after it 1.10" in section.headline
    assert (out / "throughput.png").exists() and (out / "throughput.csv").exists()


def test_an_elastic_run_that_never_grew_is_not_judged_and_prints_no_nan(tmp_path):
    """Issue 54, item 5: --quick's budget ends before the schedule's change, so the elastic run has no
    segments; E15 said "samples/s before the change nanx fixed 2's" and judged it anyway."""
    summaries = (runs(tmp_path, "fixed 2", [0.60, 0.61, 0.60], 2) + runs(tmp_path, "sync", [0.62, 0.62, 0.63], 4)
                 + runs(tmp_path, "elastic", [0.62, 0.625, 0.63], 4, "0:2,300:4"))
    exp = SimpleNamespace(id="E15", path="e15.toml", title="t", claim="c", quote="", quote_en="", quote_source="",
                          why="w", analysis="elastic", seeds=(0, 1, 2),
                          params={"elastic": "elastic", "small": "fixed 2", "large": "sync"})
    out = tmp_path / "E15"
    out.mkdir()
    section = analyses.analyse(exp, summaries, out)
    assert section.verdict == "inconclusive" and "nan" not in section.headline, section.headline
    assert section.headline.startswith("not judged: the elastic run never changed its membership (--elastic 0:2,300:4")
