"""`psgd bench sparse` (psgd/bench/sparse.py) runs and writes well-formed figures; the accounting holds."""

import json

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
    rates = ("sparse_samples_per_s", "plain_samples_per_s", "plain_sparse_samples_per_s")
    assert min(got["speed"][k] for k in rates) > 0
    assert (out / "command.txt").read_text().startswith("psgd bench sparse ")
    assert "global staleness 3.00" in r.stdout


def test_bench_sparse_refuses_bad_flags_in_one_line():
    r = psgd_main("bench", "sparse", "--shards", "0")
    assert r.returncode == 2 and "--shards" in r.stderr and len(r.stderr.strip().splitlines()) == 1
