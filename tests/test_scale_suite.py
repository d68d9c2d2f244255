"""The scale suite (experiments/scale.toml): simulated arms in the lab's schema, and its two analyses on a
tiny copy of its experiments (the suite's own profiles are sized for minutes, not for a test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psgd.lab import suite
from psgd.lab.experiment import run_digest
from psgd.lab.settings import SuiteError, sim_settings
from tests.helpers import psgd_main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("profile", suite.PROFILES)
def test_the_scale_suite_is_valid_and_every_arm_is_simulated(profile, tmp_path):
    experiments = suite.load_suite(ROOT / "experiments" / "scale.toml", profile, results=tmp_path)
    assert sorted(e.id for e in experiments) == ["S1", "S2", "S3", "S4"]
    for e in experiments:
        assert "SIMULATED" in e.title
        for spec in e.tune_specs() + e.planned_specs():
            assert spec.sim["compute"] and spec.sim["apply"] and "--simulate" in spec.command
            # a simulated run never takes the folder of the real run of the same config
            assert Path(spec.cfg.out).name != run_digest(spec.cfg, spec.version)


def test_simulate_keys_are_checked():
    assert sim_settings({}, "f") == {} and sim_settings({"simulate": False}, "f") == {}
    assert sim_settings({"simulate": True, "sim_compute": "5ms"}, "f") == {"compute": "5ms"}
    with pytest.raises(SuiteError, match="add simulate = true"):
        sim_settings({"sim_compute": "5ms"}, "f")
    with pytest.raises(SuiteError, match="'simulate' must be true or false"):
        sim_settings({"simulate": "yes"}, "f")


def swap(text: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert old in text, f"the experiment file no longer says {old!r}: update this test's copy"
        text = text.replace(old, new)
    return text


def tiny(tmp_path: Path) -> Path:
    """The suite's experiment files, shrunk: S1 on N = 2, 4 and K = 1, 2; S2 on 4 workers, briefly; S3 on
    4 and 4 + 2 workers. The async arms' grids (tune_lr) are two rates about where this copy's tuning
    picks (a one-rate grid grew to 4 rates, 3 of them the sweep's, 12 runs a label): the sweep still adds a
    rate past the end where the pick sits, and settles on an inside pick at 3 rates (9 runs)."""
    s1 = swap((ROOT / "experiments" / "s01_sim_bottleneck.toml").read_text(),
              ("workers = [2, 4, 8, 16, 32, 64, 128, 256]", "workers = [2, 4]"),
              ("servers = [1, 2, 4]", "servers = [1, 2]"), ("num_samples = 40000", "num_samples = 1000"),
              ('link = "1gbit,100us"', 'link = "10mbit,100us"'), ("seeds = [0, 1, 2]", "seeds = [0, 1]"))
    s2 = swap((ROOT / "experiments" / "s02_sim_time_to_accuracy.toml").read_text(),
              ("workers = 32", "workers = 4"), ("epochs = 60.0", "epochs = 3.0"),
              ("seeds = [0, 1, 2, 3, 4]", "seeds = [0, 1]"), ("tune_lr = [0.01, 0.03]", "tune_lr = [0.27, 0.81]"),
              ("[tune]\nlr = [0.3, 1.0]", "[tune]\nlr = [0.3]"), ("eval_samples = 4096", "eval_samples = 256"),
              ("targets = [0.30, 0.35, 0.40, 0.45]", "targets = [0.11, 0.12]"))
    s3 = swap((ROOT / "experiments" / "s03_sim_backup_workers.toml").read_text(),
              ("workers = 32", "workers = 4"), ("workers = 34", "workers = 6"), ("epochs = 34.0", "epochs = 3.0"),
              ("epochs = 36.125", "epochs = 4.5"), ("eval_samples = 8704", "eval_samples = 192"),
              ("seeds = [0, 1, 2]", "seeds = [0, 1]"), ("tune_lr = [0.01, 0.03]", "tune_lr = [0.09, 0.27]"),
              ("[tune]\nlr = [0.3, 1.0]", "[tune]\nlr = [0.3]"), ("target_accuracy = 0.55", "target_accuracy = 0.11"))
    (tmp_path / "s01.toml").write_text(s1)
    (tmp_path / "s02.toml").write_text(s2)
    s4 = swap((ROOT / "experiments" / "s04_sim_staleness_aware.toml").read_text(),
              ("workers = 32", "workers = 4"), ("epochs = 30.0", "epochs = 2.0"),
              ("eval_samples = 4096", "eval_samples = 128"),
              ("seeds = [0, 1, 2]", "seeds = [0, 1]"), ("tune_lr = [0.003, 0.01, 0.03, 0.1]", "tune_lr = [0.27, 0.81]"),
              ("tune_lr = [0.03, 0.1, 0.3, 1.0]", "tune_lr = [0.9, 2.7]"))
    (tmp_path / "s03.toml").write_text(s3)
    (tmp_path / "s04.toml").write_text(s4)
    suite_file = tmp_path / "scale.toml"
    suite_file.write_text(swap((ROOT / "experiments" / "scale.toml").read_text(),
                               ("num_samples = 5000", "num_samples = 1000")))
    return suite_file


def test_a_tiny_scale_suite_reports_simulated_verdicts(tmp_path):
    results = tmp_path / "results"
    r = psgd_main("suite", str(tiny(tmp_path)), "--out", str(results))
    assert r.returncode == 0, r.stderr
    summary = json.loads((results / "summary.json").read_text())
    claims = {c["id"]: c for c in summary["claims"]}
    assert set(claims) == {"S1", "S2", "S3", "S4"}
    report = (results / "REPORT.md").read_text()
    for c in claims.values():
        assert c["headline"].startswith("SIMULATED (time model: compute 10 ms/step"), c["headline"]
    assert report.count("SIMULATED (time model:") >= 4
    # S1: the cost model beside every simulated point; at 10 Mbit/s one shard's link is the bottleneck.
    table = report.split("## S1")[1].split("## S2")[0]
    rows = [line for line in table.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert "cost model samples/s" in table and len(rows) == 4, table
    assert (results / "S1" / "throughput_vs_workers.png").stat().st_size > 0
    # S2: each check's ratio as a curve over the targets, and the arms' seconds to the target.
    assert (results / "S2" / "ratio_vs_target.png").stat().st_size > 0, report.split("## S2")[1]
    assert "SIMULATED s to" in (results / "S2" / "seconds_to_target.md").read_text()
    # S3: E19's rule on simulated runs, its figures and prose saying so (not the measured runs' CPU quotas).
    s3 = report.split("## S3")[1]
    assert "virtual machines of their own" in s3 and "kernel CPU quota" not in s3
    assert (results / "S3" / "time_to_target.png").stat().st_size > 0 and "SIMULATED: Virtual seconds" in s3
    assert claims["S3"]["by_construction"] and {"b2"} <= set(claims["S3"]["key"])
    # S4: E21's rule on simulated runs, SIMULATED in its headline and text.
    assert "Every run here is SIMULATED" in report.split("## S4")[1] and claims["S4"]["key"]["simulated"]
