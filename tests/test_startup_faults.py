"""A process lost while the job starts is survived wherever a lost process is survived at all (issue 26):
any worker initialises the shards (the first Init wins), and a shard that dies before it was ready is
restarted under --restart-servers like one that dies later (from scratch: no checkpoint exists yet)."""

from __future__ import annotations

import pytest

from tests.helpers import events, processes_mentioning, psgd_main, summary

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

TINY = ["--dataset", "synthetic", "--num-samples", "600", "--batch-size", "8", "--model", "mlp", "--quiet"]


def test_a_worker_killed_before_it_joined_is_survived_with_a_lease(tmp_path):
    out = tmp_path / "kill0"
    r = psgd_main("run", "--mode", "async", "--workers", "3", "--servers", "2", "--steps", "60", "--worker-lease", "3",
                  "--fail-at", "0=-1", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["lost_workers"] == [{"worker": 0, "clock": 0, "how": "signal SIGKILL"}]
    assert s["global_updates"] == 180 and set(s["per_worker_steps"]) == {"1", "2"}, "the others spent the budget"
    assert processes_mentioning(str(out)) == []


def test_every_worker_offers_the_init_and_the_first_one_wins(tmp_path):
    """Worker 0 dies before it joins; without a lease the run fails, naming it, not with a hang."""
    out = tmp_path / "nolease"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--steps", "20", "--fail-at", "0=-1", "--out", str(out),
                  *TINY)
    assert r.returncode == 1 and "worker 0" in r.stderr and "SIGKILL" in r.stderr
    assert processes_mentioning(str(out)) == []


def test_a_shard_killed_while_starting_is_restarted_from_scratch(tmp_path):
    out = tmp_path / "shard"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--servers", "2", "--steps", "30", "--checkpoint-every",
                  "10", "--restart-servers", "1", "--fail-shard-at", "0=0", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    assert "from scratch (no checkpoint yet)" in r.stderr
    s = summary(out)
    assert s["global_updates"] == 30
    (restart,) = s["restarts"]
    assert (restart["shard"], restart["how"], restart["resumed_from"]) == (0, "signal SIGKILL", 0)
    assert [e["event"] for e in events(out)].count("restart") == 1
    none_left = psgd_main("run", "--mode", "sync", "--workers", "2", "--steps", "30", "--fail-shard-at", "0=0",
                          "--out", str(tmp_path / "no-restart"), *TINY)
    assert none_left.returncode == 1 and "shard 0/1 failed to start (signal SIGKILL)" in none_left.stderr


def test_a_sync_worker_lost_mid_run_shrinks_the_quorum_under_a_lease(tmp_path):
    out = tmp_path / "sync-lease"
    r = psgd_main("run", "--mode", "sync", "--workers", "3", "--servers", "2", "--steps", "40", "--worker-lease", "2",
                  "--fail-at", "1=10", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["global_updates"] == 40 and s["lost_workers"] == [{"worker": 1, "clock": 10, "how": "signal SIGKILL"}]
    assert s["per_worker_steps"] == {"0": 40, "1": 10, "2": 40}  # the lost worker's 10 steps too (issue 54, item 2)
    refused = psgd_main("run", "--mode", "sync", "--worker-lease", "2", "--backup-workers", "1", "--workers", "3")
    assert refused.returncode == 2 and "use one of them" in refused.stderr
