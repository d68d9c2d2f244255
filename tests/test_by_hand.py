"""Runs started by hand (psgd server + psgd worker) or as torchrun would (psgd worker --mode allreduce)
end by themselves, and `psgd summarize OUT` writes their summary.json."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from psgd.core.config import RunConfig
from psgd.core.errors import ShardError, UsageError
from psgd.train import assemble
from tests.helpers import ENV, events, processes_mentioning, psgd_main, summary

TINY = ["--model", "mlp", "--dataset", "synthetic", "--num-samples", "600", "--batch-size", "16"]


@pytest.fixture
def start(request, tmp_path):
    """start(ARGS, env=ENV): `psgd ARGS`, a process of its own as a user starts one by hand (no
    launcher: nothing kills it, nothing marks it psgd run's), forked from this test process's warm
    parent (tests/warm.py: no interpreter and torch import each, as psgd run's children); its stdout
    a pipe (the READY line), its stderr a log. Any still running at the end is killed."""
    from psgd.train import supervise

    warm = request.getfixturevalue("warm_parent")
    started: list[supervise.Child] = []
    logs = tmp_path / "by-hand-logs"
    logs.mkdir()

    def start_one(*args: str, env: dict = ENV) -> supervise.Child:
        child = supervise.Child(args[0], [sys.executable, "-m", "psgd", *args], logs / f"{len(started)}.log", env,
                             capture_stdout=True, zygote=warm.get())
        started.append(child)
        return child

    yield start_one
    for c in started:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
        c.proc.stdout.close()


def wait_all(procs: list) -> tuple[list[int], list[str]]:
    """Exit codes and stderr of every process (`start`'s), each ending by itself; any left is killed."""
    try:
        codes = [p.proc.wait(timeout=120) for p in procs]
        return codes, [p.log.read_text() for p in procs]
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


def test_leave_counts_each_worker_once_and_finishes_after_all():
    shard = assemble.shard(RunConfig(mode="async", workers=2, servers=1), 0)
    assert shard.leave(1, 0) == 1
    assert shard.leave(1, 0) == 1  # a retried Leave must not end the run early
    assert not shard.finished.is_set()
    with pytest.raises(ShardError, match="out of range"):
        shard.leave(2, 0)
    with pytest.raises(ShardError, match="sent to shard 0"):
        shard.leave(0, 1)
    assert shard.leave(0, 0) == 2 and shard.finished.is_set()


def test_by_hand_ps_run_ends_by_itself_and_summarize_writes_the_summary(tmp_path, start):
    out = tmp_path / "by-hand"
    flags = ["--mode", "sync", "--workers", "2", "--num-shards", "2", "--steps", "5", "--out", str(out), *TINY]
    servers = [start("server", *flags, "--shard", str(k), "--port", "0") for k in range(2)]
    procs = list(servers)
    try:
        addresses = []
        for s in servers:
            line = s.proc.stdout.readline().decode()  # blocks until the server listens (or exits)
            assert line.startswith("READY "), s.log.read_text()
            addresses.append(line.split()[1])
        # --data-seed is a worker's setting (psgd server refuses it): worker 0 adds it to shard 0's config.json.
        procs += [start("worker", *flags, "--data-seed", "7", "--rank", str(r), "--servers", ",".join(addresses))
                  for r in range(2)]
    finally:
        # No signal and no timeout-driven stop: the servers end because both workers left.
        codes, errs = wait_all(procs)
    assert codes == [0, 0, 0, 0], errs
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["data"]["data_seed"] == 7 and recorded["workers"] == 2
    assert "psgd summarize" in errs[0]  # shard 0 tells what to run next
    assert not processes_mentioning(str(out))
    assert {"shard-0.json", "shard-1.pt", "config.json", ".psgd-run"} <= {p.name for p in out.iterdir()}
    assert not (out / "summary.json").exists()

    r = psgd_main("summarize", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["global_updates"] == 5 and s["workers"] == 2 and s["servers"] == 2
    assert s["startup_s"] > 0 and s["wall_time_s"] > 0
    first = [e for e in events(out) if e["event"] == "eval"]
    assert [e["version"] for e in first] == sorted(e["version"] for e in first) and first[-1]["version"] == 5

    # Again: the same summary, the eval lines replaced rather than doubled.
    assert psgd_main("summarize", str(out), "--quiet").returncode == 0
    again = [e for e in events(out) if e["event"] == "eval"]
    assert [e["version"] for e in again] == [e["version"] for e in first]
    assert summary(out)["params_sha256"] == s["params_sha256"]


def test_the_first_process_of_a_by_hand_run_prepares_its_folder(tmp_path, monkeypatch):
    """Shard 0 (all-reduce rank 0) clears an earlier run's files, so two runs' metrics never mix;
    under `psgd run` ($PSGD_LAUNCHED) it leaves the folder to the launcher."""
    from psgd.train import rundir

    out = tmp_path / "again"
    cfg = RunConfig(mode="async", workers=1, servers=1, out=str(out))
    monkeypatch.delenv(rundir.LAUNCHED, raising=False)
    rundir.prepare_by_hand(cfg)
    (out / "metrics.jsonl").write_text('{"event":"worker_end"}\n')   # an earlier run's line
    (out / "rendezvous").write_text("in use")                         # another process may hold it
    rundir.prepare_by_hand(cfg)
    assert [e["event"] for e in events(out)] == ["launch"] and events(out)[0]["by"] == "hand"
    assert (out / "rendezvous").exists() and json.loads((out / "config.json").read_text())["mode"] == "async"

    (out / "metrics.jsonl").write_text('{"event":"launch","by":"psgd run"}\n')
    monkeypatch.setenv(rundir.LAUNCHED, "1")
    rundir.prepare_by_hand(cfg)
    assert [e["by"] for e in events(out)] == ["psgd run"]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    monkeypatch.delenv(rundir.LAUNCHED)
    with pytest.raises(UsageError, match="psgd did not write"):
        rundir.prepare_by_hand(RunConfig(mode="async", workers=1, servers=1, out=str(foreign)))


def test_allreduce_workers_as_torchrun_starts_them_then_summarize(tmp_path, start):
    out = tmp_path / "ring"
    rendezvous = f"file://{tmp_path / 'rdv'}"  # outside the run folder, as a user would pick it
    flags = ["--mode", "allreduce", "--workers", "2", "--steps", "4", "--out", str(out), *TINY]
    env = dict(ENV, WORLD_SIZE="2")
    procs = [start("worker", *flags, "--rendezvous", rendezvous, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(2)]
    codes, errs = wait_all(procs)
    assert codes == [0, 0], errs
    assert "psgd summarize" in errs[0]
    r = psgd_main("summarize", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["mode"] == "allreduce" and s["global_updates"] == 4 and s["startup_s"] > 0


def test_summarize_refuses_what_is_not_a_finished_run(tmp_path):
    r = psgd_main("summarize", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "not a psgd run folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1

    out = tmp_path / "unfinished"
    out.mkdir()
    (out / ".psgd-run").write_text("psgd run folder\n")
    (out / "config.json").write_text(json.dumps({"mode": "sync", "workers": 1, "servers": 1}))
    r = psgd_main("summarize", str(out))
    assert r.returncode == 1 and "0 of 1 workers finished" in r.stderr

    # A worker the shard declared lost (its lease ran out) has ended too, with no launcher's
    # worker_lost event (a run by hand, under torchrun or Slurm): summarize goes on to the shards.
    (out / "shard-0.json").write_text(json.dumps({"lost_workers": {"0": 5}}))
    r = psgd_main("summarize", str(out))
    assert r.returncode == 1 and "has no shard-0.pt" in r.stderr, r.stderr

    (out / "config.json").write_text(json.dumps({"no_such_key": 1}))
    r = psgd_main("summarize", str(out))
    assert r.returncode == 2 and "unknown key" in r.stderr


def test_a_worker_that_cannot_leave_fails_loudly(tmp_path):
    """Leave is part of a clean end: a shard that vanished before it is an error, not silence."""
    from psgd.core.errors import ExchangeError
    from psgd.ps.client import make_client

    srv = assemble.shard_server(RunConfig(mode="async", workers=1, servers=1), 0, "127.0.0.1", 0)
    client = make_client("grpc", [f"127.0.0.1:{srv.port}"], 0, 4, rpc_timeout=10)
    client.init(torch.zeros(4))
    srv.stop(grace=0)
    with pytest.raises(ExchangeError, match="leave shard 0"):
        client.close()


@pytest.mark.parametrize("stdin,message", [("127.0.0.1:1\n", "expected 2 HOST:PORT"),
                                           ("nonsense\n", "expected HOST:PORT")])
def test_servers_on_stdin_refuses_what_is_not_k_addresses(stdin, message, monkeypatch):
    """psgd run's workers read the shards' addresses from stdin (they start side by side with the
    shards); anything but K addresses there is a one-line usage error (refused before the worker
    trains or leaves: psgd worker in this process, its stdin the test's)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    r = psgd_main("worker", "--rank", "0", "--servers", "2", "--servers-on-stdin", *TINY)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
