"""Helpers for tests that start real `psgd` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")


def psgd(*args: str, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psgd", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, **kw)


def _live_processes():
    """(pid, command line) of every live process but this one and zombies."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        except OSError:
            continue
        if state != "Z":
            yield pid, cmd


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes whose arguments contain `text` (orphan check)."""
    return [cmd for _, cmd in _live_processes() if text in cmd]


def processes_in_session(sid: int) -> list[str]:
    """Command lines of live processes in session `sid` (orphan check: what a session leader,
    such as a child of a zygote, left behind that did not start a session of its own)."""
    found = []
    for pid, cmd in _live_processes():
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[3]) == sid:
                found.append(cmd)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def processes_with_env(name: str, value: str) -> list[str]:
    """Command lines of live processes whose environment has name=value: every descendant of a
    process started with that variable, whatever its command line (orphan check)."""
    needle = f"{name}={value}".encode()
    found = []
    for pid, cmd in _live_processes():
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(cmd)
        except OSError:
            continue  # gone meanwhile, or another user's
    return found


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def open_start_barrier(shard, members: int | None = None) -> None:
    """Every worker of a shard asks for its first pull (clock 0) at once, as the workers of a run
    do, so that the shard's start barrier is down and a test may drive a single worker after it."""
    import threading

    policy = shard.policy
    threads = [threading.Thread(target=policy.pull, args=(w, 0, lambda: None), kwargs={"timeout": 60})
               for w in range(policy.num_workers if members is None else members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert policy.roster.started


def workers_in_threads(cfg, addresses: list[str], exchange=None) -> list[dict]:
    """Run cfg.workers PS workers as threads against running shards; return each worker's totals
    (worker.train's result) after checking that every one finished cleanly. `exchange(cfg,
    addresses)` makes each worker's exchange (default: psgd/train/assemble.py `ps_exchange`)."""
    import threading

    from psgd.train import assemble

    make = exchange or assemble.ps_exchange
    errors: list[BaseException] = []
    totals: list[dict] = [{} for _ in range(cfg.workers)]

    def work(rank: int) -> None:
        try:
            totals[rank] = assemble.train_worker(cfg, rank, make(cfg, addresses), None)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(cfg.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return totals


def train_in_threads(cfg, addresses: list[str], shards: list):
    """Run cfg.workers PS workers as threads against in-process shards; return the shards' joined
    parameters after checking every worker finished cleanly and every shard reached cfg.steps
    updates (the averaging rounds of --local-steps)."""
    import torch

    from psgd.core import localsgd

    workers_in_threads(cfg, addresses)
    assert all(s.policy.version == localsgd.rounds(cfg.steps, cfg.local_steps) for s in shards)
    return torch.cat([s.param.detach().clone() for s in shards])


def psgd_main(*args: str) -> subprocess.CompletedProcess:
    """`psgd ARGS` in this process (psgd.cli.main, what `python -m psgd` calls): the same exit code
    and output without the interpreter's and torch's start-up. For commands whose own process is
    not under test; children the command starts are real processes either way."""
    import contextlib
    import io

    from psgd.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:   # argparse's errors exit 2 (psgd.core.errors.Parser)
            rc = e.code
    return subprocess.CompletedProcess(["psgd", *args], rc, out.getvalue(), err.getvalue())
