"""The alpha-beta cost model against its formulas, written out by hand."""

import csv
import dataclasses

import pytest

from psgd.core import costmodel as cm

M = cm.Machine(alpha_s=1e-3, beta_s_per_byte=1e-9, ring_alpha_s=2e-3, ring_beta_s_per_byte=2e-9,
               apply_s_per_byte=0.5e-9, cores=0)
W = cm.Workload(params=1_000_000, wire_bytes=4, batch=10, compute_s_fixed=0.01, compute_s_per_sample=0.002)
S = 4e6  # bytes


def test_ring_is_patarasuk_yuan():
    for n in (2, 4, 64):
        st = cm.step_time("ring", n, 1, M, W)
        assert st.comm_s == pytest.approx(2 * (n - 1) * 2e-3 + 2 * (n - 1) / n * S * 2e-9)
        far = cm.step_time("ring", n, 1, dataclasses.replace(M, latency_s=1e-4), W)
        assert far.comm_s == pytest.approx(st.comm_s + 2 * (n - 1) * 1e-4)
        assert st.compute_s == pytest.approx(0.03)
        assert st.apply_s == pytest.approx(S * 0.5e-9)
        assert st.total_s == pytest.approx(st.compute_s + st.comm_s + st.apply_s)
        assert st.samples_per_s == pytest.approx(n * 10 / st.total_s)
    assert cm.step_time("ring", 1, 1, M, W).comm_s == 0


def test_ps_busiest_shard_moves_2_n_size_over_k():
    for n, k in ((8, 1), (8, 2), (8, 8), (4, 16)):
        st = cm.step_time("sync", n, k, M, W)
        one_way = max(k, n) * 1e-3 + max(S, n * S / k) * 1e-9
        assert st.comm_s == pytest.approx(2 * one_way)
        assert st.apply_s == pytest.approx(S / k * 0.5e-9)
        assert st.busiest_bytes == pytest.approx(max(2 * S, 2 * n * S / k))


def test_sharding_helps_until_the_worker_link_is_the_bottleneck():
    one, eight, many = (cm.step_time("sync", 8, k, M, W).comm_s for k in (1, 8, 64))
    assert one > eight
    # K >= N: each worker's own link moves S each way; more shards only add messages.
    assert many - eight == pytest.approx(2 * (64 - 8) * 1e-3)


def test_stragglers_hit_sync_by_the_expected_maximum_and_async_by_the_mean():
    w = dataclasses.replace(W, jitter_s=0.1)
    sync = cm.step_time("sync", 8, 8, M, w)
    assert sync.compute_s == pytest.approx(0.03 + 0.1 * sum(1 / i for i in range(1, 9)))
    assert cm.step_time("async", 8, 8, M, w).compute_s == pytest.approx(0.03 + 0.1)
    assert cm.step_time("ring", 8, 1, M, w).compute_s == pytest.approx(sync.compute_s)


def test_async_is_capped_by_the_busiest_shard():
    w = dataclasses.replace(W, compute_s_fixed=0.0, compute_s_per_sample=0.0)
    st = cm.step_time("async", 1000, 1, M, w)
    assert st.samples_per_s == pytest.approx(10 / (S * (1e-9 + 0.5e-9)))


def test_one_host_shares_the_copy_bandwidth_and_the_cores():
    host = dataclasses.replace(M, cores=2)
    st = cm.step_time("sync", 4, 2, host, W)
    assert st.compute_s == pytest.approx(0.03 * 2)  # 4 workers on 2 cores
    assert st.comm_s == pytest.approx(2 * (4 * 1e-3 + 4 * S * 1e-9))  # all pushes through one memory system
    ring = cm.step_time("ring", 4, 1, host, W)
    assert ring.comm_s == pytest.approx(6 * 2e-3 + 2 * 3 * S * 2e-9)


def test_the_slower_of_wire_and_software_wins():
    fast_wire = cm.at_bandwidth(M, 400e9, 5e-6)
    assert fast_wire.beta_s_per_byte == 1e-9 and fast_wire.latency_s == 5e-6 and fast_wire.alpha_s == 1e-3
    slow_wire = cm.at_bandwidth(M, 1e9, 0.0)
    assert slow_wire.beta_s_per_byte == pytest.approx(8e-9) and slow_wire.cores == 0


def test_predict_and_validate():
    rows = cm.predict(M, W, [("10gbit", 10e9, 5e-6)], [8, 16], ["1", "N"])
    assert {(r["mode"], r["workers"], r["shards"]) for r in rows} == {
        ("ring", 8, 0), ("sync", 8, 1), ("sync", 8, 8), ("ring", 16, 0), ("sync", 16, 1), ("sync", 16, 16)}
    true = cm.step_time("sync", 2, 1, M, W).total_s
    checked = cm.validate([{"mode": "sync", "workers": 2, "shards": 1, "batch": 10, "step_s": true * 1.1},
                           {"mode": "ring", "workers": 2, "shards": 0, "batch": 10, "step_s": 100.0}], M, W)
    assert checked[0]["within"] and checked[0]["error"] == pytest.approx(1 / 1.1 - 1)
    assert not checked[1]["within"]


def test_parse_workers_and_bad_input():
    assert cm.parse_workers("8..1024") == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert cm.parse_workers("1,2,4") == [1, 2, 4]
    with pytest.raises(ValueError):
        cm.parse_workers("8..4")
    with pytest.raises(ValueError):
        cm.step_time("bogus", 2, 1, M, W)


def _model(tmp_path, *args: str):
    from tests.helpers import psgd_main

    # --calibration "": the built-in machine, whose software moves 1 GB/s, so 10gbit and faster
    # links are software-bound and 1gbit is not.
    r = psgd_main("model", "--calibration", "", "--workers", "8..32", "--out", str(tmp_path), *args)
    assert r.returncode == 0, r.stderr
    titles = [line for line in r.stdout.splitlines() if line.endswith("samples/s")]
    return r.stdout, titles, list(csv.DictReader(open(tmp_path / "model.csv")))


def test_model_prints_each_distinct_table_once_and_keeps_every_csv_row(tmp_path):
    out, titles, rows = _model(tmp_path, "--bandwidth", "1gbit,10gbit,100gbit,400gbit")
    assert titles == ["1gbit: samples/s", "10gbit = 100gbit = 400gbit (software-bound): samples/s"]
    assert len(rows) == 4 * 3 * 4  # bandwidths x N x (ring, K=1, K=8, K=N), as before
    by_bw = {bw: [r["samples_per_s"] for r in rows if r["bandwidth"] == bw] for bw in ("1gbit", "10gbit", "400gbit")}
    assert by_bw["10gbit"] == by_bw["400gbit"] != by_bw["1gbit"]  # the shared title tells the truth
    assert len([line for line in out.splitlines() if line.lstrip().startswith(("8 ", "16 ", "32 "))]) == 2 * 3
    assert "note: at 10gbit, 100gbit, 400gbit the wire outruns the software" in out


def test_model_shares_a_table_only_between_neighbours_with_equal_predictions(tmp_path):
    _, titles, _ = _model(tmp_path, "--bandwidth", "10gbit,1gbit,100gbit")
    assert titles == ["10gbit: samples/s", "1gbit: samples/s", "100gbit: samples/s"]
    _, titles, rows = _model(tmp_path, "--bandwidth", "10gbit,100gbit,400gbit", "--no-software-bound")
    assert titles == ["10gbit: samples/s", "100gbit: samples/s", "400gbit: samples/s"]
    assert len(rows) == 3 * 3 * 4


def test_model_jitter_is_in_ms_as_psgd_run_and_keeps_its_old_name(tmp_path):
    from tests.helpers import psgd_main

    _, _, still = _model(tmp_path / "still", "--bandwidth", "1gbit")
    _, _, new = _model(tmp_path / "new", "--bandwidth", "1gbit", "--jitter", "50")
    _, _, old = _model(tmp_path / "old", "--bandwidth", "1gbit", "--jitter-ms", "50")
    assert new == old != still
    work = cm.Workload()  # the built-in one _model predicts with
    ring8 = next(r for r in new if r["mode"] == "ring" and r["workers"] == "8")
    assert float(ring8["compute_s"]) == pytest.approx(work.compute_s + 0.050 * cm.harmonic(8))
    assert "(old name of --jitter)" in psgd_main("model", "-h").stdout
    r = psgd_main("model", "--calibration", "", "--out", str(tmp_path), "--jitter", "-1")
    assert r.returncode == 2 and "--jitter must be >= 0" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_validate_csv_that_is_missing_or_not_a_sweeps_is_one_line_and_writes_nothing(tmp_path):
    from tests.helpers import psgd_main

    bad = tmp_path / "bad.csv"
    bad.write_text("mode,workers,shards,batch,step_s\nsync,two,1,32,0.1\n")
    for path, says in ((tmp_path / "missing.csv", "No such file or directory"), (bad, "not a scaling sweep's CSV")):
        out = tmp_path / f"out-{path.stem}"
        r = psgd_main("model", "--calibration", "", "--validate", str(path), "--out", str(out))
        # (the line before it says the built-in calibration is used, as on every call without one)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        last = r.stderr.splitlines()[-1]
        assert last.startswith("psgd model: error: --validate") and says in last
        assert not out.exists()


def test_the_model_figure_shows_coinciding_bandwidths_and_tells_k8_from_kn(tmp_path):
    """Issue 54, item 6: model.png hid the 100 Gbit lines under the 400 Gbit ones (software-bound: the
    same numbers) and drew K=8 and K=N both dotted."""
    from psgd.bench.costmodel_cli import plot

    rows = [dict(bandwidth=bw, mode=mode, shards_label=k, workers=n, samples_per_s=1000.0 * n ** 0.5)
            for bw in ("10gbit", "100gbit", "400gbit") for mode, k in (("ring", "-"), ("sync", "1"), ("sync", "8"),
                                                                       ("sync", "N")) for n in (8, 16, 32)]
    lines = {ln.get_label(): ln for ln in plot(rows, tmp_path / "model.png", "t").axes[0].get_lines()}
    slow, fast = lines["100gbit: PS sync, K=8"], lines["400gbit: PS sync, K=8"]
    assert list(slow.get_ydata()) == list(fast.get_ydata())          # they coincide, and both show:
    assert fast.get_zorder() > slow.get_zorder() and fast.get_linewidth() < slow.get_linewidth()
    assert fast.get_marker() != slow.get_marker() and fast.get_markersize() < slow.get_markersize()
    assert lines["10gbit: PS sync, K=8"].get_linestyle() != lines["10gbit: PS sync, K=N"].get_linestyle()
