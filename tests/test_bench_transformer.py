"""`psgd bench transformer`: steady-state rates, ratios computed from the measured rows, the outputs'
shape, and the bytes per parameter counted from real objects. Tiny sizes, in this process; speed
itself is never asserted (the arms' processes are covered by the runs they reuse: test_run.py,
test_gpt.py)."""

from __future__ import annotations

import csv
import json
import statistics

import pytest
import torch

from psgd.bench import transformer as tb
from tests.helpers import psgd_main

TINY = dict(width=16, layers=1, heads=2, batch=8, steps=6)


def test_steady_rate_leaves_out_the_warm_up_and_the_last_step():
    ends = [0.0, 5.0, 10.0, 10.5, 11.0, 13.0, 13.5, 40.0]  # slow first steps, one stalled, a slow last one
    median, window, timed = tb.steady_rate(ends, skip=2)
    assert timed == 4 and median == pytest.approx(2.0)      # kept 10.0 .. 13.5: steps of 0.5, 0.5, 2, 0.5 s
    assert window == pytest.approx(4 / 3.5)                 # the stall counts over the window
    both = tb.rate_of([ends, [t * 2 for t in ends]], skip=2, batch=8)
    assert both["samples_per_s"] == pytest.approx((2.0 + 1.0) * 8) and both["steps_timed"] == 4
    assert both["samples_per_s_window"] == pytest.approx((4 / 3.5 + 4 / 7) * 8)
    with pytest.raises(ValueError, match="more --steps"):
        tb.steady_rate(ends[:4], skip=2)


def fake_rows() -> list[dict]:
    speeds = {"plain": [500, 520, 480], "ps": [450, 400, 470], "allreduce": [600, 650, 630], "ddp": [700, 640, 690]}
    return [{"round": r + 1, "arm": arm, "status": "ok", "samples_per_s": float(v[r]), "step_ms": 1.0, "threads": 1,
             "processes": 2, "peak_rss_sum_mib": 100.0 + r, "peak_pss_sum_mib": 50.0, "compute_ms": 2.0 + r,
             "exchange_ms": None if arm in ("plain", "ddp") else 0.5, "samples_per_s_window": float(v[r]) / 2}
            for r in range(3) for arm, v in speeds.items()]


def test_ratios_are_the_medians_of_the_measured_rows_with_each_round_beside():
    rows = fake_rows()
    rows.append({"round": 3, "arm": "ddp", "status": "failed: gone", "note": "gone"})  # a failed run counts nowhere
    s = tb.summarise(rows)
    assert s["arms"]["ps"]["samples_per_s"] == 450 and s["arms"]["ps"]["min"] == 400 and s["arms"]["ps"]["runs"] == 3
    assert s["arms"]["ps"]["compute_ms"] == 3.0 and s["arms"]["ps"]["exchange_ms"] == 0.5
    assert s["arms"]["plain"]["exchange_ms"] is None  # no exchange to split off
    ratio = {r["name"]: r for r in s["ratios"]}
    ps = ratio["ps_over_plain"]
    assert ps["per_round"] == pytest.approx([450 / 500, 400 / 520, 470 / 480])
    assert ps["ratio"] == pytest.approx(450 / 500) and ps["met"] is True  # the median round's
    assert ps["window_per_round"] == pytest.approx(ps["per_round"]) and ps["window_ratio"] == pytest.approx(0.9)
    medians = statistics.median([450, 400, 470]) / statistics.median([500, 520, 480])
    assert ps["ratio_of_medians"] == pytest.approx(medians)
    ar = ratio["allreduce_over_ddp"]
    assert ar["per_round"] == pytest.approx([600 / 700, 650 / 640, 630 / 690])
    assert ar["ratio"] == pytest.approx(630 / 690) and ar["met"] is True and ar["target"] == 0.9
    assert len(ar["per_round"]) == 3 and ar["min"] == min(ar["per_round"]) and ar["max"] == max(ar["per_round"])
    only = tb.summarise([r for r in rows if r["arm"] != "ddp"])
    assert {r["name"]: r["ratio"] for r in only["ratios"]}["allreduce_over_ddp"] is None  # not measured, not 0


def test_main_writes_json_csv_and_tables_from_its_runs(monkeypatch, tmp_path):
    measured = iter(r for r in fake_rows())
    calls = []

    def fake_run(arm, cfg, skip, timeout=600.0):
        calls.append((arm, cfg.mode, cfg.workers, cfg.transport, cfg.optim.optimizer, cfg.model.model))
        row = next(measured)
        return {k: v for k, v in row.items() if k not in ("round", "arm")}

    monkeypatch.setattr(tb, "run_arm", fake_run)
    out = tmp_path / "out"
    r = psgd_main("bench", "transformer", "--width", "16", "--layers", "1", "--heads", "2", "--steps", "6",
                  "--skip", "1", "--rounds", "3", "--no-memory", "--out", str(out), "--runs", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr
    assert {c[0] for c in calls} == set(tb.ARMS) and len(calls) == 12
    assert [c[0] for c in calls[:4]] == ["ps", "plain", "allreduce", "ddp"]  # each ratio's two arms back to back
    assert [c[0] for c in calls[4:8]] == ["allreduce", "ddp", "ps", "plain"]  # the other pair first next round
    assert [c[0] for c in calls[8:12]] == ["plain", "ps", "ddp", "allreduce"]  # and the other arm of each first
    assert {c[1:] for c in calls if c[0] == "ps"} == {("async", 1, "tcp", "adamw", "gpt")}
    assert {c[1:3] for c in calls if c[0] in ("allreduce", "ddp")} == {("allreduce", 2)}
    result = json.loads((out / "transformer.json").read_text())
    command = (out / "command.txt").read_text().splitlines()
    assert command[0] == result["command"] and command[1].startswith("# started ") and "cores" in command[1]
    assert command[2].startswith("# finished ") and len(command) == 3
    assert result["model"]["params"] > 0 and result["memory_budget_mib"] == 2048 and result["per_param"] is None
    rows = list(csv.DictReader(open(out / "transformer.csv")))
    assert len(rows) == 12 and set(rows[0]) == set(tb.FIELDS)
    for ratio in result["summary"]["ratios"]:
        speed = {(x["round"], x["arm"]): float(x["samples_per_s"]) for x in rows}
        each = sorted(speed[(str(r), ratio["num"])] / speed[(str(r), ratio["den"])] for r in (1, 2, 3))
        assert ratio["ratio"] == pytest.approx(each[1])  # the median of the rounds' ratios, from the CSV rows
    table = (out / "TRANSFORMER.md").read_text()
    assert "| ps / plain |" in table and "| allreduce / ddp |" in table and "2048 MiB" in table


def test_the_torch_loop_times_every_step_and_bytes_per_parameter_are_counted_from_the_objects(tmp_path):
    base = tb.workload(**TINY)
    cfg = tb.arm_config(base, "plain", tmp_path / "plain")
    result = tb.torch_loop(cfg, 0)
    assert len(result["ends"]) == TINY["steps"] and result["ends"] == sorted(result["ends"])
    assert torch.isfinite(torch.tensor(result["final_train_loss"]))
    m = tb.per_param(base, local_steps=2)
    a, d = m["adamw_shard"], m["diloco"]
    n = a["params"]
    # AdamW: two fp32 moments and a scalar step count beside the fp32 parameter.
    assert set(a["shard_optimizer_tensors"]) == {"exp_avg", "exp_avg_sq", "step_t"}
    assert a["shard_bytes_per_param"] == pytest.approx(4 + 8 + 4 / n)
    # DiLoCo: the shard's outer Nesterov holds one momentum buffer; the worker its inner AdamW and
    # the round's base and delta beside the flat parameters and gradients.
    assert d["shard_optimizer_tensors"] == ["momentum_buffer"] and d["shard_bytes_per_param"] == 8
    assert d["inner_optimizer_bytes_per_param"] == pytest.approx(8 + 4 / n)
    assert d["worker_bytes_per_param"] == pytest.approx(24 + 4 / n)


def test_usage_errors_are_one_line():
    for bad in (["--rounds", "0"], ["--steps", "3", "--skip", "2"], ["--arms", "plain,tpu"], ["--heads", "3"]):
        r = psgd_main("bench", "transformer", *bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)
