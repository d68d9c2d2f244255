"""psgd bench utilisation's pure parts (psgd/bench/utilisation.py): its runs, the utilisation read from a
run's summary, the cost model's amortised step, and the table and CSV. No cluster: the bench itself is
the measurement (results/bench/utilisation/)."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest

from psgd.bench import record, utilisation
from psgd.core import costmodel as cm
from psgd.core.config import validate
from psgd.core.errors import UsageError

# A 1 Gbit/s link (the wire form) and two shared cores (the one-host form), as shaped.machines builds them.
PS = cm.Machine(latency_s=200e-6, alpha_s=1e-4, beta_s_per_byte=8e-9, apply_s_per_byte=1e-10, cores=0)
MS = {"ps": PS, "ring": cm.Machine(alpha_s=1e-4, beta_s_per_byte=8e-9, ring_alpha_s=2e-4, ring_beta_s_per_byte=8e-9,
                                    apply_s_per_byte=1e-10, cores=0),
      "cpu": cm.Machine(alpha_s=1e-4, beta_s_per_byte=1e-9, apply_s_per_byte=1e-10, ring_alpha_s=2e-4,
                        ring_beta_s_per_byte=1e-9, cores=2)}
WORK = cm.Workload(params=2_000_000, batch=8, compute_s_fixed=0.01, compute_s_per_sample=0.0)


def args(**kw) -> argparse.Namespace:
    base = dict(rates=["1gbit", "10gbit"], latency="200us", workers=2, local_steps=[8, 32], rounds=2, steps=10,
                compute_ms=20, width=1024, batch_size=8)
    return argparse.Namespace(**{**base, **kw})


def test_runs_are_sync_ps_allreduce_and_local_sgd_and_diloco_at_each_h_on_the_cluster(tmp_path):
    runs = utilisation.plans(args(), "ut1gbit", tmp_path)
    assert [(m, h) for m, h, _ in runs] == utilisation.rows_order([8, 32]) == [
        ("ps", 1), ("allreduce", 1), ("local", 8), ("local", 32), ("diloco", 8), ("diloco", 32)]
    for method, h, cfg in runs:
        validate(cfg)   # each is a run psgd accepts
        assert cfg.cluster == "ut1gbit" and cfg.workers == 2 and cfg.straggler == ((0, 20), (1, 20))
        assert cfg.local_steps == h and cfg.steps == (10 if h == 1 else 2 * h)
        assert cfg.hosts == (2 if method == "allreduce" else 3)   # the shard on h0, a worker on each other host
        assert (cfg.mode, cfg.allreduce_impl if method == "allreduce" else "") == \
            ("allreduce" if method == "allreduce" else "sync", "library" if method == "allreduce" else "")
        assert cfg.optim.outer == ("nesterov" if method == "diloco" else "sgd")
    assert len({cfg.out for _, _, cfg in runs}) == len(runs)


def test_utilisation_is_a_workers_compute_over_the_wall():
    summary = {"per_worker_steps": {"0": 64, "1": 64}, "wall_time_s": 4.0, "time_breakdown_s": {"compute": 3.0},
               "bytes_pushed": 8_000_000, "bytes_pulled": 8_000_000, "worker_steps": 128, "params": 2_000_000}
    m = utilisation.measured(summary)
    assert m["step_s"] == 4.0 / 64 and m["compute_s"] == 3.0 / 64 and m["utilisation"] == 0.75
    assert m["bytes_per_step"] == 125_000 and m["params"] == 2_000_000


def test_the_models_exchange_is_amortised_over_h_and_the_slower_floor_binds():
    delay = 0.02
    sync = cm.step_time("sync", 2, 1, PS, WORK)
    one = utilisation.predict("ps", 2, 1, MS, WORK, 20)
    # H = 1 is the cost model's sync step plus the emulated compute, the wire binding (2 x 8 MB at 1 Gbit/s).
    assert one["bound"] == "wire" and one["predicted_step_s"] == pytest.approx(sync.total_s + delay)
    assert one["predicted_utilisation"] == pytest.approx((sync.compute_s + delay) / (sync.total_s + delay))
    local = utilisation.predict("local", 2, 8, MS, WORK, 20)
    compute = sync.compute_s + delay + WORK.size * PS.apply_s_per_byte   # the worker's own optimizer step too
    assert local["predicted_compute_s"] == pytest.approx(compute)
    assert local["predicted_step_s"] == pytest.approx(compute + (sync.total_s - sync.compute_s) / 8)
    assert utilisation.predict("diloco", 2, 8, MS, WORK, 20) == local   # the same bytes, the same step
    assert one["predicted_utilisation"] < local["predicted_utilisation"] < \
        utilisation.predict("local", 2, 32, MS, WORK, 20)["predicted_utilisation"] < 1
    ring = utilisation.predict("allreduce", 2, 1, MS, WORK, 20)
    assert ring["predicted_wire_s"] == pytest.approx(cm.step_time("ring", 2, 1, MS["ring"], WORK).total_s + delay)
    # On a fast wire the shared cores are the slower floor: the one-host form binds.
    fast = dict(MS, ps=cm.at_bandwidth(PS, 1e12, 0.0, False), ring=cm.at_bandwidth(MS["ring"], 1e12, 0.0, False))
    p = utilisation.predict("ps", 2, 1, fast, WORK, 20)
    assert p["bound"] == "CPU" and p["predicted_step_s"] == p["predicted_cpu_s"] > p["predicted_wire_s"]


def fake_rows() -> list[dict]:
    rows = []
    for rate, scale in (("1gbit", 1.0), ("10gbit", 0.25)):
        for method, h in utilisation.rows_order([8, 32]):
            if (rate, method, h) == ("10gbit", "diloco", 32):
                rows.append({"rate": rate, "method": method, "local_steps": h, "workers": 2,
                             "status": "failed: worker 1 died"})
                continue
            step = 0.02 + 0.3 * scale / h
            rows.append({"rate": rate, "method": method, "local_steps": h, "workers": 2, "status": "ok",
                         "step_s": step, "compute_s": 0.02, "utilisation": 0.02 / step, "params": 2_143_242,
                         "predicted_step_s": step * 1.25, "predicted_compute_s": 0.02,
                         "predicted_utilisation": 0.02 / (step * 1.25), "bound": "wire"})
    return rows


def test_the_table_has_a_row_per_method_and_h_and_a_column_per_rate_measured_beside_the_model(tmp_path):
    rows = fake_rows()
    links = [{"rate": "1gbit", "goodput_bits": 958e6, "psgd_bits": 943e6},
             {"rate": "10gbit", "goodput_bits": 9553e6, "psgd_bits": 8886e6}]
    md = utilisation.report(rows, links, args(), (1.5, 3.0))
    lines = md.splitlines()
    head = lines.index("| method | H | 1gbit | 10gbit |")
    assert lines[head + 1] == "|---|---|---|---|"
    body = lines[head + 2:head + 8]
    assert [ln.split(" | ")[:2] for ln in body] == [
        ["| sync PS, 1 shard", "1"], ["| all-reduce (gloo)", "1"], ["| local SGD (PS, outer average)", "8"],
        ["| local SGD (PS, outer average)", "32"], ["| DiLoCo (PS, outer Nesterov)", "8"],
        ["| DiLoCo (PS, outer Nesterov)", "32"]]
    # sync PS at 1gbit: 0.02 / 0.32 measured, 0.02 / 0.4 by the model; a failed run is a dash.
    assert body[0] == "| sync PS, 1 shard | 1 | 6.2% (5.0%) | 21.1% (16.8%) |"
    assert body[5].endswith("| — |") and "failed" not in md
    assert "| sync PS, 1 shard | 1 | 320.0 (400.0, wire) | 95.0 (118.8, wire) |" in lines
    assert "Measured / model utilisation: 1.25 to 1.25 over 11 points" in md
    assert "| 10gbit | 9553 | 8886 |" in lines and "load average 1.5 at its start, 3.0 at its end" in md
    record.write_csv(tmp_path / "u.csv", rows, utilisation.FIELDS)
    back = list(csv.DictReader(Path(tmp_path / "u.csv").open()))
    assert len(back) == 12 and list(back[0]) == utilisation.FIELDS
    assert float(back[0]["utilisation"]) == pytest.approx(0.0625) and back[-1]["status"].startswith("failed")


@pytest.mark.parametrize("flags", [["--workers", "1"], ["--rounds", "1"], ["--local-steps", "1,8"],
                                   ["--rates", "unlimited"], ["--name", "u-t"]])
def test_bad_flags_are_usage_errors_before_any_cluster(flags):
    with pytest.raises(UsageError):   # exit 2 with its one line (psgd/core/errors.py), nothing made
        utilisation.main(flags)


def test_a_fractional_compute_time_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:   # --straggler RANK=MS takes whole milliseconds
        utilisation.main(["--compute-ms", "1.5"])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
