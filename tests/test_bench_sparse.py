"""`psgd bench sparse` (psgd/bench/sparse.py) runs and writes well-formed figures; the accounting holds."""

import json

import pytest

from .helpers import psgd_main


def test_bench_sparse_writes_its_figures(tmp_path):
    out = tmp_path / "bs"
    r = psgd_main("bench", "sparse", "--num-samples", "2000", "--workers", "1,4", "--steps", "12", "--repeats", "1",
                  "--width", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = json.loads((out / "sparse.json").read_text())
    b = got["bytes"]
    # By construction: the payload is the touched rows and their ids, nothing more (the bound: 1.1).
    assert b["payload_over_touched_rows"] == 1.0
    assert b["sparse_pull_bytes_per_step"] == b["sparse_push_bytes_per_step"] < b["dense_path_bytes_per_step"]
    assert b["params"] == b["table_params"] + b["dense_params"]
    assert [s["workers"] for s in got["staleness"]] == [1, 4]
    one, four = got["staleness"]
    assert one["row_max"] == 0 and four["global_mean"] == 3 and four["row_mean"] <= 3
    assert set(got["load"]) == {"hash", "range"}
    assert sum(got["load"]["hash"]["lookups"]) == sum(got["load"]["range"]["lookups"]) == 12 * 32 * 8
    rates = ("sparse_samples_per_s", "plain_samples_per_s", "plain_sparse_samples_per_s", "floor_samples_per_s")
    assert min(got["speed"][k] for k in rates) > 0
    assert (out / "command.txt").read_text().startswith("psgd bench sparse ")
    assert "global staleness 3.00" in r.stdout


def test_bench_sparse_refuses_bad_flags_in_one_line():
    r = psgd_main("bench", "sparse", "--shards", "0")
    assert r.returncode == 2 and "--shards" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_row_paths_floor_trains_what_the_plain_loop_trains():
    """The floor (one dedup, one gather, one index_add_ a step) is the plain loop's arithmetic with the
    tables fused and stepped by row: the same loss after 20 steps, to rounding (a row's lookups are
    summed in another order)."""
    from psgd.bench import sparse
    from psgd.core.config import DataConfig
    from psgd.train import data

    args = sparse.parser().parse_args(["--num-samples", "2000", "--steps", "20", "--width", "4"])
    ds = data.load(DataConfig(dataset=args.dataset, num_samples=args.num_samples))
    plain, floor = sparse._plain_loop(args, ds), sparse._floor_loop(args, ds)
    assert floor == pytest.approx(plain, rel=1e-5) and floor != sparse._plain_loop(
        sparse.parser().parse_args(["--num-samples", "2000", "--steps", "19", "--width", "4"]), ds)
