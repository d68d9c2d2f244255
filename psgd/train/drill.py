"""`psgd drill --chaos SEED:COUNT [psgd run's flags]`: a run under a seeded storm of SIGKILLs.

    psgd drill --chaos 7:12 --mode sync --workers 3 --servers 2 --steps 300 --checkpoint-every 25 \
        --dataset mnist1d --model mlp --calm

Contract:
- `plan(seed, count, cfg)` draws the storm from SEED alone: COUNT faults in episodes, each a target
  kind (shard, worker, zygote) and a moment:
  - `startup`: the first episode only: the target killed as soon as its process exists, before
    any step (the zygote while it loads torch: psgd/train/zygote.py starts a new one);
  - `step`: after a seeded number of steps since the last recovery, mid-training;
  - `checkpoint`: a shard killed in the middle of a checkpoint write: psgd/ps/checkpoint.py's drill
    hold (`$PSGD_CHECKPOINT_HOLD`) stops the next write after half its payload, and the drill
    kills that shard there: a torn temporary file is left, never read;
  - `join`: a worker killed mid-step, then its replacement killed while it rejoins (before its
    first step): two faults;
  - `restart`: a shard (or the zygote, which takes every process with it) killed mid-step, then
    a process of the restarted run (a new shard, or the new zygote while it loads) killed during
    that restart: two faults.
  Only kinds the run can survive are drawn: shards and the zygote mid-run need --restart-servers
  (with --checkpoint-every), workers --restart-workers; `drill` fills in both
  budgets (2 x COUNT + 2) where they are 0 and the run's flags allow them.
- `Storm` (a thread of the launcher's process, psgd/train/storm.py) carries the plan out while
  `launch.run` runs: it finds each target by its title (`psgd shard K/S OUT`,
  psgd/train/proctitle.py) among this process's descendants, SIGKILLs it and notes when, and after
  each episode waits until a step is written again (the run recovered) before the next one. It
  never kills anything else.
- `drill(cfg, seed, count)` returns the run's summary with a "faults" section, also written into
  OUT/summary.json: each fault (kind, target, pid, moment, at_s from the start, recovery_s: until
  the next step of that worker, or of any worker for a shard or the zygote), counts by kind and by
  moment, the updates lost (the run restarts' `updates_lost`), and the processes restarted (run
  restarts, worker restarts, zygote reloads, over every attempt). A fault the run cannot survive
  fails it with launch's one line (RunFailed); a process left behind after the run is a RunFailed too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

from psgd.core.config import RunConfig, validate
from psgd.train import launch, rundir
from psgd.train import storm as storm_mod
from psgd.train.storm import Fault, Storm

MOMENTS = ("startup", "step", "checkpoint", "join", "restart")
KINDS = ("shard", "worker", "zygote")


def parse_chaos(text: str) -> tuple[int, int]:
    seed, _, count = text.partition(":")
    if not (seed.isdigit() and count.isdigit() and int(count) >= 1):
        raise ValueError(f"--chaos takes SEED:COUNT (COUNT >= 1), got {text!r}")
    return int(seed), int(count)


def can_kill(cfg: RunConfig) -> dict[str, bool]:
    shards = cfg.restart_servers > 0 and cfg.checkpoint_every > 0
    return {"shard": shards, "worker": cfg.restart_workers > 0, "zygote": shards and not (cfg.hosts or False)}


def with_budgets(cfg: RunConfig, count: int) -> RunConfig:
    """--restart-servers / --restart-workers of 2 x COUNT + 2 where 0 and the flags allow them."""
    budget = 2 * count + 2
    if cfg.restart_workers == 0:
        try:
            cfg = validate(dataclasses.replace(cfg, restart_workers=budget))
        except ValueError:
            pass
    if cfg.restart_servers == 0:
        try:
            cfg = validate(dataclasses.replace(cfg, restart_servers=budget))
        except ValueError:
            pass
    return cfg


def plan(seed: int, count: int, cfg: RunConfig) -> list[list[Fault]]:
    """The storm: episodes of faults (see the module docstring), drawn from `seed` alone."""
    rng = random.Random(seed)
    ok = can_kill(cfg)
    kinds = [k for k in KINDS if ok[k]]
    if not kinds:
        raise ValueError("nothing to kill that this run survives: give --restart-workers N, or "
                         "--checkpoint-every K with --restart-servers N")
    counts = {"shard": cfg.servers, "worker": cfg.workers, "zygote": 1}

    def pick(kind: str) -> int:
        return rng.randrange(counts[kind])

    episodes: list[list[Fault]] = []
    n = 0
    if rng.random() < 0.5:
        kind = rng.choice(kinds)
        episodes.append([Fault(kind, pick(kind), "startup")])
        n += 1
    while n < count:
        options = ["step", "step"]
        if ok["shard"]:
            options += ["checkpoint", "restart"]
        if ok["worker"]:
            options.append("join")
        moment = rng.choice(options) if count - n >= 2 else rng.choice([o for o in options if o in ("step",
                                                                                                     "checkpoint")])
        if moment == "step":
            kind = rng.choice(kinds)
            episodes.append([Fault(kind, pick(kind), "step")])
        elif moment == "checkpoint":
            episodes.append([Fault("shard", -1, "checkpoint")])  # whichever shard writes next
        elif moment == "join":
            r = pick("worker")
            episodes.append([Fault("worker", r, "step"), Fault("worker", r, "join")])
        else:
            first = rng.choice([k for k in ("shard", "zygote") if ok[k]])
            then = rng.choice([k for k in ("shard", "zygote") if ok[k]])
            episodes.append([Fault(first, pick(first), "step"), Fault(then, pick(then), "restart")])
        n += len(episodes[-1])
    return episodes


def gap_of(cfg: RunConfig, count: int) -> int:
    """At most this many steps (of all workers) between one recovery and the next step-moment fault."""
    return max(2, cfg.steps * cfg.workers // (3 * count))


def drill(cfg: RunConfig, seed: int, count: int, quiet: bool = True) -> dict:
    """Run `cfg` under the storm of `plan(seed, count)`; the summary with its "faults" (module docstring)."""
    cfg = with_budgets(rundir.with_out_resolved(cfg), count)
    cfg = dataclasses.replace(cfg, out=str(Path(cfg.out).resolve()))
    episodes = plan(seed, count, cfg)
    rng = random.Random(seed + 1)
    gaps = [rng.randint(1, gap_of(cfg, count)) for _ in episodes]
    out = Path(cfg.out)
    cfg = rundir.fresh(cfg)  # prepared once here: launch.run takes the folder as it is
    hold = out / "drill"
    hold.mkdir(exist_ok=True)
    for p in hold.iterdir():
        p.unlink()
    from psgd.ps import checkpoint  # noqa: PLC0415 - its hook's name (torch loads here, after it anyway)

    saved = os.environ.get(checkpoint.HOLD)
    os.environ[checkpoint.HOLD] = str(hold)
    storm_mod.forget()
    storm = Storm(cfg, episodes, gaps, hold)
    storm.start()
    try:
        summary = launch.run(cfg, prepared=True)
    finally:
        storm.stop.set()
        storm.join()
        for p in hold.iterdir():
            p.unlink()  # a held write (none should be left) goes on
        if saved is None:
            os.environ.pop(checkpoint.HOLD, None)
        else:
            os.environ[checkpoint.HOLD] = saved
    left = storm_mod.titles(cfg.out)
    if left:
        raise launch.RunFailed(f"the drill left {', '.join(f'{n} (pid {p})' for p, n in left.items())} behind")
    summary["faults"] = account(cfg, seed, count, storm)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def account(cfg: RunConfig, seed: int, count: int, storm: Storm) -> dict:
    """The summary's \"faults\" section (module docstring): the storm's kills and the run's events."""
    out = Path(cfg.out)
    steps = storm_mod.steps_written(out)
    events = storm_mod.noted()
    faults = []
    for f in storm.done:
        since = f.at
        if f.kind != "worker":  # the run restarts: a step still in flight at the kill is not a recovery
            since = min((e["time"] for e in events if e.get("event") == "restart" and e["time"] > f.at), default=f.at)
        after = [e["time"] for e in steps if e["time"] > since and (f.kind != "worker" or e["rank"] == f.index)]
        f.recovery_s = round(min(after) - f.at, 3) if after else None
        faults.append(dict(kind=f.kind, target=f.target, pid=f.pid, moment=f.moment,
                           at_s=round(f.at - storm.started, 3), recovery_s=f.recovery_s,
                           **({"note": f.note} if f.note else {})))
    restarts = [e for e in events if e.get("event") == "restart"]  # each once (carried forward with its time)
    by = lambda key: {k: sum(1 for f in faults if f[key] == k) for k in sorted({f[key] for f in faults})}  # noqa: E731
    return dict(
        seed=seed, planned=count, delivered=len(faults), drill_error=storm.error or None,
        by_kind=by("kind"), by_moment=by("moment"), list=faults,
        updates_lost=sum(e.get("updates_lost", 0) for e in restarts),
        run_restarts=len(restarts),
        worker_restarts=sum(1 for e in events if e.get("event") == "worker_restarted"),
        zygote_restarts=sum(1 for e in events if e.get("event") == "zygote_restarted"),
        recovery_s=[f["recovery_s"] for f in faults])


def main(argv: list[str]) -> int:
    """`psgd drill --chaos SEED:COUNT [--calm] [psgd run's flags]` (see the module docstring)."""
    import sys  # noqa: PLC0415

    from psgd.core import config as C  # noqa: PLC0415
    from psgd.core.errors import Parser, UsageError  # noqa: PLC0415
    from psgd.train.roles import check_data, config_from_args  # noqa: PLC0415

    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    rest, chaos, calm = list(argv), None, False
    if "--calm" in rest:
        rest.remove("--calm")
        calm = True
    if "--chaos" in rest:
        i = rest.index("--chaos")
        chaos = rest[i + 1] if i + 1 < len(rest) else ""
        del rest[i:i + 2]
    if chaos is None:
        raise UsageError("psgd drill needs --chaos SEED:COUNT")
    try:
        seed, count = parse_chaos(chaos)
    except ValueError as e:
        raise UsageError(str(e)) from None
    parser = Parser(prog="psgd drill", description="psgd run's flags (its own: --chaos, --calm)")
    C.add_flags(parser)  # a run's settings, as psgd run takes them (not its --resume: a drill starts its own)
    args = parser.parse_args(rest)
    cfg = config_from_args(args)
    check_data(cfg)
    try:
        plan(seed, count, with_budgets(cfg, count))
    except ValueError as e:
        raise UsageError(str(e)) from None
    calm_sha = None
    try:
        if calm:
            calm_out = (cfg.out or "results/runs/drill") + "-calm"
            calm_sha = launch.run(dataclasses.replace(cfg, out=calm_out))["params_sha256"]
        s = drill(cfg, seed, count)
    except launch.RunFailed as e:
        print(f"psgd drill: failed: {e}", file=sys.stderr)
        return 1
    f = s["faults"]
    print(f"psgd drill: {f['delivered']} of {f['planned']} faults ({f['by_kind']}, {f['by_moment']}), "
          f"{f['updates_lost']} updates lost, {f['run_restarts']} run restarts, {f['worker_restarts']} worker "
          f"restarts, {f['zygote_restarts']} zygote restarts; params {s['params_sha256'][:12]}"
          + ("" if calm_sha is None else f" ({'equal to' if calm_sha == s['params_sha256'] else 'NOT'} the calm "
                                         f"run's {calm_sha[:12]})") + f" -> {Path(s.get('out', cfg.out))}")
    return 0 if calm_sha in (None, s["params_sha256"]) else 1
