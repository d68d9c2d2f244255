"""`psgd bench allreduce`: runs, checks its sums, reports nccl-tests' algbw / busbw; bad flags exit 2."""

import json
import re

import pytest

from psgd.bench import allreduce as bench
from psgd.cli import main
from tests.helpers import ENV, processes_mentioning, psgd_main

# Both bench files check that no `psgd-bench-` process is left: under pytest-xdist they run on
# one worker, one after the other, so that neither sees the other's live processes.
pytestmark = pytest.mark.xdist_group("bench")


def test_bench_measures_both_implementations_as_json(tmp_path, monkeypatch):
    for name, value in ENV.items():  # what tests/helpers.py `psgd` gives its process; the ranks inherit it
        monkeypatch.setenv(name, value)
    saved = tmp_path / "deep" / "allreduce.json"
    argv = ["--size-mb", "0.01,0.1", "--workers", "3", "--impl", "library,ring", "--iters", "2", "--json",
            "--out", str(saved)]
    r = psgd_main("bench", "allreduce", *argv)  # in this process; its ranks are processes of their own
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert json.loads(saved.read_text()) == {**out, "command": "psgd bench allreduce " + " ".join(argv)}
    rows = out["rows"]
    assert {(x["impl"], x["workers"], x["size_mb"]) for x in rows} == {
        (i, 3, s) for i in ("library", "ring") for s in (0.01, 0.1)}
    for x in rows:
        assert x["correct"] and x["backend"] == "gloo" and x["time_ms"] > 0
        assert x["bytes"] == int(x["size_mb"] * 2**20) // 4 * 4
        assert x["algbw_GBps"] == pytest.approx(x["bytes"] / (x["time_ms"] / 1e3) / 1e9)
        assert x["busbw_GBps"] == pytest.approx(x["algbw_GBps"] * 2 * (x["workers"] - 1) / x["workers"])
        # Ring traffic per rank: 2(N-1)/N x size, to within a rounding element per chunk.
        textbook = 2 * (x["workers"] - 1) * x["bytes"] / x["workers"]
        assert abs(x["sent_bytes_per_rank"] - textbook) <= 2 * x["workers"] * 4
    assert len(out["ratios"]) == 2 and all(q["ring_over_library"] > 0 for q in out["ratios"])
    assert processes_mentioning("psgd-bench-") == []


def test_table_has_a_row_per_point_and_the_ratios():
    rows = [dict(impl=i, workers=2, backend="gloo", size_mb=100.0, bytes=100 * 2**20, time_ms=t,
                 algbw_GBps=100 * 2**20 / t / 1e6, busbw_GBps=100 * 2**20 / t / 1e6, sent_bytes_per_rank=100 * 2**20,
                 sent_estimated=i == "library", correct=True) for i, t in (("library", 80.0), ("ring", 240.0))]
    table = bench.format_table(rows, iters=5)
    assert "busbw = algbw x 2(N-1)/N" in table
    assert "ring / library time, N=2, 100 MiB: 3.00x" in table
    assert len([ln for ln in table.splitlines() if re.match(r"(library|ring)\s+2\s+100\s", ln)]) == 2
    assert bench.bus_bandwidth(1.0, 4) == 1.5


def test_out_writes_the_json_while_the_table_is_printed(monkeypatch, tmp_path, capsys):
    rows = [dict(impl="ring", workers=2, backend="gloo", size_mb=1.0, bytes=2**20, time_ms=2.0, algbw_GBps=0.5,
                 busbw_GBps=0.5, sent_bytes_per_rank=2**20, sent_estimated=False, correct=True)]
    monkeypatch.setattr(bench, "run_group", lambda n, a: rows)  # the measuring is the test above's
    saved = tmp_path / "allreduce.json"
    assert main(["bench", "allreduce", "--workers", "2", "--impl", "ring", "--out", str(saved)]) == 0
    assert capsys.readouterr().out == bench.format_table(rows, iters=5) + "\n"
    assert json.loads(saved.read_text()) == {"benchmark": "allreduce", "rows": rows, "ratios": [],
                                             "command": f"psgd bench allreduce --workers 2 --impl ring --out {saved}"}


@pytest.mark.parametrize("argv,message", [
    (["--workers", "1"], "--workers needs group sizes >= 2"),
    (["--impl", "library,nope"], "--impl must be"),
    (["--size-mb", "0"], "--size-mb must be > 0"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--backend", "nccl"], "--backend nccl needs one CUDA device per rank"),
    (["--out", "."], "--out wants a file, '.' is a folder"),
])
def test_bad_flags_are_one_line_exit_2(capsys, argv, message):
    assert main(["bench", "allreduce", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_unparsable_list_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "allreduce", "--size-mb", "ten"])
    assert e.value.code == 2 and "comma-separated" in capsys.readouterr().err
