"""Supervising a run's children: start each one, read its READY line, wait for any to exit, stop them.

Contract:
- `Child(name, argv, log, env, ...)`: one process: `argv` exec'd (subprocess.Popen), or, given the
  run's warm parent and an argv of `python -m psgd ARGS`, ARGS forked from it (psgd/train/warm.py).
  Either way `child.proc` answers poll / wait / returncode / send_signal / kill; stdout is a pipe
  with `capture_stdout` (the READY line), stdin one with `stdin_pipe`; the log gets the rest.
- `read_ready(child, timeout)`: the `host:port` of a server's `READY host:port` line; RunFailed (or
  ShardDied, a shard that died while starting) naming it otherwise.
- `wait_workers(workers, servers, cfg, restart, zygote)`: returns when every worker exited 0; waits
  for any child to exit, no polling (the warm parent's exit reports, or os.waitid for exec'd
  children). A worker that fails fails the run (RunFailed naming it, quoting its log's last line
  or, if it wrote none (a full disk), another child's last error line, named: `why`), unless --restart-workers
  restarts it or --worker-lease lets the others go on (the shards told at once, `lost RANK` on
  their stdin); a server that dies is ShardDied, which --restart-servers recovers
  (psgd/train/launch.py `run`).
- `stop(children, sig)`: signal every child still running, wait for each, SIGKILL one that takes
  longer than STOP_TIMEOUT_S.
- `child_env(cfg)`: the environment every child gets: $PSGD_LAUNCHED (the launcher prepared the
  folder), its lifeline to the launcher (psgd/train/lifeline.py), loopback for gloo and NCCL, and
  the thread budget as OMP_NUM_THREADS (psgd/train/threads.py).
The benchmarks that start psgd processes of their own (psgd/bench/transport.py, peers.py) use these.
A worker's end is logged at DEBUG, its restart or loss as a warning (`psgd.train.supervise`'s logger).
"""

from __future__ import annotations

import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from psgd.core.config import RunConfig
from psgd.train import lifeline, rundir
from psgd.train.threads import thread_budget
from psgd.train.warm import Forked, Zygote, ZygoteError

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
SETTLE_S = 2.0  # how long a worker's lost connection waits for its shard's exit to show
# What a (restarted) worker's setup says when its shards hold it at different clocks (psgd/ps/exchange.py).
SPLIT = "at different clocks"
ERROR_LINE = re.compile(r"Error\b|Exception\b|error:|\[Errno \d+\]")  # a line that says what went wrong
INTERRUPTED = "interrupted; stopped all servers and workers"
log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A child failed; the message names it."""


class Interrupted(RunFailed):
    """Ctrl-C (SIGINT) while the children ran: every one of them has been stopped and waited for.
    A RunFailed, so that a caller that goes on after a failed run (the suite, psgd.fit's users)
    still catches it; `psgd run` says it in one line and exits 130."""


class ShardDied(RunFailed):
    """A shard's process ended before the run did (`--restart-servers` restarts the run then)."""

    def __init__(self, shard: int | None, how: str, message: str) -> None:
        super().__init__(message)
        self.shard, self.how = shard, how


class ClocksSplit(ShardDied):
    """A sync worker's shards hold it at different clocks (`_split`): the run rolls every shard back
    to the newest checkpoint they all hold, as for a dead shard; `shard` is None (no shard died)."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(None, f"{worker} split between shards", message)
        self.worker = worker

    def final(self) -> RunFailed:
        """The one line when no restart is left: only a roll-back to a checkpoint recovers it."""
        return RunFailed(f"{self}; in sync only a roll-back to a checkpoint all shards hold recovers that "
                         "(--checkpoint-every K --restart-servers N), and no restart is left")


class Child:
    """One process of the run (see the module docstring)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None,
                 capture_stdout: bool = False, stdin_pipe: bool = False, zygote: Zygote | None = None) -> None:
        self.name = name
        self.log = log
        exe = [sys.executable, "-m", "psgd"]
        with open(log, "wb") as f:
            try:
                if zygote is not None and argv[:3] == exe:
                    self.proc = _fork(zygote, argv[3:], env or dict(os.environ), f, capture_stdout, stdin_pipe)
                else:
                    self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE if capture_stdout else f, stderr=f,
                                                 stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                                                 env=env, start_new_session=True)
            except (ZygoteError, OSError, subprocess.SubprocessError) as e:
                raise RunFailed(f"cannot start {name}: {e}") from None

    def last_error(self, errors_only: bool = False) -> str:
        """Its log's last line ("(no output)" if none); `errors_only`: the last that reads as an error."""
        for ln in reversed(self.log.read_text(errors="replace").splitlines()):
            if ln.strip() and (not errors_only or ERROR_LINE.search(ln)):
                return ln.strip()
        return "(no output)"

    def why(self, others: list[Child]) -> str:
        """Its log's last line; a child that could write nothing (a full disk takes its log first)
        is explained by the first of `others` whose log has an error line, named."""
        own = self.last_error()
        said = ((o.name, o.last_error(errors_only=True)) for o in others if o is not self and own == "(no output)")
        return next((f"{own}; {name} said: {line}" for name, line in said if line != "(no output)"), own)

    def how(self) -> str:
        """How it ended: `exit code N` or `signal NAME`."""
        rc = self.proc.returncode
        return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


def _fork(zygote: Zygote, args: list[str], env: dict, log, capture_stdout: bool, stdin_pipe: bool) -> Forked:
    """`psgd ARGS` forked by the zygote, its 0/1/2 the pipes or the log (the child's ends closed here)."""
    mine: dict[str, int] = {}  # the launcher's ends, by the Popen attribute they become
    theirs: list[int] = []     # the child's ends: sent to the zygote, then closed here

    def pipe(ours: str) -> int:
        r, w = os.pipe()
        mine[ours], child = (w, r) if ours == "stdin" else (r, w)
        theirs.append(child)
        return child

    try:
        if not stdin_pipe:
            theirs.append(os.open(os.devnull, os.O_RDONLY))
        stdin = pipe("stdin") if stdin_pipe else theirs[-1]
        stdout = pipe("stdout") if capture_stdout else log.fileno()
        proc = zygote.spawn(args, env, stdin, stdout, log.fileno())
    except BaseException:
        for fd in mine.values():
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    for which, fd in mine.items():
        setattr(proc, which, os.fdopen(fd, "wb" if which == "stdin" else "rb"))
    return proc


def index(child: Child) -> int:
    """K of `shard K/S`, R of `worker R/N` (the names `ps` shows too: psgd/train/proctitle.py)."""
    return int(child.name.split()[1].split("/")[0])


def read_ready(child: Child, timeout: float = READY_TIMEOUT_S) -> str:
    """The address of `child`'s `READY host:port` line (see the module docstring)."""
    with selectors.DefaultSelector() as sel:
        sel.register(child.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RunFailed(f"{child.name} did not become ready within {timeout:.0f}s; see {child.log}")
    line = child.proc.stdout.readline().decode().strip()
    if not line.startswith("READY "):
        child.proc.wait()
        message = f"{child.name} failed to start ({child.how()}): {child.last_error()}"
        if child.name.startswith("shard ") and (child.proc.returncode < 0 or child.proc.returncode == 1):
            # Died while starting (not a usage error, exit 2): --restart-servers restarts the run.
            raise ShardDied(index(child), child.how(), message)
        raise RunFailed(message)
    return line.split()[1]


def stop(children: list[Child], sig: int = signal.SIGTERM) -> None:
    """Signal every child still running; wait for each, killing one that outlasts STOP_TIMEOUT_S."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(sig)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def wait_workers(workers: list[Child], servers: list[Child], cfg: RunConfig | None = None,
                 restart=None, zygote: Zygote | None = None) -> None:
    """Return when every worker exited 0; raise RunFailed as soon as any child fails. With
    --restart-workers, `restart(child)` starts a dead worker again (a `worker_restarted` event; it
    rejoins at its clock), while restarts remain. With --worker-lease (async / SSP) a worker that
    dies is written down (a `worker_lost` event) and the others go on; the run fails only when
    none is left. `zygote`: the children are its forks (it reports their exits)."""
    pending = list(workers)
    restarts_left = cfg.restart_workers if cfg is not None and restart is not None else 0
    while pending:
        if zygote is not None:
            zygote.wait_any()  # the zygote reaps its children and reports each exit
        else:
            # Block until some child is exitable, without reaping it (Popen reaps below).
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        _check_servers(servers)
        for c in [c for c in pending if c.proc.poll() is not None]:
            pending.remove(c)
            if c.proc.returncode == 0:
                log.debug("%s finished", c.name)
                continue
            _not_the_shards(c, servers, cfg)
            if restarts_left > 0:
                restarts_left -= 1
                log.warning("psgd run: %s died with %s; restarting it (--restart-workers)", c.name, c.how())
                rundir.event(cfg.out, event="worker_restarted", rank=index(c), how=c.how())
                again = restart(c)
                workers[workers.index(c)] = again  # the launcher stops this one if the run fails
                pending.append(again)
            else:
                _lose(c, workers, servers, cfg)


def _not_the_shards(c: Child, servers: list[Child], cfg: RunConfig | None) -> None:
    """Worker `c` failed: ShardDied instead when a shard's death or split clocks are the cause."""
    if "UNAVAILABLE" in c.last_error():
        _settle(servers)  # it lost a shard: if the shard died, that is the run's fault to handle
    if cfg is not None and SPLIT in c.last_error():
        _split(cfg, c)  # raises: a restart at one clock cannot fit shards at two


def _lose(c: Child, workers: list[Child], servers: list[Child], cfg: RunConfig | None) -> None:
    """Worker `c` failed for good: with --worker-lease the others go on while any is left, else RunFailed."""
    tolerate = cfg is not None and cfg.worker_lease > 0
    if not tolerate or not any(p.proc.poll() in (None, 0) for p in workers):
        raise RunFailed(f"{c.name} (pid {c.proc.pid}) died with {c.how()}: {c.why(servers + workers)}")
    log.warning("psgd run: %s died with %s; the others go on without it (--worker-lease)", c.name, c.how())
    rundir.event(cfg.out, event="worker_lost", rank=index(c), how=c.how())
    _tell_lost(servers, index(c))


def _settle(servers: list[Child], seconds: float = SETTLE_S) -> None:
    """A worker died of a lost connection: give a shard that died first up to `seconds` for its own
    exit to be seen (ShardDied, which --restart-servers recovers), before the worker's death fails
    the run. Why: a SIGKILLed shard's sockets close a moment before its exit is reported, and on a
    loaded host the worker can see EOF, exit and be reaped in that moment. A bounded poll: a healthy
    shard costs the failing run `seconds`, no more."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        _check_servers(servers)
        time.sleep(0.01)


def _check_servers(servers: list[Child]) -> None:
    """ShardDied for the first server that failed. (One that ended by itself with 0 saw every worker
    leave: the workers end next.)"""
    for c in servers:
        if c.proc.poll() not in (None, 0):
            raise ShardDied(index(c), c.how(), f"{c.name} died with {c.how()}: {c.why(servers)}")


def _split(cfg: RunConfig, c: Child) -> None:
    """Worker `c` found its shards holding it at different clocks: its last process died between
    its pushes to them (or they were restored from checkpoints of different steps). In sync the
    lagging shard needs that worker's gradient of a step whose parameters the ahead shard has already
    replaced, so no worker can make it up: the run goes back to the newest checkpoint all shards
    hold (`ClocksSplit`, a ShardDied: `run` restarts it as for a dead shard, within
    --restart-servers, and the lost steps are redone exactly). Async and SSP runs with K > 1 shards
    cannot resume at one clock per worker (psgd/train/restart.py `resumable`): the run fails, naming
    the worker."""
    why = c.last_error().split("error: ", 1)[-1]
    if cfg.mode == "sync":
        raise ClocksSplit(c.name, f"{c.name} (pid {c.proc.pid}) cannot rejoin: {why}")
    raise RunFailed(f"{c.name} (pid {c.proc.pid}) cannot rejoin: {why}; an {cfg.mode} run with "
                    f"{cfg.servers} shards keeps one clock per worker per shard and cannot bring them together")


def _tell_lost(servers: list[Child], rank: int) -> None:
    """Tell every shard at once that worker `rank` is gone (a `lost RANK` line on its stdin, read by
    `psgd server --lost-on-stdin`): the launcher saw the process die, so waiting out --worker-lease
    for its silence would only stall the others (sync's quorum, SSP's slowest clock) that long."""
    for c in servers:
        if c.proc.stdin is None or c.proc.poll() is not None:
            continue
        try:
            c.proc.stdin.write(f"lost {rank}\n".encode())
            c.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # that server is gone (or going): the next pass of wait_workers names it


def child_env(cfg: RunConfig | None = None) -> dict:
    """The environment of every child of the run (see the module docstring); without a run's config
    (a benchmark's lone process) one thread, as on a fully shared machine."""
    env = dict(os.environ, **lifeline.env_for_children())
    env[rundir.LAUNCHED] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # Each process also sets its budget with torch.set_num_threads, which wins.
    env.setdefault("OMP_NUM_THREADS", str(thread_budget(cfg) if cfg else 1))
    return env
