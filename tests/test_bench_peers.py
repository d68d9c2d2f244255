"""`psgd bench peers` at a tiny budget: well-formed output, and the PyTorch RPC peer's sync run
computes what psgd's sync PS computes (same init, batches and mean: the same final parameters).
Speed is never asserted. The table's arithmetic is checked on made-up rows (no processes)."""

import csv
import json

import pytest
import torch

from psgd.bench import peers, ray_peer
from tests.helpers import processes_mentioning, psgd_main

pytestmark = pytest.mark.xdist_group("bench")


@pytest.mark.usefixtures("warm_runs")  # psgd's run (launch.run) forks from the warm parent
def test_tiny_run_and_the_rpc_peer_computes_what_psgd_does(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    r = psgd_main("bench", "peers", "--widths", "16", "--configs", "sync2", "--steps", "4", "--rounds", "1",
                  "--peers", "rpc", "--transports", "tcp", "--keep-runs", "--out", str(out), "--runs", str(runs))
    assert r.returncode == 0, r.stderr + r.stdout
    rows = list(csv.DictReader(open(out / "peers.csv")))
    assert sorted((row["system"], row["mode"], row["workers"], row["width"]) for row in rows) == [
        ("rpc", "sync", "2", "16"), ("tcp", "sync", "2", "16")]
    by = {row["system"]: row for row in rows}
    for system in ("rpc", "tcp"):
        row = by[system]
        assert row["status"] == "ok", row
        assert row["global_updates"] == "4" and float(row["updates_per_s"]) > 0 and float(row["wall_s"]) > 0
        assert float(row["compute_ms"]) > 0 and float(row["exchange_ms"]) > 0 and float(row["run_s"]) > 0
        assert 0 < float(row["startup_s"]) < float(row["run_s"])

    # Same seed, init, batch plan and arithmetic: the peer's final parameters are psgd's.
    psgd_run = runs / "round1" / "tcp-w16-sync2"
    assert json.loads((psgd_run / "config.json").read_text())["transport"] == "tcp"
    w_psgd = torch.load(psgd_run / "final_params.pt", weights_only=True)
    w_rpc = torch.load(runs / "round1" / "rpc-w16-sync2" / "final_params.pt", weights_only=True)
    assert w_rpc.shape == w_psgd.shape and torch.allclose(w_rpc, w_psgd, rtol=0, atol=1e-6), \
        (w_rpc - w_psgd).abs().max()
    assert float(by["rpc"]["param_diff"]) <= 1e-6 and float(by["tcp"]["param_diff"]) == 0.0
    assert float(by["rpc"]["final_train_loss"]) == pytest.approx(float(by["tcp"]["final_train_loss"]), abs=1e-5)

    header = "| W (params) | mode | N | PyTorch RPC | psgd tcp | tcp / best peer |"
    assert header in r.stdout and "| 16 (1,098) | sync | 2 |" in r.stdout
    assert (out / "peers.png").stat().st_size > 0 and "psgd bench peers" in (out / "command.txt").read_text()
    assert processes_mentioning(str(tmp_path)) == []


def test_table_ratios_against_the_best_peer():
    def row(system, ups, rnd=1, status="ok"):
        return {"round": rnd, "width": 256, "params": 78858, "mode": "async", "workers": 1, "system": system,
                "status": status, "updates_per_s": ups, "final_train_loss": 2.0, "param_diff": None, "startup_s": 1.0}

    rows = [row("rpc", 100.0), row("rpc", 120.0, 2), row("ray", None, status="skipped: why"),
            row("grpc", 55.0), row("grpc", 65.0, 2), row("tcp", 220.0), row("tcp", 220.0, 2)]
    systems = ["rpc", "ray", "grpc", "tcp"]
    (e,) = peers.aggregate(rows, systems)
    assert e["rpc"] == 110.0 and e["ray"] == "skipped: why" and e["best_peer"] == 110.0
    assert e["grpc_ratio"] == pytest.approx(60 / 110) and e["tcp_ratio"] == pytest.approx(2.0)
    table = peers.format_table([e], systems)
    assert "| 256 (78,858) | async | 1 | 110.0 | skipped | 60.0 | 220.0 | 0.55 | 2.00 |" in table


def test_usage_errors():
    for bad in (["--configs", "sync4"], ["--transports", "udp"], ["--peers", "mpi"], ["--steps", "5,5,5"],
                ["--rounds", "0"]):
        r = psgd_main("bench", "peers", *bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)


def test_ray_is_skipped_with_a_reason_where_it_cannot_run_isolated(monkeypatch):
    """Ray runs only in a network namespace of its own (it contacts outside addresses on start)."""
    monkeypatch.setattr(ray_peer.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in ray_peer.skip_reason()
    monkeypatch.setattr(ray_peer.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(ray_peer.shutil, "which", lambda name: None)
    assert "private network namespace" in ray_peer.skip_reason()
