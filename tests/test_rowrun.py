"""`psgd run --embeddings rows | hybrid` (psgd/train/rowexchange.py, rowshard.py, rowfinish.py): real runs
with the tables served by row beside the dense shards.

- sync with rows gives the dense path's parameters bit for bit (the same run with --embeddings
  dense: every table pulled and pushed whole), and every row gradient is fresh;
- two async workers train dlrm on clicks above the majority class, per-row staleness below the
  global one;
- hybrid (rows async, dense sync) and range partitioning: the rows run async while the dense part
  has no staleness, and the shard of the hot ids carries most of the row load.
"""

from __future__ import annotations

import pytest
import torch

from psgd.core.config import DataConfig
from psgd.train import data
from tests.helpers import psgd_main, summary

pytestmark = pytest.mark.usefixtures("warm_runs")  # its runs fork from the tests' warm parent

BASE = ("run", "--dataset", "clicks", "--model", "dlrm", "--workers", "2", "--servers", "2")


def _run(out, *flags):
    r = psgd_main(*BASE, "--out", str(out), *flags)
    assert r.returncode == 0, r.stderr
    return summary(out)


def test_sync_with_rows_equals_the_dense_path_bit_for_bit(tmp_path):
    flags = ("--mode", "sync", "--steps", "25", "--momentum", "0", "--eval-every", "10")
    dense = _run(tmp_path / "dense", *flags)
    by_row = _run(tmp_path / "rows", *flags, "--embeddings", "rows")
    assert by_row["params_sha256"] == dense["params_sha256"]
    # The rows over gRPC (psgd/ps/rows_grpc.py) instead of their TCP service, and shard 1 killed
    # after update 12: the run restarts from the checkpoints of version 10, which hold the rows too,
    # and ends with the same parameters, rows included.
    restarted = _run(tmp_path / "restarted", *flags, "--embeddings", "rows", "--transport", "grpc",
                     "--checkpoint-every", "5", "--fail-shard-at", "1=12", "--restart-servers", "1")
    assert restarted["resumed_from"] == 10 and restarted["params_sha256"] == dense["params_sha256"]
    assert restarted["rows"]["mode"] == "sync"
    # Every snapshot joined back equals the dense run's at the same version (the rows at its round).
    evals = lambda s: [(e["version"], e["test_loss"]) for e in _evals(tmp_path / s)]  # noqa: E731
    assert evals("rows") == evals("dense") and len(evals("rows")) >= 3
    rows = by_row["rows"]
    assert rows["mode"] == "sync" and set(rows["staleness"]["hist"]) == {"0"}
    assert sum(rows["share"]) == sum(len(t) for t in _vocab())
    assert by_row["bytes_per_step"] < dense["bytes_per_step"]  # the touched rows, not the tables


def _evals(out):
    from tests.helpers import events

    return [e for e in events(out) if e.get("event") == "eval"]


def _vocab():
    from psgd.train import clicks

    return [range(v) for v in clicks.PROFILES["clicks"].vocab]


def test_two_async_workers_learn_the_clicks_above_the_majority_class(tmp_path):
    s = _run(tmp_path / "async", "--mode", "async", "--embeddings", "rows", "--row-optimizer", "adagrad",
             "--epochs", "3", "--batch-size", "16")
    ds = data.load(DataConfig(dataset="clicks"))
    rate = float(ds.y_test.float().mean())
    majority = max(rate, 1 - rate)
    assert s["final_test_accuracy"] > majority + 0.03, (s["final_test_accuracy"], majority)
    # A row changes only when a push names it: its own staleness is below the shard's.
    assert 0 < s["rows"]["staleness"]["mean"] < s["staleness"]["mean"]
    final = torch.load(tmp_path / "async" / "final_params.pt")
    assert len(final) == s["params"] and torch.isfinite(final).all()


def test_hybrid_runs_the_rows_async_beside_a_sync_dense_part_and_range_puts_the_hot_ids_on_one_shard(tmp_path):
    s = _run(tmp_path / "hybrid", "--mode", "sync", "--embeddings", "hybrid", "--row-partition", "range",
             "--steps", "30")
    assert s["staleness"]["max"] == 0 and s["rows"]["mode"] == "async"
    load = s["rows"]["load"]
    assert load[0] > 2 * load[1], load  # clicks' id 0 is each field's hottest: range gives shard 0 every hot id


def test_what_rows_by_key_refuses_is_said_in_one_line(tmp_path):
    for flags, words in ((("--mode", "allreduce"), "allreduce"), (("--topk", "0.1"), "--topk"),
                         (("--overlap",), "--overlap"), (("--restart-workers", "1"), "--restart-workers")):
        r = psgd_main(*BASE, "--embeddings", "rows", *flags, "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and words in r.stderr, r.stderr
