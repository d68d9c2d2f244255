"""Checkpoints (psgd/ps/checkpoint.py, Shard.state / restore, psgd run --resume): atomic files
whose damage is detected, and a restored shard that goes on exactly as the uninterrupted one."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from psgd.core.config import OptimConfig, RunConfig
from psgd.ps import checkpoint
from psgd.train import assemble
from tests.helpers import open_start_barrier, psgd_main, summary
from tests.warm import fork_runs_from

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")


def test_damaged_checkpoints_are_skipped_never_loaded(tmp_path):
    folder = tmp_path / "ckpt"
    for v in (1, 2, 3, 4):
        checkpoint.write(folder, 0, v, {"version": v, "param": torch.full((5,), float(v))}, keep=3)
    (folder / "notes.txt").write_text("not ours")
    checkpoint.write(folder, 1, 4, {"version": 4}, keep=3)  # another shard's: never touched by shard 0's
    assert checkpoint.versions(folder, 0) == [4, 3, 2]  # the oldest was pruned; others' files stay
    assert (folder / "notes.txt").exists() and checkpoint.versions(folder, 1) == [4]
    newest = checkpoint.path_of(folder, 0, 4)
    data = bytearray(newest.read_bytes())
    data[-7] ^= 0x10  # one bit flipped in the payload
    newest.write_bytes(bytes(data))
    older = checkpoint.path_of(folder, 0, 3)
    older.write_bytes(older.read_bytes()[:-100])  # truncated
    warnings: list[str] = []
    state, path = checkpoint.newest(folder, 0, warn=warnings.append)
    assert state["version"] == 2 and torch.equal(state["param"], torch.full((5,), 2.0))
    assert "checksum mismatch" in warnings[0] and "truncated" in warnings[1]
    assert checkpoint.newest(folder, 0, warn=warnings.append, upto=1) is None
    assert checkpoint.versions(folder, 0) == [2]


def test_a_write_that_fills_the_disk_leaves_no_partial_file_and_says_so(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    checkpoint.write(folder, 0, 1, {"version": 1}, keep=3)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", full)  # the disk fills as the payload is flushed
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint.write(folder, 0, 2, {"version": 2, "param": torch.zeros(1000)}, keep=3)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == [checkpoint.path_of(folder, 0, 1).name]  # no .tmp
    assert checkpoint.versions(folder, 0) == [1]


def test_a_restored_shard_goes_on_exactly_as_the_uninterrupted_one(tmp_path):
    """Sync, momentum and a warmup schedule: the state a checkpoint carries is all the state."""
    cfg = RunConfig(mode="sync", workers=1, servers=1, steps=100, checkpoint_every=3, out=str(tmp_path),
                    optim=OptimConfig(lr=0.1, momentum=0.9, warmup=5))
    grads = [torch.randn(6, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    a = assemble.shard(cfg, 0)
    a.init(torch.arange(6, dtype=torch.float32))
    open_start_barrier(a)
    for c, g in enumerate(grads):
        a.push(0, c, c, g, "fp32")
    state, _ = checkpoint.newest(tmp_path / "checkpoints", 0)
    assert state["version"] == 6 and a.stats()["checkpoints"] == 2
    b = assemble.shard(cfg, 0)
    b.restore(state)
    assert b.policy.clocks == [6] and b.ready.is_set()
    for c in (6, 7):
        b.push(0, c, c, grads[c], "fp32")
    assert torch.equal(a.param, b.param) and b.policy.version == a.policy.version == 8
    wrong = assemble.shard(RunConfig(mode="sync", workers=2, servers=1), 0)
    try:
        wrong.restore(state)
        raise AssertionError("a checkpoint of another run was taken")
    except ValueError as e:
        assert "1 workers" in str(e)


TRAIN = ["--mode", "sync", "--workers", "1", "--servers", "1", "--steps", "12", "--checkpoint-every", "5",
         "--dataset", "synthetic", "--num-samples", "600", "--model", "mlp", "--width", "16", "--batch-size", "8",
         "--eval-every", "0"]


@pytest.fixture(scope="module")
def calm(warm_parent, tmp_path_factory):
    """One uninterrupted TRAIN run for this file's tests (they each made the same one): its folder and
    its parameters' hash, read as it ended. The torn-line test tears and resumes this folder in place
    (the only test that writes to it); the hash is the calm run's whatever it does."""
    out = tmp_path_factory.mktemp("calm") / "run"
    with pytest.MonkeyPatch.context() as m:  # forked from the warm parent, as the tests' own runs
        fork_runs_from(warm_parent, m)
        r = psgd_main("run", *TRAIN, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out, summary(out)["params_sha256"]


def test_a_killed_shard_is_restarted_from_its_checkpoint_and_the_run_ends_bit_for_bit(tmp_path, calm):
    _, ref = calm  # the same TRAIN run, uninterrupted
    out = tmp_path / "restarted"
    # Shard 0 dies right after update 7 (after writing nothing since version 5): the run goes back to 5.
    r = psgd_main("run", *TRAIN, "--fail-shard-at", "0=7", "--restart-servers", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    (restart,) = s["restarts"]
    assert (restart["shard"], restart["how"], restart["resumed_from"]) == (0, "signal SIGKILL", 5)
    # `reached` counts the steps the workers finished: the update in flight when the shard died is not one.
    assert restart["reached"] >= 6 and restart["updates_lost"] == restart["reached"] - 5
    assert s["resumed_from"] == 5 and s["global_updates"] == 12
    assert s["params_sha256"] == ref  # the lost updates were redone exactly
    # `psgd run --resume OUT` is the same path (launch.run(resume=True)), started by hand.
    r = psgd_main("run", "--resume", str(out), "--steps", "3")
    assert r.returncode == 2 and "give no other flags" in r.stderr


def test_a_torn_last_metrics_line_is_left_out_and_resume_goes_on_from_the_newest_checkpoint(calm):
    """A write cut short (a full disk) leaves metrics.jsonl's last line without its end: `--resume`
    reads past it and continues from checkpoint 10 to the calm run's parameters (it failed with
    "Expecting value" before)."""
    out, calm = calm  # the finished TRAIN run (this test's to tear)
    lines = (out / "metrics.jsonl").read_bytes()
    (out / "metrics.jsonl").write_bytes(lines[:-20])  # the last line loses its end
    r = psgd_main("run", "--resume", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["resumed_from"] == 10 and s["global_updates"] == 12 and s["params_sha256"] == calm
    # Every step of both attempts, each clock once (issue 54, item 2: the resumed attempt's 2 only).
    assert s["per_worker_steps"] == {"0": 12} and s["worker_steps"] == 12


def test_metrics_end_a_torn_line_before_their_own_and_reading_leaves_it_out(tmp_path):
    from psgd.train.metrics import Metrics, read_events

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event":"step","clock":0}\n{"event":"step","clo')
    m = Metrics(path)
    m.write(event="launch")
    m.close()
    assert path.read_bytes().splitlines()[1] == b'{"event":"step","clo'  # the torn line stays, ended
    assert [e["event"] for e in read_events(path)] == ["step", "launch"]


def _first_line(path: str, inherited: int) -> None:
    from psgd.train.metrics import Metrics

    os.close(inherited)  # the other writer's descriptor (and its lock), as a fork copies it: not this one's
    m = Metrics(path)
    m.write(event="launch")
    m.close()


def test_a_writer_waits_for_a_line_another_is_appending_and_leaves_no_blank_line(tmp_path):
    """A new writer checks the file's tail for a torn line (its writer killed) and ends it. It took
    another process's line still being copied (a long line is copied a page at a time, the file's
    size ahead of its last byte) for a torn one, and ended it with a newline: a blank line, or a
    line cut in two. Writers append under the file's lock, so the check waits for that line."""
    import fcntl
    import multiprocessing

    from psgd.train.metrics import read_events

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event":"step","clock":0}\n')
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(fd, fcntl.LOCK_EX)               # another writer, half way through its line
    os.write(fd, b'{"event":"step",')
    child = multiprocessing.get_context("fork").Process(target=_first_line, args=(str(path), fd), daemon=True)
    child.start()
    inode = f":{os.fstat(fd).st_ino} "
    deadline = time.monotonic() + 30
    # Until the new writer either waits for the lock (psgd's) or is done without waiting (a writer
    # that does not take it): /proc/locks lists a waiter with "->".
    while child.is_alive() and not any("->" in line and inode in line for line in open("/proc/locks")):
        assert time.monotonic() < deadline
        time.sleep(0.005)  # a poll of the kernel's lock table, not a core spun on a 2-core machine
    os.write(fd, b'"clock":1}\n')
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    child.join(30)
    assert child.exitcode == 0
    assert path.read_bytes().splitlines() == [b'{"event":"step","clock":0}', b'{"event":"step","clock":1}',
                                              path.read_bytes().splitlines()[2]]
    assert [e.get("clock", e["event"]) for e in read_events(path)] == [0, 1, "launch"]


def test_an_async_run_of_two_shards_whose_shard_is_killed_restarts_with_each_worker_at_one_clock(tmp_path):
    """Issue 54, item 20. The two shards' checkpoints of version 10 count the workers' pushes apart
    (each applies them as they come); the restart resumes each worker at the highest clock either
    holds it at (--restore-clocks), so no worker finds its shards at different clocks, and the run
    finishes its budget."""
    from psgd.core.config import from_dict
    from psgd.train import restart

    flags = ["--mode", "async", "--workers", "2", "--servers", "2", "--steps", "12", "--checkpoint-every", "5",
             *TRAIN[TRAIN.index("--dataset"):]]
    out = tmp_path / "async"
    r = psgd_main("run", *flags, "--fail-shard-at", "1=14", "--restart-servers", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    (restart_,) = s["restarts"]
    assert (restart_["shard"], restart_["resumed_from"]) == (1, 10) and s["resumed_from"] == 10
    cfg = from_dict(s["config"])
    held = [checkpoint.newest(out / "checkpoints", k, upto=10)[0]["clocks"] for k in (0, 1)]
    aligned = restart.aligned_clocks(cfg, 10)
    assert aligned == [max(a, b) for a, b in zip(*held, strict=True)] and sum(aligned) >= 10
    # Async's budget (12 steps a worker, shared as they come) spent: the shards applied 24 updates
    # (the workers' own count of steps moves by the pushes a shard skipped and the step in flight
    # when it died, either way).
    assert s["global_updates"] == 24 and sum(s["per_worker_steps"].values()) == s["worker_steps"]
    # A clock behind a checkpoint's is refused in one line (exit 2) before the shard listens.
    r = psgd_main("server", "--shard", "1", "--servers", "2", "--workers", "2", "--mode", "async",
                  *TRAIN[TRAIN.index("--dataset"):TRAIN.index("--eval-every")], "--restore", str(out / "checkpoints"),
                  "--restore-upto", "10", "--restore-clocks", "0,0")
    assert r.returncode == 2 and "--restore-clocks 0,0: give one clock per worker (2)" in r.stderr, r.stderr
