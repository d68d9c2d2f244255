"""`psgd run`: start K shard servers and N workers as processes of this same CLI, wait, evaluate.

Contract:
- Children run `psgd server|worker <the run's flags>`: exactly the commands you would run by hand
  on other hosts (psgd/train/roles.py `flags_for`). By default each is a fork of a warm parent that
  loaded torch once (psgd/train/zygote.py, psgd/train/warm.py); with --cold-start or --hosts each
  is that command, exec'd. Servers bind 127.0.0.1 on port 0 and print `READY host:port`. The
  workers start at the same time and get the addresses on stdin (`--servers-on-stdin`), so that
  their start-up (importing torch, above all) overlaps the servers'. With --hosts H each child runs
  on a host of a `psgd cluster` instead (psgd/train/hosts.py, which also records the hosts in
  OUT/cluster.json and summary.json's "cluster").
- The launcher waits for any child to exit, no polling, and on any failure stops every other child
  and fails naming the process (psgd/train/supervise.py). Ctrl-C stops all children too
  (`Interrupted`), before the interrupt leaves `run`. Children ask for PR_SET_PDEATHSIG first
  thing (psgd/train/lifeline.py), so even a SIGKILLed launcher leaves no process behind.
- The run folder is prepared once per fresh start (psgd/train/rundir.py `fresh`: by the pre-flight,
  psgd/train/preflight.py, when `prepared`; here otherwise). When the workers finish they tell the
  shards (Leave), and the servers write their stats and snapshots and exit by themselves (the
  launcher's SIGTERM is the fallback); then the snapshots are evaluated and OUT/summary.json
  written (psgd/train/finish.py), in a fork of the warm parent when there is one.
- --resume and --restart-servers: an attempt restores the shards from the newest checkpoint all
  hold; a dead shard ends the attempt and, while restarts remain, starts the next
  (psgd/train/restart.py). With --cpu-quota every child gets a CPU group of its own
  (psgd/train/cpulimit.py), removed after the attempt.
- The launcher imports torch (and what imports it) only where it needs it, after training: before
  the children start that import would be on every run's start-up, and during training it would
  compete with the children for the cores.
- What it does is logged to the `psgd.train.launch` logger (`logging`; psgd/__init__.py): each
  attempt, the shards' addresses, the evaluation and the summary at INFO / DEBUG; a restart and a
  cluster's caveat as the warnings `psgd run` shows on stderr (psgd/cli.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from psgd.core.config import RunConfig
from psgd.core.errors import UsageError
from psgd.train import cpulimit, finish, hosts, proctitle, restart, roles, rundir, supervise

# What `run` raises, for its callers to catch.
from psgd.train.supervise import Child, Interrupted, RunFailed, ShardDied  # noqa: F401
from psgd.train.warm import Zygote

EXE = [sys.executable, "-m", "psgd"]
log = logging.getLogger(__name__)


def run(cfg: RunConfig, resume: bool = False, cold_start: bool = False, zygote: Zygote | None = None,
        tensorboard: Path | None = None, prepared: bool = False, live_eval: bool = False) -> dict:
    """Run one training job end to end; returns the summary. Raises RunFailed, or UsageError for an
    --out that is not psgd's to write (an empty --out gets a folder of its own).
    `resume`: continue the stopped run in cfg.out from its checkpoints (restart.py `resumable`).
    `cold_start`: every child execs `python -m psgd ...` instead of being forked by the run's warm
    parent; for debugging, and the same results. `zygote`: a warm parent that outlives this run
    (`warm_parent`: the suite forks every run's processes from one); this run neither starts nor
    closes it (a gone one is replaced by a zygote of the run's own). `tensorboard`: a folder for
    the run's curves, written while it trains (psgd/train/tboard.py `Follower`); `live_eval`: with
    it, the checkpoints evaluated while the run trains (psgd/train/liveeval.py). `prepared`: the
    caller made cfg.out the run's fresh folder (rundir.py `fresh`), so the first attempt takes it.

    --restart-servers N: when a shard dies, every process is stopped and the run goes on from the
    newest checkpoint all shards have (the same path as --resume), at most N times (restart.py
    `after`; summary.json lists them). The workers are restarted too: in sync every shard and
    worker must go back to one step, and the checkpoint is that step."""
    restarts = 0
    own: list[Zygote] = []  # the run's own warm parent, kept across restarts: torch is loaded once
    if resume:  # a fresh start locks its folder as it prepares it (rundir.py `fresh`); a resumed one here
        rundir.lock(Path(cfg.out))
    try:
        while True:
            try:
                with _attempt(cfg, resume, cold_start, zygote, (tensorboard, live_eval), prepared, own) as crew:
                    cfg = crew.cfg
                    with _children(crew):
                        supervise.wait_workers(crew.workers, crew.servers, cfg, crew.restart, crew.zygote)
                    log.debug("%s: training ended; evaluating its snapshots", cfg.out)
                    summary = finish.in_fork(cfg, crew.zygote)
                    log.info("%s: finished, %s updates, summary in %s", cfg.out, summary.get("global_updates"),
                             Path(cfg.out) / "summary.json")
                    return summary
            except ShardDied as e:
                cfg, resume = restart.after(cfg, e, restarts)
                restarts, prepared = restarts + 1, False
    finally:
        for parent in own:
            parent.close()
        if cfg.out:  # the run's folder, free for the next run (the lock dies with this process anyway)
            rundir.unlock(Path(cfg.out))


def warm_parent(tag: str = "suite") -> Zygote:
    """A warm parent for many runs (`run(..., zygote=)`); its children get each run's own environment."""
    return Zygote.start(tag, supervise.child_env())


@dataclasses.dataclass
class Crew:
    """One attempt's processes and what starts them: its config, restore flags, warm parent, CPU groups."""
    cfg: RunConfig
    restore: list[str]
    zygote: Zygote | None
    quotas: cpulimit.Quotas | None
    servers: list[Child] = dataclasses.field(default_factory=list)
    workers: list[Child] = dataclasses.field(default_factory=list)
    seats: hosts.Seats | None = None
    env: dict = dataclasses.field(default_factory=dict)
    addresses: str = ""

    def child(self, name: str, seat: hosts.Seat, argv: list[str], log: str, group: str, env: dict,
              **pipes: bool) -> Child:
        """`psgd ARGV` as child `name`, on its seat, logging to OUT/logs/LOG, in CPU group `group`."""
        env = {**env, cpulimit.ENV: str(self.quotas.group(group))} if self.quotas else env
        return Child(name, [*seat.prefix, *EXE, *argv], Path(self.cfg.out) / "logs" / log, env,
                     zygote=self.zygote, **pipes)

    def worker(self, r: int, argv: list[str], log: str, stdin_pipe: bool) -> Child:
        """`psgd worker ARGV` as worker `r`. One host: the local rank is the rank (it picks worker r's
        GPU, psgd/core/devices.py, and the all-reduce rendezvous reads both); set, so that an
        inherited $LOCAL_RANK cannot pin them all."""
        seat = self.seats.workers[r]
        env = {**self.env, "RANK": str(r), "LOCAL_RANK": str(r), **dict(seat.env)}
        return self.child(proctitle.worker_name(r, self.cfg.workers), seat, ["worker", *argv], log, f"worker-{r}",
                          env, stdin_pipe=stdin_pipe)

    def restart(self, c: Child) -> Child:
        """Worker `c` again (--restart-workers): the shards' addresses at once, and no injected
        fault: the fault is what it is being restarted from."""
        r = supervise.index(c)
        logs = Path(self.cfg.out) / "logs"
        log = f"worker-{r}.restart{len(list(logs.glob(f'worker-{r}.*.log'))) + 1}.log"
        flags = roles.flags_for(dataclasses.replace(self.seats.cfg, fail_at=()), "worker")
        return self.worker(r, [*flags, "--rank", str(r), "--servers", self.addresses], log, stdin_pipe=False)


@contextlib.contextmanager
def _attempt(cfg: RunConfig, resume: bool, cold_start: bool, shared: Zygote | None,
             view: tuple[Path | None, bool], prepared: bool, own: list[Zygote]) -> Iterator[Crew]:
    """One attempt's folder, warm parent, TensorBoard follower and CPU groups, closed on the way out
    but for the warm parent: the run's own (in `own`, started by its first attempt, or again when
    it died) serves every attempt, and `run` closes it. It loads torch while the launcher prepares;
    on cluster hosts each child enters its namespace by exec (`ip netns exec`), so there, and with
    --cold-start, every child execs."""
    restore: list[str] = []
    if resume:
        restore = restart.restore_flags(cfg)
        restart.carry_over(Path(cfg.out))
    elif not prepared:
        cfg = rundir.fresh(cfg)
    out = Path(cfg.out)
    rundir.write_launch(out, "psgd run --resume" if resume else "psgd run")
    forks = not (cold_start or cfg.hosts)
    mine = forks and (shared is None or shared.gone)
    log.info("%s: %s%s run, %d workers, %d shards; children %s", out, "resumed " if resume else "", cfg.mode,
             cfg.workers, 0 if cfg.mode == "allreduce" else cfg.servers,
             "exec'd" if not forks else "forked from the run's warm parent" if mine else "forked from a shared parent")
    if mine and not (own and not own[-1].gone):
        own.append(Zygote.start(str(out), supervise.child_env(cfg), reloads=cfg.restart_servers + cfg.restart_workers,
                                on_reload=lambda how: _zygote_reloaded(cfg, how)))
    zygote = own[-1] if mine else (shared if forks else None)
    follower = quotas = None
    tensorboard, live_eval = view
    try:
        if tensorboard is not None:
            from psgd.train import tboard  # noqa: PLC0415 - only runs that ask for it

            follower = tboard.Follower(out, tensorboard, cfg.workers, live_eval)
        if cfg.cpu_quota > 0:
            try:
                quotas = cpulimit.Quotas(str(out), cfg.cpu_quota)
            except OSError as e:
                raise UsageError(str(e)) from None
        yield Crew(cfg, restore, zygote, quotas)
    finally:
        if quotas is not None:
            quotas.close(record=out / "cpu-quota.json")
        if follower is not None:
            follower.close()


def _zygote_reloaded(cfg: RunConfig, how: str) -> None:
    """The run's zygote died while it loaded (nothing forked yet): a new one is on its way."""
    log.warning("psgd run: the zygote %s while loading; starting a new one (--restart-servers / --restart-workers)",
                how)
    rundir.event(cfg.out, event="zygote_restarted", how=how)


@contextlib.contextmanager
def _children(crew: Crew) -> Iterator[None]:
    """The attempt's shards and workers, started; on the way out the servers end (SIGTERM, the
    fallback to their own exit) and must have exited 0. On a failure every child is stopped:
    Ctrl-C is `Interrupted`; a dead shard first gets each worker SIGTERM, so that it writes the
    step line it holds (psgd/train/work.py) and the restart's `reached` counts every finished step."""
    try:
        _start(crew)
        yield
        supervise.stop(crew.servers)
        for c in crew.servers:
            if c.proc.returncode != 0:
                raise RunFailed(f"{c.name} exited with code {c.proc.returncode}: {c.why(crew.servers)}")
    except KeyboardInterrupt:
        supervise.stop(crew.workers + crew.servers)
        raise Interrupted(supervise.INTERRUPTED) from None
    except ShardDied:
        supervise.stop(crew.workers, signal.SIGTERM)
        supervise.stop(crew.workers + crew.servers, signal.SIGKILL)
        raise
    except BaseException:
        supervise.stop(crew.workers + crew.servers, signal.SIGKILL)
        raise


def _start(crew: Crew) -> None:
    """Start the shards and the workers side by side, then hand the workers the shards' addresses."""
    cfg = crew.cfg
    cache = cfg.data.cache_path()
    if cache is not None and not cache.exists():
        from psgd.train import data as data_mod  # noqa: PLC0415 - torch: only when the cache is missing

        data_mod.load(cfg.data)  # fills the mnist1d cache once, before the workers race to make it
    crew.seats = seats = hosts.seats(cfg)  # where each child runs: loopback, or --hosts on a psgd cluster
    if seats.record is not None:
        (Path(cfg.out) / "cluster.json").write_text(json.dumps(seats.record, indent=1))
    if seats.note:
        log.warning("%s", seats.note)
    crew.env = seats.environment(supervise.child_env(cfg))
    tail = ["--servers-on-stdin"]  # the workers read the shards' addresses once they have loaded
    if cfg.mode == "allreduce":
        from psgd.allreduce.collective import launch_args  # noqa: PLC0415 - only the collective mode needs it

        tail, crew.env = launch_args(cfg.backend, cfg.device, cfg.workers, cfg.out, crew.env)
    tolerant = cfg.worker_lease > 0  # a worker death the launcher sees reaches the shards on stdin
    shard_flags = [*roles.flags_for(seats.cfg, "shard"), *crew.restore, *(["--lost-on-stdin"] if tolerant else [])]
    for k, seat in enumerate(seats.servers if cfg.mode != "allreduce" else ()):
        argv = ["server", *shard_flags, "--shard", str(k), "--port", "0", *(["--bind", seat.bind] if seat.bind else [])]
        crew.servers.append(crew.child(proctitle.shard_name(k, cfg.servers), seat, argv, f"server-{k}.log",
                                       f"server-{k}", crew.env, capture_stdout=True, stdin_pipe=tolerant))
    flags = roles.flags_for(seats.cfg, "worker")
    for r in range(cfg.workers):
        crew.workers.append(crew.worker(r, [*flags, "--rank", str(r), *tail], f"worker-{r}.log",
                                        stdin_pipe=cfg.mode != "allreduce"))
    log.debug("%s: started %d shards and %d workers", cfg.out, len(crew.servers), len(crew.workers))
    if crew.servers:
        crew.addresses = ",".join(supervise.read_ready(c) for c in crew.servers)
        log.debug("%s: shards ready at %s; handing the workers their addresses", cfg.out, crew.addresses)
        for c in crew.workers:
            try:
                c.proc.stdin.write(f"{crew.addresses}\n".encode())
                c.proc.stdin.close()
            except BrokenPipeError:
                pass  # that worker is gone already: wait_workers names it
