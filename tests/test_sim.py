"""The simulated cluster (psgd/sim/): the real run's parameters bit for bit where the order is fixed
(sync; one async worker), async repeatable bit for bit under one seed, the time model's pieces, and
its flags refused where they do not apply.

The bit-for-bit checks run the real job too (`psgd run --transport tcp`, real processes), as
tests/test_kernel_hashes.py does, and compare the two runs' params_sha256 on this machine.
"""

from __future__ import annotations

import json
import math

import pytest

from psgd.sim import timemodel
from psgd.sim.events import Clock, Queue, take_both
from tests.helpers import events, psgd_main, summary

SIM = ("--simulate", "--sim-compute", "2ms", "--sim-apply", "0.3ns")


def step_times(out) -> list[tuple[int, int, float]]:
    """(rank, clock, virtual seconds from the start) of every step line, in the order written."""
    lines = events(out)
    base = lines[0]["process_start"]
    return [(e["rank"], e["clock"], round(e["time"] - base, 9)) for e in lines if e.get("event") == "step"]


def run(out, *flags: str) -> dict:
    r = psgd_main("run", *flags, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return summary(out)


@pytest.mark.usefixtures("warm_runs")
@pytest.mark.parametrize("flags", [
    ("--mode", "sync", "--workers", "3", "--servers", "2", "--eval-every", "20"),
    ("--mode", "async", "--workers", "1", "--servers", "2", "--eval-every", "0"),
], ids=["sync-3x2", "async-1x2"])
def test_sync_and_one_async_worker_simulated_give_the_real_runs_parameters_bit_for_bit(tmp_path, flags):
    real = run(tmp_path / "real", *flags, "--steps", "40", "--transport", "tcp")
    sim = run(tmp_path / "sim", *flags, "--steps", "40", *SIM)
    assert sim["params_sha256"] == real["params_sha256"]
    assert sim["global_updates"] == real["global_updates"] and sim["per_worker_steps"] == real["per_worker_steps"]
    assert sim["staleness"]["hist"] == real["staleness"]["hist"]
    assert sim["simulated"] is True and "simulated" not in real
    model = sim["time_model"]
    assert model["compute_s_per_step"] == 0.002 and "--sim-compute 2ms" in model["compute_source"]
    assert sim["final_test_accuracy"] == real["final_test_accuracy"]


def test_async_under_simulate_repeats_bit_for_bit_and_its_clock_follows_the_model(tmp_path):
    flags = ("--mode", "async", "--workers", "6", "--servers", "2", "--steps", "12", "--jitter", "3",
             "--jitter-tail", "pareto", "--link", "1gbit,100us", "--sim-speeds", "1,0.5", *SIM)
    a, b = run(tmp_path / "a", *flags), run(tmp_path / "b", *flags)
    assert a["params_sha256"] == b["params_sha256"]
    assert a["staleness"] == b["staleness"] and a["wall_time_s"] == b["wall_time_s"]
    steps, again = step_times(tmp_path / "a"), step_times(tmp_path / "b")
    assert steps == again and len(steps) >= 6 * 12
    # Stale by the model: 6 workers, so gradients are applied on versions up to 5 behind or more.
    assert a["staleness"]["mean"] > 1 and a["global_updates"] == 6 * 12
    # The slow half (speed 0.5) computes each step in twice the time: fewer of its steps land.
    fast = sum(a["per_worker_steps"][str(w)] for w in (0, 2, 4))
    slow = sum(a["per_worker_steps"][str(w)] for w in (1, 3, 5))
    assert fast > slow


def test_ssp_under_simulate_keeps_its_bound_and_sync_waits_for_the_straggler(tmp_path):
    ssp = run(tmp_path / "ssp", "--mode", "ssp", "--staleness", "1", "--workers", "4", "--steps", "10",
              "--straggler", "0=20", *SIM)
    assert ssp["max_clock_gap"] <= 1 and ssp["global_updates"] == 40
    sync = run(tmp_path / "sync", "--mode", "sync", "--workers", "4", "--steps", "10", "--straggler", "0=20", *SIM)
    # Every sync step waits for worker 0's 2 + 20 ms: the virtual wall time is at least ten of them.
    assert sync["wall_time_s"] >= 10 * 0.022 and sync["staleness"]["max"] == 0


def test_the_central_shard_is_a_queue_the_bottleneck_emerges_from_it(tmp_path):
    # A 1 Mbit/s link: the model's transfers dominate, and one shard's NIC serialises the N pulls out and
    # the N pushes in (the first worker's push overlaps the later pulls): a sync step takes about (N + 1)
    # transfers, so N = 4 against N = 2 is about 5 / 3. Nothing in the model says "bottleneck".
    walls = {}
    for n in (2, 4):
        s = run(tmp_path / f"n{n}", "--mode", "sync", "--workers", str(n), "--steps", "5", "--link", "1mbit", *SIM)
        walls[n] = s["wall_time_s"]
    assert 5 / 3 * 0.95 < walls[4] / walls[2] < 5 / 3 * 1.05, walls


@pytest.mark.parametrize("argv,says", [
    (["--sim-compute", "5ms"], "add --simulate"),
    (["--simulate", "--mode", "allreduce"], "--mode allreduce is not simulated yet"),
    (["--simulate", "--sim-compute", "5 parsecs"], "--sim-compute expects a duration"),
    (["--simulate", "--sim-speeds", "1,-1"], "every speed must be a positive number"),
    (["--simulate", "--sim-spread", "-0.2"], "--sim-spread must be a finite number >= 0"),
])
def test_a_bad_simulation_flag_is_one_line_and_exit_2(tmp_path, argv, says):
    r = psgd_main("run", *argv, "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_time_model_pieces():
    assert timemodel.seconds("120ms") == pytest.approx(0.12) and timemodel.seconds("0.25ns") == pytest.approx(2.5e-10)
    assert timemodel.compute_of("40us/sample", 32)[0] == pytest.approx(32 * 40e-6)
    assert timemodel.speeds_of("1,0.5", 5, 0) == (1.0, 0.5, 1.0, 0.5, 1.0)
    drawn = timemodel.speeds_of("lognormal:0.3", 64, 7)
    assert drawn == timemodel.speeds_of("lognormal:0.3", 64, 7) and len(set(drawn)) == 64
    tm = timemodel.TimeModel(compute_s=0.01, compute_source="given", speeds=(1.0,), bits_per_s=8e9)
    assert tm.transfer_s(1000) == pytest.approx(1e-6)
    assert timemodel.TimeModel(0.01, "given", (1.0,)).transfer_s(10**9) == 0.0 and math.isinf(tm.bits_per_s) is False


def test_a_profile_names_only_what_it_knows(tmp_path):
    good = tmp_path / "gpu.toml"
    good.write_text('compute = "40us/sample"\nlink = "25gbit,5us"\napply = "0.1ns"\n')
    assert timemodel.load_profile(str(good)) == {"compute": "40us/sample", "link": "25gbit,5us", "apply": "0.1ns"}
    bad = tmp_path / "bad.toml"
    bad.write_text('computer = "1ms"\n')
    with pytest.raises(ValueError, match="unknown key.*computer"):
        timemodel.load_profile(str(bad))


def test_the_clock_runs_events_in_time_then_in_the_order_they_were_scheduled():
    clock, seen = Clock(), []
    for name, t in (("b", 1.0), ("a", 0.5), ("c", 1.0), ("d", 0.5)):
        clock.at(t, seen.append, name)
    clock.run()
    assert seen == ["a", "d", "b", "c"] and clock.now == 1.0 and clock.events == 4
    q, r = Queue(), Queue()
    assert q.take(0.0, 2.0) == 2.0 and q.take(1.0, 1.0) == 3.0  # the second waits for the first
    assert take_both(0.0, 1.0, q, r) == 4.0 and r.free_at == 4.0  # needs both ends free


def test_fit_simulates_too(tmp_path):
    import psgd

    got = psgd.fit(mode="async", workers=3, steps=4, out=str(tmp_path / "fit"), simulate=True, sim_compute="1ms",
                   sim_apply="0.1ns")
    assert got.summary["simulated"] is True and got.summary["global_updates"] == 12
    assert got.summary["params_sha256"] == summary(tmp_path / "fit")["params_sha256"]
    with pytest.raises(ValueError, match="unknown simulation keyword"):
        psgd.fit(steps=1, out=str(tmp_path / "bad"), simulate=True, sim_speed="1")


def test_bench_sim_reports_the_cost_of_each_worker_count(tmp_path):
    r = psgd_main("bench", "sim", "--workers", "1,4", "--gradients", "8", "--rounds", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(x["workers"], x["gradients_applied"], x["gradients_computed"]) for x in rows] == [(1, 8, 8), (4, 8, 8)]
    assert rows[0]["cost_ratio"] == 1.0 and rows[1]["peak_vectors_in_flight"] == 4
    assert "SIMULATED" in (tmp_path / "bench.md").read_text() and (tmp_path / "command.txt").exists()


def test_bench_sim_vs_real_puts_a_real_run_beside_its_calibrated_simulation(tmp_path):
    r = psgd_main("bench", "sim-vs-real", "--modes", "async", "--workers", "2", "--steps", "5", "--seeds", "2",
                  "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "bench.json").read_text())
    assert [row["seed"] for row in got["rows"]] == [0, 1]
    row = got["rows"][0]
    assert set(row["real"]) == set(row["simulated"]) and row["simulated"]["updates_per_s"] > 0
    assert row["law"]["compute_s"] > 0 and len(row["law"]["speeds"]) == 2 and "spread" in row["time_model"]
    by_metric = {t["metric"]: t for t in got["summary"]}
    assert by_metric["staleness_mean"]["seeds"] == 2 and by_metric["updates_per_s"]["passes"] in (True, False)
    assert by_metric["final_test_accuracy"]["sim_minus_real"]["n"] == 2


def test_a_run_s_step_lines_give_back_the_law_that_made_them(tmp_path):
    # A simulated run with a known law (no link: a step's own time is its compute alone), then step_law
    # on its step lines: the mean, the speeds and the spread come back.
    from psgd.sim.calibrate import step_law

    run(tmp_path / "law", "--mode", "async", "--workers", "3", "--steps", "150", "--eval-every", "0",
        "--sim-speeds", "1,0.5,2", "--sim-spread", "0.4", *SIM)
    law = step_law(events(tmp_path / "law"), 3)
    means = [0.002 / s for s in (1, 0.5, 2)]
    assert law["compute_s"] == pytest.approx(sum(means) / 3, rel=0.1)
    assert law["message_s"] < 1e-4  # the floor: the apply's time alone
    assert [law["compute_s"] / s for s in law["speeds"]] == pytest.approx(means, rel=0.1)
    assert law["spread"] == pytest.approx(0.4, rel=0.2)


def test_on_a_link_the_law_takes_compute_from_the_step_lines_and_leaves_the_wire_to_the_model(tmp_path):
    # A simulated run on a 100 Mbit/s link with a known law: wire_law (sim-vs-real --link) gives the
    # compute back from compute_s alone, and once the modelled wire time is taken off each half of the
    # fastest push + pull, next to no message is left (the wire is not counted twice).
    from psgd.bench.sim_vs_real import wire_law

    s = run(tmp_path / "law", "--mode", "async", "--workers", "3", "--steps", "60", "--eval-every", "0",
            "--sim-speeds", "1,0.5,2", "--sim-spread", "0.4", "--link", "100mbit,1ms", *SIM)
    wire = 8 * 4 * s["params"] / 1e8 + 1e-3
    law = wire_law(events(tmp_path / "law"), 3, wire)
    means = [0.002 / v for v in (1, 0.5, 2)]
    assert law["compute_s"] == pytest.approx(sum(means) / 3, rel=0.1)
    assert [law["compute_s"] / v for v in law["speeds"]] == pytest.approx(means, rel=0.1)
    assert law["message_s"] < 0.05 * wire
    assert wire_law(events(tmp_path / "law"), 3, 0.0)["message_s"] > 0.5 * wire  # unmodelled, the wire is message


def test_where_the_shaped_wire_is_not_the_model_s_is_said_from_the_kernel_s_counters():
    from psgd.bench.sim_vs_real import why

    rows = [{"mode": "sync", "workers": 4, "push_bytes": 88_104, "kernel": {"drops": d, "overlimits": 100}}
            for d in (1000, 1400)]
    (line,) = why(rows, 65_536)
    assert line == ("- sync N=4: a push of 88,104 bytes against a burst of 65,536; 1,200 packets dropped at the "
                    "shaped queues and 100 held by an empty bucket per run")
    assert why([{**rows[0], "kernel": {}}], 65_536) == []  # on loopback: nothing to say
    quota = [{"mode": "sync", "workers": 16, "kernel": {"throttled_share": v, "throttled_s": 1.5}} for v in (0.3, 0.5)]
    assert why(quota, None) == ["- sync N=16: each process stopped by its quota in 40% of its 100 ms periods, "
                                "1.50 s in all per run"]
    r = psgd_main("bench", "sim-vs-real", "--link", "fast")
    assert r.returncode == 2 and "--link expects BANDWIDTH" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_spread_lets_ssp_s_bound_bind(tmp_path):
    # Equal steps keep 4 workers in lockstep: SSP(1) never holds anyone and is async. With a spread the
    # workers drift apart, the bound holds the fast ones, and fewer updates land between a pull and its push.
    flags = ("--workers", "4", "--steps", "60", "--eval-every", "0", *SIM)
    a0, s0 = run(tmp_path / "a0", "--mode", "async", *flags), run(tmp_path / "s0", "--mode", "ssp", "--staleness", "1",
                                                                  *flags)
    assert a0["staleness"]["mean"] == s0["staleness"]["mean"]
    a, s = (run(tmp_path / m, "--mode", m, "--staleness", "1", *flags, "--sim-spread", "0.6") for m in ("async", "ssp"))
    assert s["staleness"]["mean"] < a["staleness"]["mean"] and s["max_clock_gap"] <= 1 < a["max_clock_gap"]
    assert "log-normal spread CV 0.6" in s["time_model"]["said"]


def test_backup_workers_under_simulate_drop_the_late_and_step_sooner(tmp_path):
    # Chen et al. 2016 in miniature: a heavy-tailed straggler law; with one backup worker each step
    # waits for the first 7 of 8, and the late gradient of a step is dropped, not applied.
    flags = ("--mode", "sync", "--workers", "8", "--steps", "20", "--jitter", "5", "--jitter-tail", "pareto", *SIM)
    plain, backup = run(tmp_path / "b0", *flags), run(tmp_path / "b1", *flags, "--backup-workers", "1")
    assert plain["global_updates"] == backup["global_updates"] == 20
    assert plain["dropped_gradients"] == 0 < backup["dropped_gradients"]
    assert backup["wall_time_s"] < plain["wall_time_s"]
