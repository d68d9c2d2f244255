"""The record of a run's restarts across attempts (psgd/train/rundir.py `fresh`, psgd/train/restart.py
`carry_over`; issue 54, item 2): every restart of the run, of a worker and of the warm parent stays
in metrics.jsonl, whence summary.json's `restarts` and `restarted_workers`, however many attempts
came before, from scratch or from a checkpoint. A new run in an old folder carries none of them."""

from __future__ import annotations

import json
from pathlib import Path

from psgd.core.config import RunConfig
from psgd.train import restart, rundir
from psgd.train.metrics import read_events


def attempt(out: Path, *lines: dict, died: int | None = None) -> None:
    """What an attempt wrote before it stopped: its lines, and (a dead shard) the note of its restart."""
    for e in lines:
        rundir.event(out, **e)
    if died is not None:
        (out / "restart.json").write_text(json.dumps(dict(shard=died, how="signal SIGKILL", reached=0,
                                                          resumed_from=0, updates_lost=0)))


def kinds(out: Path) -> list[tuple]:
    return [(e["event"], e.get("rank", e.get("shard"))) for e in read_events(out / "metrics.jsonl")
            if e["event"] in rundir.CARRIED]


def test_consecutive_restarts_from_scratch_keep_every_earlier_restart(tmp_path):
    cfg = rundir.fresh(RunConfig(out=str(tmp_path / "run")))
    out = Path(cfg.out)
    attempt(out, dict(event="worker_restarted", rank=1, how="signal SIGKILL"), died=0)
    rundir.fresh(cfg)  # restart 1, from scratch
    attempt(out, dict(event="worker_restarted", rank=0, how="signal SIGKILL"),
            dict(event="zygote_restarted", how="signal SIGKILL"), died=1)
    rundir.fresh(cfg)  # restart 2, from scratch
    attempt(out, died=0)
    rundir.fresh(cfg)  # restart 3, from scratch
    assert kinds(out) == [("worker_restarted", 1), ("restart", 0), ("worker_restarted", 0),
                          ("zygote_restarted", None), ("restart", 1), ("restart", 0)]
    # A new run in the same folder starts its own record.
    rundir.fresh(cfg)
    assert kinds(out) == []


def test_a_resume_carries_worker_and_run_restarts_forward(tmp_path):
    cfg = rundir.fresh(RunConfig(out=str(tmp_path / "run")))
    out = Path(cfg.out)
    attempt(out, dict(event="worker_restarted", rank=1, how="signal SIGKILL"), died=0)
    rundir.fresh(cfg)  # from scratch
    attempt(out, dict(event="worker_restarted", rank=1, how="signal SIGKILL"), died=0)
    restart.carry_over(out)  # from a checkpoint
    attempt(out, dict(event="worker_restarted", rank=0, how="signal SIGKILL"), died=1)
    restart.carry_over(out)
    assert kinds(out) == [("worker_restarted", 1), ("restart", 0), ("worker_restarted", 1), ("restart", 0),
                          ("worker_restarted", 0), ("restart", 1)]
    assert sorted(p.name for p in out.glob("metrics-attempt-*.jsonl")) == ["metrics-attempt-1.jsonl",
                                                                           "metrics-attempt-2.jsonl"]
