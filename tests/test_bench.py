"""Benchmarks run at tiny sizes and write well-formed output (speed itself is never asserted).

The commands run in this process (psgd.cli.main): the shard servers and runs they start are real
processes, the command's own interpreter start-up is left out (test_run.py covers `python -m psgd`)."""

import argparse
import csv
import json

import pytest
import torch

from psgd.bench import scaling, transport
from tests.helpers import processes_mentioning, psgd_main

# Both bench files check that no `psgd-bench-` process is left: under pytest-xdist they run on
# one worker, one after the other, so that neither sees the other's live processes.
pytestmark = pytest.mark.xdist_group("bench")


@pytest.mark.usefixtures("warm_benches")  # the shard servers fork from the warm parent
def test_transport_json(tmp_path):
    out = tmp_path / "transport.json"
    r = psgd_main("bench", "transport", "--size-mb", "0.5", "--shards", "2", "--repeat", "1",
                  "--small-params", "1000", "--small-repeat", "3", "--json", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result == json.loads(out.read_text())
    assert result["bytes"] == 512 * 1024 and result["raw_socket"]["gbps"] > 0
    assert [(row["transport"], row["shards"]) for row in result["psgd"]] == [
        ("grpc", 2), ("tcp", 2)]
    for row in result["psgd"]:
        assert {"push_ratio", "pull_ratio", "push_net_ratio", "apply_s", "push_gbps", "pull_gbps"} <= set(row)
        assert row["push_s"] > 0 and row["pull_s"] > 0 and row["apply_s"] >= 0 and row["device"] == "cpu"
    assert result["grpc_bare"]["push_ratio"] > 0
    assert [s["transport"] for s in result["small"]] == ["grpc", "tcp"]
    for small in result["small"]:
        assert small["ratio"] == pytest.approx(small["exchange_s"] / small["unary_rtt_s"])
        assert small["combined_ratio"] == pytest.approx(small["combined_s"] / small["unary_rtt_s"])
    assert processes_mentioning("psgd-bench-") == [] and processes_mentioning("serve_bare") == []
    table = transport.format_table(result)
    assert "raw TCP socket" in table and "bare gRPC" in table and "small, tcp: exchange" in table


def test_transport_usage_errors():
    no_gpu = [] if torch.cuda.is_available() else [["--device", "cuda"]]
    for bad in (["--shards", "0"], ["--size-mb", "-1"], ["--transports", "udp"], ["--device", "gpu"],
                ["--device", "auto"], *no_gpu):
        r = psgd_main("bench", "transport", *bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.usefixtures("warm_runs", "warm_benches")  # scaling's runs and calibrate's shards: warm parent's
def test_calibrate_then_model_then_scaling_with_validation(tmp_path):
    cal = tmp_path / "calibration.json"
    r = psgd_main("bench", "calibrate", "--sizes-mb", "0.25,0.5", "--repeat", "1", "--width", "16", "--no-ring",
                  "--out", str(cal))
    assert r.returncode == 0, r.stderr
    c = json.loads(cal.read_text())
    assert c["machine"]["cores"] >= 1 and c["machine"]["beta_s_per_byte"] != 0
    assert c["workload"]["params"] > 0 and c["model"]["width"] == 16 and c["command"].startswith("psgd bench")

    model_out = tmp_path / "model"
    r = psgd_main("model", "--calibration", str(cal), "--workers", "8..32", "--bandwidth", "10gbit,100gbit",
                  "--out", str(model_out))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(model_out / "model.csv")))
    assert len(rows) == 2 * 3 * 4  # bandwidths x N x (ring, K=1, K=8, K=N)
    assert (model_out / "model.png").stat().st_size > 0 and "psgd model" in (model_out / "command.txt").read_text()

    out = tmp_path / "scaling"
    r = psgd_main("bench", "scaling", "--width", "16", "--workers", "1,2", "--shards", "1", "--steps", "3",
                  "--no-include-ring", "--calibration", str(cal), "--out", str(out), "--runs", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(out / "scaling.csv")))
    assert [(r["mode"], r["workers"], r["shards"], r["status"]) for r in rows] == [
        ("sync", "1", "1", "ok"), ("sync", "2", "1", "ok")]
    for row in rows:
        assert float(row["step_s"]) > 0 and float(row["busiest_bytes"]) > 0
        assert float(row["compute_s"]) >= 0 and float(row["comm_s"]) > 0 and float(row["wait_s"]) >= 0
    assert (out / "scaling.png").stat().st_size > 0 and "psgd bench scaling" in (out / "command.txt").read_text()
    assert len(list(csv.DictReader(open(out / "validation.csv")))) == 2 and "within 25%" in r.stdout

    r = psgd_main("model", "--calibration", str(cal), "--validate", str(out / "scaling.csv"), "--out", str(model_out))
    assert r.returncode == 0 and "within 25%" in r.stdout, r.stderr
    assert processes_mentioning(str(tmp_path)) == []


def test_ring_rows_say_why_they_are_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(scaling, "ring_available", lambda: False)
    args = scaling.argparse.Namespace(workers=[1, 2], shards=[1], steps=3, batch_size=8, width=8,
                                      include_ring=True, overlap=True)
    todo = scaling.configs(args, tmp_path)
    skipped = [t for t in todo if isinstance(t, dict)]
    assert len(skipped) == 1 and skipped[0]["workers"] == 2 and "skipped" in skipped[0]["status"]
    runs = [t for t in todo if not isinstance(t, dict)]
    assert [(c.workers, c.overlap) for c in runs] == [(1, False), (1, True), (2, False), (2, True)]


def test_bench_help_lists_every_benchmark_with_a_line_each():
    from psgd.bench import NAMES

    r = psgd_main("bench", "-h")
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("  ")}
    assert set(lines) == set(NAMES) == {"transport", "allreduce", "scaling", "calibrate", "peers", "cluster",
                                         "startup", "utilisation", "transformer", "scale",
                                         "roundtrip"} | ({"drill", "sparse", "sim", "sim-vs-real"} & set(NAMES))
    assert all(len(line.split()) > 4 for line in lines.values())   # a name and what it measures
    for name in NAMES:   # ... and each one really is a benchmark with its own help
        assert psgd_main("bench", name, "-h").returncode == 0
    r = psgd_main("bench")
    assert r.returncode == 2 and "(see psgd bench -h)" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cluster_bench_names_its_clusters_and_predicts_the_higher_floor():
    """psgd bench cluster's pure parts (and psgd/bench/shaped.py's): a cluster name per rate, and the
    model's step on the cluster as the higher of its two floors: the wire (cluster form) and the
    shared cores (one-host form)."""
    from psgd.bench import cluster, shaped
    from psgd.core import costmodel as cm

    assert [shaped.cluster_name("bc", r) for r in ("1gbit", "2.5gbit", "veth")] == ["bc1gbit", "bc2p5gbit", "bcveth"]
    with pytest.raises(ValueError, match="not a cluster name"):
        shaped.cluster_name("b-c", "1gbit")
    across = {"machine": {"alpha_s": 1e-4, "beta_s_per_byte": 8e-9, "apply_s_per_byte": 1e-10}}   # a 1 Gbit/s link
    host = {"machine": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "apply_s_per_byte": 1e-10, "cores": 2,
                        "ring_alpha_s": 2e-4, "ring_beta_s_per_byte": 1e-9}}
    ms = shaped.machines(across, host, 200e-6, 1e9)
    assert ms["ring"].latency_s == 0 and ms["ps"].latency_s == 200e-6 and ms["ring"].ring_beta_s_per_byte == 8e-9
    burst = shaped.machines({"machine": dict(across["machine"], beta_s_per_byte=6e-9)}, host, 0.0, 1e9)
    assert burst["ps"].beta_s_per_byte == 8e-9   # a fit faster than the link's own stream saw tbf's burst
    from psgd.cluster import plan

    sizes = {r: shaped.calibration_sizes(argparse.Namespace(sizes_mb="auto"), plan.describe("x", 2, r))
             for r in ("1gbit", "10gbit")}
    assert sizes == {"1gbit": "2,8", "10gbit": "10,40"}   # 10gbit's bucket: 2.5 MB
    work = cm.Workload(params=2_000_000, batch=32, compute_s_fixed=0.01, compute_s_per_sample=0.0)
    row = {"mode": "sync", "workers": 4, "shards": 1, "params": 2_000_000, "batch": 32, "experiment": "E4",
           "where": "kernel"}
    p = cluster.predict(row, ms, work, 30)
    assert p["bound"] == "wire" and p["predicted_s"] == p["predicted_wire_s"] > p["predicted_cpu_s"]
    # 4 workers push 8 MB each through the shard's 1 Gbit/s link, and pull as much: 2 x 4 x 64 ms.
    assert p["predicted_wire_s"] == pytest.approx(0.01 + 2 * 4 * 8e6 * 8e-9, rel=0.02)
    fast = shaped.machines({"machine": dict(across["machine"], beta_s_per_byte=1e-11)}, host, 0.0, 1e12)
    assert cluster.predict(dict(row, mode="ring", shards=0), fast, work, 30)["bound"] == "CPU"
    e10 = cluster.predict(dict(row, experiment="E10"), ms, work, 30)
    assert e10["predicted_wire_s"] == pytest.approx(p["predicted_wire_s"] + 0.030)   # a sleep: added, not shared
    assert set(cluster.predict(dict(row, where="loopback"), ms, work, 30)) == {"predicted_cpu_s", "predicted_s",
                                                                             "bound"}


def test_startup_measures_warm_and_cold_beside_the_import(tmp_path):
    r = psgd_main("bench", "startup", "--shapes", "1+1", "--rounds", "1", "--dataset", "synthetic", "--out",
                  str(tmp_path))
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "startup.json").read_text())
    (row,) = result["rows"]
    assert (row["shards"], row["workers"]) == (1, 1) and row["warm_s"] > 0 and row["cold_s"] > 0
    assert row["cold_over_warm"] == pytest.approx(row["cold_s"] / row["warm_s"]) and result["import_s"] > 0
    assert "| 1+1 |" in (tmp_path / "STARTUP.md").read_text()
    assert psgd_main("bench", "startup", "--shapes", "2x2").returncode == 2


@pytest.mark.usefixtures("warm_benches")  # the runs are launched here, their processes forked from the warm parent
def test_scale_reports_each_process_kind_and_the_model_beside_each_run(tmp_path):
    r = psgd_main("bench", "scale", "--workers", "2", "--modes", "sync,ssp", "--steps", "4", "--baseline", "0",
                  "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "out" / "scale.csv")))
    assert [(x["mode"], x["workers"], x["processes"]) for x in rows] == [("sync", "2", "4"), ("ssp", "2", "4")]
    for x in rows:  # both shards and both workers were seen, each with a peak above an empty interpreter's
        assert float(x["shard_peak_mib"]) > 10 and float(x["worker_peak_mib"]) > 10
        assert float(x["samples_per_s"]) > 0 and float(x["model_samples_per_s"]) > 0
        assert float(x["staleness_max"]) == 0 or x["mode"] == "ssp"
    assert "| sync | 2 | 4 |" in (tmp_path / "out" / "scale.md").read_text()
    assert (tmp_path / "out" / "scale.png").stat().st_size > 0
    assert psgd_main("bench", "scale", "--modes", "bsp").returncode == 2


@pytest.mark.usefixtures("warm_benches")  # the ps arm's runs: launched here, forked from the warm parent
def test_roundtrip_states_each_rounds_ratio_against_its_ceiling(tmp_path):
    r = psgd_main("bench", "roundtrip", "--workloads", "mlp16", "--rounds", "2", "--steps", "12", "--skip", "2",
                  "--arms", "plain,ps", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "out" / "roundtrip.csv")))
    assert [(x["round"], x["arm"]) for x in rows] == [("0", "plain"), ("0", "ps"), ("1", "ps"), ("1", "plain")]
    assert all(float(x["samples_per_s"]) > 0 for x in rows)
    line = next(x for x in (tmp_path / "out" / "roundtrip.md").read_text().splitlines() if "ps / plain" in x)
    assert line.count("x,") == 1 and "**" in line  # two rounds' ratios, then their median
    assert psgd_main("bench", "roundtrip", "--workloads", "vgg").returncode == 2


@pytest.mark.usefixtures("warm_benches")
def test_roundtrip_times_async_n1_on_the_recommender_by_row_against_the_sparse_plain_loop(tmp_path):
    """Issue 56's bound: async N=1 on dlrm against the plain loop of the same model, in the same run;
    its tables whole or by row, at each size; here by row against torch's sparse-gradient loop."""
    from psgd.bench import roundtrip

    big = roundtrip.workload("dlrm-large-rows", 10)
    assert (big.data.dataset, big.model.model, big.embeddings, big.batch_size) == ("clicks-large", "dlrm", "rows", 32)
    assert roundtrip.workload("dlrm", 10).embeddings == "dense"
    assert roundtrip.workload("dlrm-medium", 10).data.dataset == "clicks-medium"
    for bad in ("dlrm-huge", "dlrm-rows-large", "dlrmx"):
        with pytest.raises(ValueError, match="dlrm"):
            roundtrip.workload(bad, 10)
    r = psgd_main("bench", "roundtrip", "--workloads", "dlrm-rows", "--rounds", "1", "--steps", "6", "--skip", "2",
                  "--arms", "plain-sparse,shm", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "out" / "roundtrip.csv")))
    assert [x["arm"] for x in rows] == ["plain-sparse", "shm"]
    assert all(float(x["samples_per_s"]) > 0 for x in rows)
    assert "| dlrm-rows | shm / plain-sparse |" in (tmp_path / "out" / "roundtrip.md").read_text()
    refused = psgd_main("bench", "roundtrip", "--workloads", "mlp16", "--steps", "10", "--arms", "plain-sparse")
    assert refused.returncode == 2 and "only with the dlrm workloads" in refused.stderr
    assert [roundtrip.default_steps(n) for n in ("dlrm", "dlrm-rows", "dlrm-large-rows", "mlp256", "gpt")] == \
        [300, 300, 100, 300, 100]
    refused = psgd_main("bench", "roundtrip", "--workloads", "dlrm,dlrm-rows", "--steps", "1,2,3")
    assert refused.returncode == 2 and "3 step counts for 2 workloads" in refused.stderr
    assert json.loads((tmp_path / "runs" / "dlrm-rows-shm-0" / "config.json").read_text())["embeddings"] == "rows"


def test_the_plain_sparse_arm_steps_the_tables_by_row_and_ends_where_the_dense_loop_does(tmp_path):
    """`plain-sparse` is the plain loop with sparse table gradients: torch's SGD steps only the touched
    rows, which is the dense step's arithmetic up to the order of a row's sums."""
    from psgd.bench import roundtrip
    from psgd.bench import transformer as tb

    cfg = tb.arm_config(roundtrip.workload("dlrm", 12), "plain-sparse", tmp_path / "p")
    dense, sparse = tb.torch_loop(cfg, 0), tb.torch_loop(cfg, 0, sparse_tables=True)
    assert (dense["sparse_tables"], sparse["sparse_tables"]) == (0, 8)  # clicks: 8 fields, a table each
    assert sparse["final_train_loss"] == pytest.approx(dense["final_train_loss"], rel=1e-5)


def test_the_floor_arm_computes_what_the_plain_loop_does_with_its_update_in_a_second_process(tmp_path):
    """The floor (psgd/bench/floor.py) moves only the optimizer's step into a forked server: its
    loss is the plain loop's, bit for bit."""
    from psgd.bench import floor, roundtrip
    from psgd.bench import transformer as tb

    cfg = tb.arm_config(roundtrip.workload("mlp16", 12), "floor", tmp_path / "floor")
    plain = tb.torch_loop(cfg, 0)
    for wait in ("block", "spin"):  # the server sleeps in recv, or both processes spin on a counter
        low = floor.floor_loop(cfg, tb.make_optimizer, wait)
        assert low["final_train_loss"] == plain["final_train_loss"], wait
        assert len(low["ends"]) == 12 and low["ends"] == sorted(low["ends"])
    with pytest.raises(ValueError, match="block or spin"):
        floor.floor_loop(cfg, tb.make_optimizer, "poll")


def test_the_row_floor_trains_what_the_plain_loop_does_with_its_tables_on_a_second_process(tmp_path):
    """The row floor (psgd/bench/rowfloor.py) keeps the tables on a forked server and moves each step's
    distinct rows and their summed gradients on one round trip: it ends where the plain loop ends (the
    order of a row's sums aside), at either wait, and refuses what it cannot floor."""
    import dataclasses

    from psgd.bench import roundtrip, rowfloor
    from psgd.bench import transformer as tb
    from psgd.core.config import OptimConfig

    cfg = tb.arm_config(roundtrip.workload("dlrm", 12), "floor-rows", tmp_path / "rows")
    plain = tb.torch_loop(cfg, 0)
    for wait in ("block", "spin"):
        low = rowfloor.row_floor_loop(cfg, tb.make_optimizer, wait)
        assert low["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=1e-6), wait
        assert len(low["ends"]) == 12 and low["ends"] == sorted(low["ends"])
    momentum = dataclasses.replace(cfg, optim=OptimConfig(optimizer="sgd", lr=0.05, momentum=0.9))
    with pytest.raises(ValueError, match="plain SGD"):
        rowfloor.row_floor_loop(momentum, tb.make_optimizer)
    with pytest.raises(ValueError, match="row_ids"):
        rowfloor.row_floor_loop(tb.arm_config(roundtrip.workload("mlp16", 4), "floor-rows", tmp_path / "m"),
                                tb.make_optimizer)
    refused = psgd_main("bench", "roundtrip", "--workloads", "mlp16", "--steps", "10", "--arms", "floor-rows")
    assert refused.returncode == 2 and "floor-rows: only with the dlrm workloads" in refused.stderr


def test_the_cluster_figure_keeps_its_title_and_tells_the_two_servers_apart(tmp_path):
    """Issue 54, item 6: E4's cluster.png cut its title at both edges (one rate: a 4.6-inch figure) and
    drew the 1-shard and the 2-shard PS in one colour and marker."""
    from psgd.bench import cluster

    rows = [dict(status="ok", rate="1gbit", experiment="E4", config=c, where=w, workers=n, samples_per_s=100.0 * n,
                 global_batch=32 * n, predicted_s=0.3, busiest_bytes=1e7 * n, utilisation=0.5)
            for c in ("ps", "ps2", "ring", "gloo") for w in ("kernel", "pacer") for n in (1, 2, 4)]
    fig = cluster.plot(rows, argparse.Namespace(rates=["1gbit"], workers=[1, 2, 4], width=1024), tmp_path / "c.png")
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    one, two = lines["PS, 1 shard, kernel"], lines["PS, 2 shards, kernel"]
    assert one.get_color() != two.get_color() and one.get_marker() != two.get_marker()
    title = fig._suptitle
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    box = title.get_window_extent(FigureCanvasAgg(fig).get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (box, fig.bbox)
    assert "2 CPU cores shared by every host" in title.get_text().replace("\n", " ")
