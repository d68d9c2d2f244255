"""`psgd run`: start K shard servers and N workers as processes of this same CLI, wait, evaluate.

Contract:
- Children run `psgd server|worker <the run's flags>`: exactly the commands you would run by hand
  on other hosts. By default each is a fork of a zygote that loaded torch once
  (psgd/train/zygote.py); with --cold-start or --hosts each is that command, exec'd. Servers bind
  127.0.0.1 on port 0 and print `READY host:port`. The workers start at the same time and get the
  addresses on stdin (`--servers-on-stdin`), so that their start-up (importing torch, above all)
  overlaps the servers'. With --hosts H each child runs on a host of a `psgd cluster` instead
  (`ip netns exec`, servers bound to their host's address, a per-run token): psgd/train/hosts.py,
  which also records the hosts in OUT/cluster.json and summary.json's "cluster".
- The launcher waits for any child to exit, no polling: on the zygote's exit reports, or on
  os.waitid for exec'd children. If a worker exits non-zero or a server exits early, it stops every
  other child and fails naming the process. Ctrl-C stops all children too (`Interrupted`; in
  evaluation and after, only the warm parent is left, closed on the way out), before the interrupt
  leaves `run`. Children ask for PR_SET_PDEATHSIG first thing (psgd/train/lifeline.py), so even a
  SIGKILLed launcher leaves no process behind.
- The run folder (--out) is psgd's alone: a MARKER file says so. A new or empty folder is taken, an
  earlier run's folder has psgd's own files replaced, and anything else (a file, a folder of
  other files) is refused with one line, exit 2: psgd never deletes what it did not write. No
  --out: a new results/runs/<mode>-<time>, and results/runs/latest a link to it.
- When the workers finish they tell the shards (Leave), and the servers write their stats and
  snapshots and exit by themselves (the launcher's SIGTERM is the fallback); then `finish` evaluates
  the snapshots (psgd/train/evaluate.py) on the test set, a training subset and, with
  --val-fraction, the validation split, and writes OUT/summary.json.
- Runs started by hand or by torchrun: the first process (`psgd server --shard 0`, or all-reduce
  rank 0) prepares the folder with `prepare_by_hand` (children of `psgd run` find $PSGD_LAUNCHED
  set and leave it to the launcher); the servers end when every worker has left; `psgd summarize
  OUT` then runs the same `finish` from OUT/config.json.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from psgd.core.config import RunConfig, from_dict, leaves, to_dict
from psgd.core.errors import UsageError
from psgd.train import cpulimit, hosts, lifeline, proctitle, roles
from psgd.train.metrics import Metrics, process_start_time, read_events, samples_per_update, summarize
from psgd.train.zygote import Forked, Zygote, ZygoteError

if TYPE_CHECKING:
    import torch

    from psgd.train import data as data_mod

# The launcher imports torch (and what imports it: data, models, evaluation, checkpoints) only
# where it needs it, after training: importing torch takes about a second of CPU, and before the
# children start that second was on every run's start-up (startup_s), or during training it
# competes with the children for the cores.

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class RunFailed(RuntimeError):
    """A child failed; the message names it."""


INTERRUPTED = "interrupted; stopped all servers and workers"


class Interrupted(RunFailed):
    """Ctrl-C (SIGINT) while the children ran: every one of them has been stopped and waited for.
    A RunFailed, so that a caller that goes on after a failed run (the suite, psgd.fit's users)
    still catches it; `psgd run` says it in one line and exits 130."""


class Child:
    """One process of the run: `argv` exec'd (`subprocess.Popen`), or, given the run's `zygote` and
    an argv of `python -m psgd ARGS`, ARGS forked from the warm parent (psgd/train/zygote.py). Either
    way `proc` answers poll / wait / returncode / send_signal / kill, with stdout a pipe when
    `capture_stdout` (the READY line) and stdin a pipe when `stdin_pipe`; the log gets the rest."""

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
            except ZygoteError as e:
                raise RunFailed(f"cannot start {name}: {e}") from None
            except (OSError, subprocess.SubprocessError) as e:
                raise RunFailed(f"cannot start {name}: {e}") from None

    def last_error(self) -> str:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "(no output)"


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


def _read_ready(child: Child, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(child.proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise RunFailed(f"{child.name} did not become ready within {timeout:.0f}s; see {child.log}")
    line = child.proc.stdout.readline().decode().strip()
    sel.close()
    if not line.startswith("READY "):
        rc = child.proc.wait()
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        message = f"{child.name} failed to start ({how}): {child.last_error()}"
        if child.name.startswith("shard ") and (rc < 0 or rc == 1):
            # Died while starting (not a usage error, exit 2): --restart-servers restarts the run.
            raise ShardDied(_index(child), how, message)
        raise RunFailed(message)
    return line.split()[1]


def _stop(children: list[Child], sig: int = signal.SIGTERM) -> None:
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


def _wait_workers(workers: list[Child], servers: list[Child], cfg: RunConfig | None = None,
                  restart=None, zygote: Zygote | None = None) -> None:
    """Return when every worker exited 0; raise RunFailed as soon as any child fails. With
    --restart-workers, `restart(child)` starts a dead worker again (a `worker_restarted` event; it
    rejoins at its clock), while restarts remain. With --worker-lease (async / SSP) a worker that
    dies is written down (a `worker_lost` event) and the others go on; the run fails only when
    none is left. `zygote`: the children are its forks (it reports their exits)."""
    pending = list(workers)
    tolerate = cfg is not None and cfg.worker_lease > 0
    restarts_left = cfg.restart_workers if cfg is not None and restart is not None else 0
    while pending:
        if zygote is not None:
            zygote.wait_any()  # the zygote reaps its children and reports each exit
        else:
            # Block until some child is exitable, without reaping it (Popen reaps below).
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        _check_servers(servers)
        for c in list(pending):
            rc = c.proc.poll()
            if rc is None:
                continue
            pending.remove(c)
            if rc != 0:
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                rank = _index(c)
                if "UNAVAILABLE" in c.last_error():
                    _settle(servers)  # it lost a shard: if the shard died, that is the run's fault to handle
                if cfg is not None and SPLIT in c.last_error():
                    _split(cfg, c)  # raises: a restart at one clock cannot fit shards at two
                if restarts_left > 0:
                    restarts_left -= 1
                    print(f"psgd run: {c.name} died with {how}; restarting it (--restart-workers)",
                          file=sys.stderr, flush=True)
                    _event(cfg, event="worker_restarted", rank=rank, how=how)
                    again = restart(c)
                    workers[workers.index(c)] = again  # the launcher stops this one if the run fails
                    pending.append(again)
                    continue
                if not tolerate or not any(p.proc.poll() in (None, 0) for p in workers):
                    raise RunFailed(f"{c.name} (pid {c.proc.pid}) died with {how}: {c.last_error()}")
                print(f"psgd run: {c.name} died with {how}; the others go on without it (--worker-lease)",
                      file=sys.stderr, flush=True)
                _event(cfg, event="worker_lost", rank=rank, how=how)
                _tell_lost(servers, rank)


SETTLE_S = 2.0  # how long a worker's lost connection waits for its shard's exit to show


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
            rc = c.proc.returncode
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            raise ShardDied(_index(c), how, f"{c.name} died with {how}: {c.last_error()}")


# What a (restarted) worker's setup says when its shards hold it at different clocks (psgd/ps/exchange.py).
SPLIT = "at different clocks"


def _split(cfg: RunConfig, c: Child) -> None:
    """Worker `c` found its shards holding it at different clocks: its last process died between
    its pushes to them (or they were restored from checkpoints of different steps). In sync the
    lagging shard needs that worker's gradient of a step whose parameters the ahead shard has already
    replaced, so no worker can make it up: the run goes back to the newest checkpoint all shards
    hold (`ClocksSplit`, a ShardDied: `run` restarts it as for a dead shard, within
    --restart-servers, and the lost steps are redone exactly). Async and SSP runs with K > 1 shards
    cannot resume at one clock per worker (see `resumable`): the run fails, naming the worker."""
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
            pass  # that server is gone (or going): the next pass of _wait_workers names it


def _index(child: Child) -> int:
    """K of `shard K/S`, R of `worker R/N` (the names `ps` shows too: psgd/train/proctitle.py)."""
    return int(child.name.split()[1].split("/")[0])


def _event(cfg: RunConfig, **fields) -> None:
    m = Metrics(Path(cfg.out) / "metrics.jsonl")
    m.write(**fields)
    m.close()


class ShardDied(RunFailed):
    """A shard's process ended before the run did (`--restart-servers` restarts the run then)."""

    def __init__(self, shard: int, how: str, message: str) -> None:
        super().__init__(message)
        self.shard, self.how = shard, how


class ClocksSplit(ShardDied):
    """A sync worker's shards hold it at different clocks (`_split`): `run` rolls every shard back to
    the newest checkpoint they all hold, as for a dead shard; `shard` is None (no shard died)."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(None, f"{worker} split between shards", message)
        self.worker = worker

    def final(self) -> RunFailed:
        """The one line when no restart is left: only a roll-back to a checkpoint recovers it."""
        return RunFailed(f"{self}; in sync only a roll-back to a checkpoint all shards hold recovers that "
                         "(--checkpoint-every K --restart-servers N), and no restart is left")


MARKER = ".psgd-run"  # in every folder psgd made for a run: the proof that its files are psgd's
RUNS = Path("results/runs")
# Everything psgd writes into a run folder, and nothing else: what a rerun removes, so that no file
# of the last run (a trace of other steps, a checkpoint of other parameters) sits beside the new
# one's. The run's own files, the suite's provenance.json, `psgd trace RUN`'s default PNG and CSV,
# a checkpoint's temporary file left by a killed shard (psgd/ps/checkpoint.py).
OWN_FILES = ("metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "config.json", "final_params.pt", "rendezvous",
             "restart.json", "cluster.json", "provenance.json", "trace.png", "trace.csv")
OWN_GLOBS = ("shard-*.json", "shard-*.pt", "replica-*.json", "replica-*.pt", "logs/server-*.log",
             "logs/worker-*.log", "checkpoints/shard-*.ckpt", "checkpoints/.shard-*.tmp", "metrics-attempt-*.jsonl")


def with_out_resolved(cfg: RunConfig, runs: Path = RUNS) -> RunConfig:
    """An empty --out becomes a folder of its own: runs/<mode>-<YYYYmmdd-HHMMSS>[-n], and
    runs/latest a link to it, so that no run replaces the one before."""
    if cfg.out:
        return cfg
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        out = runs / (f"{cfg.mode}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            out.mkdir()  # atomic: two runs started in the same second never share a folder
            break
        except FileExistsError:
            continue
    (out / MARKER).write_text("psgd run folder\n")
    latest = runs / "latest"
    if latest.is_symlink() or not latest.exists():  # an old real folder named latest is left alone
        # A new link renamed over the old one: concurrent runs never see latest missing or half made.
        tmp = runs / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.name)
        os.replace(tmp, latest)
    return dataclasses.replace(cfg, out=str(out))


def prepare_out(out: Path, keep: tuple[str, ...] = ()) -> None:
    """Make `out` an empty psgd run folder, never touching a file psgd did not write.

    A new or empty folder is taken; a psgd run folder (it holds MARKER) has psgd's own files of the
    last run removed (a rerun must not mix its lines with an old run's), anything else in it stays;
    a file, or a folder with files but no MARKER, is refused with a UsageError (exit 2).
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for the run (new, empty, or an earlier run's)")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise UsageError(f"--out {out} holds files psgd did not write (no {MARKER} in it): give a new or empty "
                         "folder, or an earlier psgd run's folder")
    for name in OWN_FILES:
        if name not in keep:
            (out / name).unlink(missing_ok=True)
    for pattern in OWN_GLOBS:
        for p in out.glob(pattern):
            p.unlink()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("psgd run folder\n")


LAUNCHED = "PSGD_LAUNCHED"  # set in psgd run's children: the launcher prepared the run folder


def prepare_by_hand(cfg: RunConfig) -> None:
    """The first process of a run started by hand or by torchrun (shard 0, all-reduce rank 0):
    prepare the run folder as `psgd run` does and write config.json, before any other process of
    the run writes there (workers write after the start barrier, other shards when they stop; their
    metrics files open at the first line). A rendezvous file there is left alone: the others may
    be using it already. Children of `psgd run` skip this: the launcher did it."""
    if os.environ.get(LAUNCHED):
        return
    out = Path(cfg.out)
    prepare_out(out, keep=("rendezvous",))
    (out / "config.json").write_text(json.dumps(config_record(cfg), indent=1))
    _write_launch(out, "hand")


def record_worker_settings(cfg: RunConfig, own: frozenset[str]) -> None:
    """A PS run by hand: shard 0 wrote config.json with a shard's settings (`psgd server` takes no
    others, psgd/train/roles.py); worker 0 writes its own settings, `own`, into it, so that `psgd
    summarize` reads the run's whole config. Shards on another host: no config.json here, nothing
    to add to (summarize runs where shard 0's folder is)."""
    path = Path(cfg.out) / "config.json"
    if os.environ.get(LAUNCHED) or not path.is_file():
        return
    record, mine = json.loads(path.read_text()), config_record(cfg)
    for leaf in leaves(RunConfig):
        if leaf.name in own:
            (record[leaf.section] if leaf.section else record)[leaf.name] = \
                (mine[leaf.section] if leaf.section else mine)[leaf.name]
    if "sources" in mine:
        record["sources"] = {**record.get("sources", {}), **mine["sources"]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # summarize never reads half of it


def config_record(cfg: RunConfig) -> dict:
    """config.json: the config, and with the user's own model / data / loss the spec and sha256 of
    each file they resolve to ("sources", psgd/train/workload.py; `from_dict` reads past it)."""
    from psgd.train import workload  # noqa: PLC0415 - no torch: it hashes files

    found = workload.sources(cfg)
    return {**to_dict(cfg), "sources": found} if found else to_dict(cfg)


def thread_budget(cfg: RunConfig, cores: int | None = None, role: str = "worker") -> int:
    """Intra-op threads per process: --threads, or the cores shared by the run's processes so that
    together they use each core once (N workers and K shards on 2 cores, each with torch's default
    of one thread per core, would ask for (N + K) x 2). A run by hand counts the processes of the
    whole run as if on this host: give --threads there when they are spread over hosts.

    Sync without --overlap takes turns: the workers compute while the shards wait for their
    gradients, the shards apply while every worker waits for the update; so does a single worker
    in any mode (its exchange waits for the shards' answer). Then the workers get the cores, the N
    of them cores // N each, and every shard one thread: an idle OpenMP thread spins before it
    sleeps, so two sides that both hold every core steal it from each other at each turn. Measured
    on 2 cores, sync N = 1 (updates/s, worker/shard threads): the MNIST-1D MLP 1,244 at 2/1, 1,216
    at 1/2, 126 at 2/2 (10x slower); the small transformer 21.2 at 2/1, 12.7 at 1/2, 20.5 at 2/2; at
    N = 2 a 2-thread shard was slower than a 1-thread one for both (MLP 837 vs 932, gpt 11.6 vs 12.3).
    The worker's forward and backward outweigh the shard's elementwise update, so it gets them."""
    if cfg.threads:
        return cfg.threads
    cores = cores or os.cpu_count() or 1
    if (cfg.mode == "sync" or cfg.workers == 1) and not cfg.overlap and cfg.mode != "allreduce":
        return 1 if role == "server" else max(1, cores // cfg.workers)
    processes = cfg.workers + (0 if cfg.mode == "allreduce" else cfg.servers)
    return max(1, cores // processes)


def set_threads(cfg: RunConfig, role: str = "worker") -> None:
    """In a server or worker process: take its share of the cores (`thread_budget`)."""
    import torch  # noqa: PLC0415 - see the imports

    torch.set_num_threads(thread_budget(cfg, role=role))


_LAUNCHED_BEFORE: list[float] = []  # when each run of this process began (the suite makes many)


def _write_launch(out: Path, by: str) -> None:
    """The run's first line: when it started (summary.json's startup_s counts from it). The first
    run of a process started with the process (its imports are start-up); a later run of the same
    process (the suite's) starts when it is launched, not when the suite did."""
    began = time.time() if _LAUNCHED_BEFORE else process_start_time()
    _LAUNCHED_BEFORE.append(began)
    m = Metrics(out / "metrics.jsonl")
    m.write(event="launch", by=by, process_start=began)
    m.close()


def child_env(cfg: RunConfig | None = None) -> dict:
    env = dict(os.environ, **lifeline.env_for_children())
    env[LAUNCHED] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # The thread budget (each process also sets it with torch.set_num_threads, which wins); without
    # a run's config (a benchmark's lone process): one thread, as on a fully shared machine.
    env.setdefault("OMP_NUM_THREADS", str(thread_budget(cfg) if cfg else 1))
    return env


def resumable(out: Path) -> RunConfig:
    """The config of a stopped run in `out` that `run(cfg, resume=True)` can continue; UsageError
    saying why not otherwise."""
    if not (out / MARKER).exists() or not (out / "config.json").is_file():
        raise UsageError(f"--resume {out}: not a psgd run folder (no {MARKER} and config.json)")
    cfg = from_dict(json.loads((out / "config.json").read_text()))
    if cfg.mode == "allreduce" or not cfg.checkpoint_every:
        raise UsageError(f"--resume {out}: the run wrote no checkpoints (it needs --checkpoint-every K)")
    if cfg.mode != "sync" and cfg.servers > 1:
        # Async shards checkpoint the same version with each worker's pushes counted in another
        # order, so their clocks differ per shard; one step number per worker cannot fit them all.
        raise UsageError(f"--resume {out}: an {cfg.mode} run resumes with one shard only (this one had {cfg.servers})")
    if cfg.local_steps > 1:
        raise UsageError(f"--resume {out}: local SGD (--local-steps) runs do not resume")
    # An injected fault (--fail-at) is how the first attempt was stopped, not part of the training
    # to continue: the resumed run goes on without it.
    return dataclasses.replace(cfg, fail_at=())


def resume_version(cfg: RunConfig) -> int:
    """The newest checkpoint version that every shard of the run has intact."""
    folder = Path(cfg.out) / "checkpoints"
    common = checkpoint_versions(cfg)
    if not common:
        raise RunFailed(f"{folder}: no checkpoint version that all {cfg.servers} shards have intact")
    return max(common)


def run(cfg: RunConfig, resume: bool = False, cold_start: bool = False, zygote: Zygote | None = None,
        tensorboard: Path | None = None) -> dict:
    """Run one training job end to end; returns the summary. Raises RunFailed, or UsageError for an
    --out that is not psgd's to write (an empty --out gets a folder of its own: with_out_resolved).
    `resume`: continue the stopped run in cfg.out from its checkpoints (`resumable`).
    `cold_start`: every child execs `python -m psgd ...` instead of being forked by the run's warm
    parent (psgd/train/zygote.py); for debugging, and the same results. `zygote`: a warm parent
    that outlives this run (`warm_parent`: the suite forks every run's processes from one, so torch
    is imported once per suite, not once per run); this run neither starts nor closes it (a gone one
    is replaced by a zygote of the run's own). `tensorboard`: a folder for the run's curves, written
    while it trains (psgd/train/tboard.py `Follower`).

    --restart-servers N: when a shard dies, every process is stopped and the run goes on from the
    newest checkpoint all shards have (the same path as --resume), at most N times; each restart
    is a `restart` event (which shard, how it died, the version reached, the one resumed from, the
    updates lost between them) and summary.json lists them. The workers are restarted too: in sync
    every shard and worker must go back to one step, and the checkpoint is that step."""
    restarts = 0
    while True:
        try:
            return _attempt(cfg, resume, cold_start, zygote, tensorboard)
        except ShardDied as e:
            if restarts >= cfg.restart_servers:
                if isinstance(e, ClocksSplit):
                    raise e.final() from None
                raise
            restarts += 1
            # A shard that died before any checkpoint (while starting, say) restarts the run from
            # scratch: nothing was lost that a checkpoint would have kept.
            scratch = not checkpoint_versions(cfg)
            print(f"psgd run: {e}; restart {restarts} of {cfg.restart_servers} "
                  + ("from scratch (no checkpoint yet)" if scratch else "from the newest checkpoint"),
                  file=sys.stderr, flush=True)
            # Injected faults stopped this attempt; they are not part of the training to continue.
            cfg, resume = dataclasses.replace(cfg, fail_at=(), fail_shard_at=()), not scratch
            _note_restart(Path(cfg.out), e, 0 if scratch else resume_version(cfg))


def checkpoint_versions(cfg: RunConfig) -> set[int]:
    folder = Path(cfg.out) / "checkpoints"
    from psgd.ps import checkpoint  # noqa: PLC0415 - see the imports

    return set.intersection(*(set(checkpoint.versions(folder, k)) for k in range(cfg.servers)))


def _note_restart(out: Path, died: ShardDied, resumed_from: int) -> None:
    """Kept for the next attempt's metrics (it moves this one's aside): the restart, as an event.
    `reached`: the steps the workers had finished (their step lines; the dead shard cannot say,
    and the update in flight when it died is not counted), so `updates_lost` is a lower bound."""
    events = read_events(out / "metrics.jsonl")
    reached = max((e["clock"] + 1 for e in events if e.get("event") == "step"), default=0)
    mode = json.loads((out / "config.json").read_text()).get("mode") if (out / "config.json").exists() else "sync"
    if mode != "sync":  # an async / SSP version counts every worker's gradients: theirs summed
        ends: dict[int, int] = {}
        for e in events:
            if e.get("event") == "step":
                ends[e["rank"]] = max(ends.get(e["rank"], 0), e["clock"] + 1)
        reached = sum(ends.values())
    (out / "restart.json").write_text(json.dumps(dict(
        shard=died.shard, how=died.how, reached=reached, resumed_from=resumed_from,
        updates_lost=max(0, reached - resumed_from))))


def warm_parent(tag: str = "suite") -> Zygote:
    """A warm parent for many runs (`run(..., zygote=)`); its children get each run's own environment."""
    return Zygote.start(tag, child_env())


def _attempt(cfg: RunConfig, resume: bool, cold_start: bool = False, shared: Zygote | None = None,
             tensorboard: Path | None = None) -> dict:
    restore: list[str] = []
    if resume:
        out = Path(cfg.out)
        restore = ["--restore", str(out / "checkpoints"), "--restore-upto", str(resume_version(cfg))]
        earlier = [e for e in read_events(out / "metrics.jsonl") if e.get("event") == "restart"] \
            if (out / "metrics.jsonl").exists() else []
        if (out / "metrics.jsonl").exists():  # the stopped attempt's lines, kept apart
            n = len(list(out.glob("metrics-attempt-*.jsonl"))) + 1
            os.replace(out / "metrics.jsonl", out / f"metrics-attempt-{n}.jsonl")
        m = Metrics(out / "metrics.jsonl")
        for e in earlier:
            m.write(**e)
        if (out / "restart.json").exists():
            m.write(event="restart", **json.loads((out / "restart.json").read_text()))
            (out / "restart.json").unlink()
        m.close()
    else:
        cfg = with_out_resolved(cfg)
        out = Path(cfg.out)
        # A restart from scratch (`run`) keeps the record of why, across the folder's fresh start.
        pending = json.loads((out / "restart.json").read_text()) if (out / "restart.json").exists() else None
        prepare_out(out)
        (out / "config.json").write_text(json.dumps(config_record(cfg), indent=1))
        if pending is not None:
            _event(cfg, event="restart", **pending)
    _write_launch(out, "psgd run --resume" if resume else "psgd run")
    # The warm parent loads torch while the launcher prepares; on cluster hosts each child enters
    # its namespace by exec (`ip netns exec`), so there, and with --cold-start, every child execs.
    forks = not (cold_start or cfg.hosts)
    own = forks and (shared is None or shared.gone)
    zygote = Zygote.start(str(out), child_env(cfg), reloads=cfg.restart_servers + cfg.restart_workers,
                          on_reload=lambda how: _zygote_reloaded(cfg, how)) if own else (shared if forks else None)
    # `tensorboard`: this run's TensorBoard folder, written as it trains by a thread of ours (psgd/train/tboard.py).
    follower = None
    try:
        if tensorboard is not None:
            from psgd.train import tboard  # noqa: PLC0415 - only runs that ask for it

            follower = tboard.Follower(out, tensorboard, cfg.workers)
        return _start_and_wait(cfg, out, restore, zygote)
    finally:
        if follower is not None:
            follower.close()
        if own:
            zygote.close()


def _zygote_reloaded(cfg: RunConfig, how: str) -> None:
    """The run's zygote died while it loaded (nothing forked yet): a new one is on its way."""
    print(f"psgd run: the zygote {how} while loading; starting a new one (--restart-servers / --restart-workers)",
          file=sys.stderr, flush=True)
    _event(cfg, event="zygote_restarted", how=how)


def _start_and_wait(cfg: RunConfig, out: Path, restore: list[str], zygote: Zygote | None) -> dict:
    """The body of an attempt: start the shards and workers (forked by `zygote` when given), wait.
    With --cpu-quota every child gets a CPU group of its own (psgd/train/cpulimit.py), removed after."""
    quotas = None
    if cfg.cpu_quota > 0:
        try:
            quotas = cpulimit.Quotas(str(out), cfg.cpu_quota)
        except OSError as e:
            raise UsageError(str(e)) from None
    try:
        return _start_and_wait_in(cfg, out, restore, zygote, quotas)
    finally:
        if quotas is not None:
            quotas.close()


def _start_and_wait_in(cfg: RunConfig, out: Path, restore: list[str], zygote: Zygote | None,
                       quotas: cpulimit.Quotas | None) -> dict:
    cache = cfg.data.cache_path()
    if cache is not None and not cache.exists():
        from psgd.train import data as data_mod  # noqa: PLC0415 - see the imports

        data_mod.load(cfg.data)  # fills the mnist1d cache once, before the workers race to make it
    seats = hosts.seats(cfg)  # where each child runs: loopback, or --hosts on a psgd cluster
    if seats.record is not None:
        (out / "cluster.json").write_text(json.dumps(seats.record, indent=1))
    if seats.note:
        print(seats.note, file=sys.stderr, flush=True)
    shard_flags, flags = roles.flags_for(seats.cfg, "shard"), roles.flags_for(seats.cfg, "worker")
    exe = [sys.executable, "-m", "psgd"]
    env = seats.environment(child_env(cfg))
    servers: list[Child] = []
    workers: list[Child] = []
    if cfg.mode == "allreduce":
        from psgd.allreduce.collective import launch_args  # noqa: PLC0415 - only the collective mode needs it

        worker_argv, env = launch_args(cfg.backend, cfg.device, cfg.workers, cfg.out, env)
    try:
        ps = cfg.mode != "allreduce"
        if ps:
            for k, seat in enumerate(seats.servers):
                argv = [*seat.prefix, *exe, "server", *shard_flags, *restore, "--shard", str(k), "--port", "0"]
                argv += ["--bind", seat.bind] if seat.bind else []
                # With --worker-lease, a worker death the launcher sees reaches the shards on stdin (_tell_lost).
                tolerant = cfg.worker_lease > 0
                argv += ["--lost-on-stdin"] if tolerant else []
                senv = {**env, cpulimit.ENV: str(quotas.group(f"server-{k}"))} if quotas else env
                name = proctitle.shard_name(k, cfg.servers)  # as `ps` shows it
                servers.append(Child(name, argv, out / "logs" / f"server-{k}.log", senv, capture_stdout=True,
                                     stdin_pipe=tolerant, zygote=zygote))
            # The workers start now, side by side with the servers (a process's start-up is mostly
            # importing torch), and read the shards' addresses from stdin once they have loaded.
            worker_argv = ["--servers-on-stdin"]
        for r in range(cfg.workers):
            # One host: the local rank is the rank (it picks worker r's GPU, psgd/core/devices.py, and
            # the all-reduce rendezvous reads both); set, so that an inherited $LOCAL_RANK cannot pin them all.
            wenv = {**env, "RANK": str(r), "LOCAL_RANK": str(r), **dict(seats.workers[r].env)}
            if quotas is not None:
                wenv[cpulimit.ENV] = str(quotas.group(f"worker-{r}"))
            name = proctitle.worker_name(r, cfg.workers)
            workers.append(Child(name, [*seats.workers[r].prefix, *exe, "worker", *flags, "--rank", str(r),
                                        *worker_argv], out / "logs" / f"worker-{r}.log", wenv, stdin_pipe=ps,
                                 zygote=zygote))
        restart = None
        if ps:
            addresses = ",".join(_read_ready(c, READY_TIMEOUT_S) for c in servers)
            for c in workers:
                try:
                    c.proc.stdin.write(f"{addresses}\n".encode())
                    c.proc.stdin.close()
                except BrokenPipeError:
                    pass  # that worker is gone already: _wait_workers names it
            # A restarted worker gets the shards' addresses at once, and no injected fault: the
            # fault is what it is being restarted from.
            again_flags = roles.flags_for(dataclasses.replace(seats.cfg, fail_at=()), "worker")

            def restart(c: Child) -> Child:
                r = str(_index(c))
                log = out / "logs" / f"worker-{r}.restart{len(list((out / 'logs').glob(f'worker-{r}.*.log'))) + 1}.log"
                seat = seats.workers[int(r)]
                again_env = {**env, "RANK": r, "LOCAL_RANK": r, **dict(seat.env)}
                if quotas is not None:
                    again_env[cpulimit.ENV] = str(quotas.group(f"worker-{r}"))
                return Child(c.name, [*seat.prefix, *exe, "worker", *again_flags, "--rank", r, "--servers", addresses],
                             log, again_env, zygote=zygote)
        _wait_workers(workers, servers, cfg, restart, zygote)
        _stop(servers)
        for c in servers:
            if c.proc.returncode != 0:
                raise RunFailed(f"{c.name} exited with code {c.proc.returncode}: {c.last_error()}")
    except KeyboardInterrupt:
        _stop(workers + servers)
        raise Interrupted(INTERRUPTED) from None
    except ShardDied:
        # SIGTERM first: each worker writes the step line it holds (psgd/train/work.py), so that the
        # restart's `reached` counts every step finished; then whatever is left is killed.
        _stop(workers, signal.SIGTERM)
        _stop(workers + servers, signal.SIGKILL)
        raise
    except BaseException:
        _stop(workers + servers, signal.SIGKILL)
        raise
    return _finish(cfg, zygote)


EVAL_LINE = "evaluating"  # `psgd summarize --of-run`'s stdout: `evaluating K N` before snapshot K of N


def _finish(cfg: RunConfig, zygote: Zygote | None) -> dict:
    """`finish`, in a child of the run's warm parent when there is one: it has torch loaded, so the
    launcher never imports it (about 3.5 s of CPU here, a third of a short run's; the suite's
    process, which has it, forks too and keeps its memory). The child reports each snapshot on
    stdout for the live line; its failure is the run's, in the same words. Without a zygote
    (--cold-start, cluster hosts) the launcher evaluates itself."""
    if zygote is None or zygote.gone:
        return finish(cfg)
    out = Path(cfg.out)
    argv = [sys.executable, "-m", "psgd", "summarize", str(out), "--of-run", json.dumps(to_dict(cfg))]
    child = Child("the evaluation", argv, out / "logs" / "finish.log", dict(os.environ), capture_stdout=True,
                  zygote=zygote)
    try:
        from psgd.train import progress  # noqa: PLC0415 - tqdm, for the live line only

        for line in child.proc.stdout:
            word, k, n = (line.decode().split() + ["", "", ""])[:3]
            if word == EVAL_LINE:
                progress.evaluating(int(k), int(n))
        code = child.proc.wait()
    except BaseException:
        _stop([child], signal.SIGKILL)
        raise
    if code != 0:
        raise RunFailed(child.last_error().removeprefix("psgd summarize: failed: "))
    return json.loads((out / "summary.json").read_text())


def finish(cfg: RunConfig, ds: data_mod.Dataset | None = None, on_eval=None) -> dict:
    """Evaluate the snapshots, write final_params.pt and summary.json (`psgd summarize` too).

    Raises RunFailed naming what is missing when the run has not ended. Run again on the same
    folder it gives the same files: the eval lines of an earlier call are replaced, not doubled.
    `ds`: the run's dataset, loaded here when not given. `on_eval(k, n)`: told before snapshot k
    of n is evaluated (default: the live line's `evaluating k/n`).
    """
    import torch  # noqa: PLC0415 - see the imports

    from psgd.core import codec  # noqa: PLC0415
    from psgd.train import data as data_mod  # noqa: PLC0415
    from psgd.train import evaluate, models, progress  # noqa: PLC0415

    out = Path(cfg.out)
    events = read_events(out / "metrics.jsonl")
    ends = [e for e in events if e.get("event") == "worker_end"]
    lost = {e["rank"] for e in events if e.get("event") == "worker_lost"} | _declared_lost(out, cfg)
    if len(ends) + len(lost - {e["rank"] for e in ends}) < cfg.workers:
        raise RunFailed(f"{out}: {len(ends)} of {cfg.workers} workers finished (worker_end in metrics.jsonl): "
                        "has the run ended?")
    owners = ["replica-0"] if cfg.mode == "allreduce" else [f"shard-{k}" for k in range(cfg.servers)]
    for name in owners:
        if not (out / f"{name}.pt").exists():
            who = "all-reduce rank 0" if cfg.mode == "allreduce" else f"server {name.split('-')[1]}"
            raise RunFailed(f"{out} has no {name}.pt: {who} has not stopped yet (it writes it when every "
                            "worker has left, or on Ctrl-C)")
    if any(e.get("event") == "eval" for e in events):
        kept = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events if e.get("event") != "eval")
        tmp = out / "metrics.jsonl.tmp"
        tmp.write_text(kept)
        os.replace(tmp, out / "metrics.jsonl")
    ds = ds or data_mod.load(cfg.data)
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    # Train loss on a fixed subset of about 10,000 targets: cheap (a text window holds 64 of them).
    subset = max(1, 10_000 // max(1, ds.y_train[0].numel()))
    x_tr, y_tr = ds.x_train[:subset], ds.y_train[:subset]
    if cfg.mode == "allreduce":
        snaps = torch.load(out / "replica-0.pt", weights_only=True)["snapshots"]
        final = snaps[-1][2]
        shard_stats: list[dict] = []
    else:
        snaps = evaluate.load_shard_snapshots(out, cfg.servers)
        final = evaluate.load_final_params(out, cfg.servers)
        shard_stats = [json.loads((out / f"shard-{k}.json").read_text()) for k in range(cfg.servers)]
    t0 = min(e["train_start"] for e in ends)
    metrics = Metrics(out / "metrics.jsonl")
    evals = []
    for version, t, params in evaluate.each_snapshot(snaps, on_eval or progress.evaluating):  # evaluating k/n
        test_loss, test_acc = evaluate.evaluate(model, params, ds.x_test, ds.y_test, cfg.model.loss)
        train_loss, train_acc = evaluate.evaluate(model, params, x_tr, y_tr, cfg.model.loss)
        e = dict(version=version, elapsed_s=max(0.0, t - t0), samples=version * samples_per_update(cfg),
                 test_loss=test_loss, test_accuracy=test_acc, train_loss=train_loss, train_accuracy=train_acc,
                 **_validation(cfg, model, params, ds))
        metrics.write(event="eval", **e)
        evals.append(e)
    metrics.close()
    if evals and torch.equal(final, snaps[-1][2]):
        # The last snapshot is the final state (a shard's is taken at shutdown): its numbers, not
        # the same evaluation twice (a sixth of a transformer run's evaluation, about 0.5 s).
        final_eval = {k: v for k, v in evals[-1].items()
                      if k in ("test_loss", "test_accuracy", "train_loss", "val_loss", "val_accuracy")}
    else:
        test_loss, test_acc = evaluate.evaluate(model, final, ds.x_test, ds.y_test, cfg.model.loss)
        train_loss, _ = evaluate.evaluate(model, final, x_tr, y_tr, cfg.model.loss)
        final_eval = dict(test_loss=test_loss, test_accuracy=test_acc, train_loss=train_loss,
                          **_validation(cfg, model, final, ds))
    torch.save(final, out / "final_params.pt")
    sha = codec.sha256(final)
    extra = None
    if cfg.mode == "allreduce":
        from psgd.allreduce.collective import summary_extra  # noqa: PLC0415 - only the collective mode needs it

        extra = summary_extra(out, sha)
    if (out / "cluster.json").exists():  # the hosts and the link a --hosts run used (psgd/train/hosts.py)
        extra = dict(extra or {}, cluster=json.loads((out / "cluster.json").read_text()))
    return summarize(out, cfg, evals + [final_eval], models.num_params(model), sha, shard_stats, extra)


def _declared_lost(out: Path, cfg: RunConfig) -> set[int]:
    """The ranks a shard declared lost (its lease ran out): a run without psgd run's launcher (by
    hand, torchrun, Slurm) has no worker_lost events, only the shards' word in shard-K.json."""
    if cfg.mode == "allreduce":
        return set()
    lost: set[int] = set()
    for k in range(cfg.servers):
        path = out / f"shard-{k}.json"
        if path.exists():
            lost |= {int(w) for w in json.loads(path.read_text()).get("lost_workers", {})}
    return lost


def _validation(cfg: RunConfig, model, params: torch.Tensor, ds: data_mod.Dataset) -> dict:
    """val_loss / val_accuracy of `params` on the validation split (none without --val-fraction)."""
    from psgd.train import evaluate  # noqa: PLC0415 - see the imports

    if len(ds.x_val) == 0:  # no split (--val-fraction 0); `text` always has one (by position)
        return {}
    val_loss, val_acc = evaluate.evaluate(model, params, ds.x_val, ds.y_val, cfg.model.loss)
    return dict(val_loss=val_loss, val_accuracy=val_acc)
