"""Attempts, resume and restart: what carries a run from one attempt to the next.

Contract:
- `resumable(out)`: the config of a stopped run in `out` that `psgd run --resume OUT` (psgd/train/
  launch.py `run(cfg, resume=True)`) can continue; a UsageError saying why not otherwise (no
  checkpoints, local SGD).
- `restore_flags(cfg)`: the shards' `--restore DIR --restore-upto V`, V the newest checkpoint
  version every shard holds intact (`resume_version`; RunFailed when there is none); for an async or
  SSP run of several shards also `--restore-clocks`, each worker at the highest clock any shard's
  checkpoint holds it at (`aligned_clocks`: the shards count a worker's pushes apart; the pushes a
  shard then skips are lost, as the updates after the checkpoint are).
- `carry_over(out)`: a resumed attempt's metrics.jsonl starts with the restarts of the attempts
  before it (of the run, of workers, of the warm parent: rundir.py `CARRIED`); the stopped
  attempt's lines are kept apart, as metrics-attempt-N.jsonl.
- `after(cfg, died, restarts)`: a shard died (ShardDied): with --restart-servers left, the config
  and resume flag of the next attempt (from the newest common checkpoint, or from scratch when
  there is none yet), the restart noted in OUT/restart.json for it (which shard, how, the version
  reached, the one resumed from, the updates lost between them) and said as a warning (this
  module's logger, which `psgd run` prints as its line); otherwise the error is raised.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from psgd.core.config import RunConfig, from_dict
from psgd.core.errors import UsageError
from psgd.train import rundir
from psgd.train.metrics import Metrics, read_events
from psgd.train.rundir import MARKER
from psgd.train.supervise import ClocksSplit, RunFailed, ShardDied

log = logging.getLogger(__name__)


def resumable(out: Path) -> RunConfig:
    """The config of a stopped run in `out` that can be continued (see the module docstring)."""
    if not (out / MARKER).exists() or not (out / "config.json").is_file():
        raise UsageError(f"--resume {out}: not a psgd run folder (no {MARKER} and config.json)")
    cfg = from_dict(json.loads((out / "config.json").read_text()))
    if cfg.mode == "allreduce" or not cfg.checkpoint_every:
        raise UsageError(f"--resume {out}: the run wrote no checkpoints (it needs --checkpoint-every K)")
    if cfg.local_steps > 1:
        raise UsageError(f"--resume {out}: local SGD (--local-steps) runs do not resume")
    # An injected fault (--fail-at) is how the first attempt was stopped, not part of the training
    # to continue: the resumed run goes on without it.
    return dataclasses.replace(cfg, fail_at=())


def checkpoint_versions(cfg: RunConfig) -> set[int]:
    """The checkpoint versions every shard of the run holds intact."""
    from psgd.ps import checkpoint  # noqa: PLC0415 - torch: the launcher loads it only on a restart

    folder = Path(cfg.out) / "checkpoints"
    return set.intersection(*(set(checkpoint.versions(folder, k)) for k in range(cfg.servers)))


def resume_version(cfg: RunConfig) -> int:
    """The newest checkpoint version that every shard of the run has intact."""
    common = checkpoint_versions(cfg)
    if not common:
        raise RunFailed(f"{Path(cfg.out) / 'checkpoints'}: no checkpoint version that all {cfg.servers} shards "
                        "have intact")
    return max(common)


def restore_flags(cfg: RunConfig) -> list[str]:
    """The shards' flags that restore a resumed attempt (see the module docstring)."""
    version = resume_version(cfg)
    flags = ["--restore", str(Path(cfg.out) / "checkpoints"), "--restore-upto", str(version)]
    if cfg.mode != "sync" and cfg.servers > 1:
        flags += ["--restore-clocks", ",".join(map(str, aligned_clocks(cfg, version)))]
    return flags


def aligned_clocks(cfg: RunConfig, version: int) -> list[int]:
    """Each worker's clock for every shard of an async or SSP run resumed at `version`: the highest any
    shard's checkpoint holds it at. Why: such shards apply pushes in the order they come, so their
    checkpoints of one version count each worker's pushes apart, and a worker's steps must have one
    number; a shard that holds it lower skips the pushes between (lost, as a restart's updates are)."""
    from psgd.ps import checkpoint  # noqa: PLC0415 - torch: the launcher loads it only on a restart

    folder = Path(cfg.out) / "checkpoints"
    held = [checkpoint.newest(folder, k, upto=version) for k in range(cfg.servers)]
    if any(h is None for h in held):
        raise RunFailed(f"{folder}: a shard's checkpoint of version {version} is no longer intact")
    slots = len(held[0][0]["clocks"])  # one per worker slot (--max-workers adds slots), as the shards keep them
    return [max(state["clocks"][w] for state, _ in held) for w in range(slots)]


def carry_over(out: Path) -> None:
    """A resumed attempt's metrics.jsonl (see the module docstring)."""
    metrics = out / "metrics.jsonl"
    earlier = rundir.carried(out)
    if metrics.exists():  # the stopped attempt's lines, kept apart
        n = len(list(out.glob("metrics-attempt-*.jsonl"))) + 1
        os.replace(metrics, out / f"metrics-attempt-{n}.jsonl")
    m = Metrics(metrics)
    for e in earlier:
        m.write(**e)
    if (out / "restart.json").exists():
        m.write(event="restart", **json.loads((out / "restart.json").read_text()))
        (out / "restart.json").unlink()
    m.close()


def after(cfg: RunConfig, died: ShardDied, restarts: int) -> tuple[RunConfig, bool]:
    """The next attempt's config and resume flag after `died`, the `restarts`-th restart so far
    (see the module docstring); raises when --restart-servers has none left."""
    if restarts >= cfg.restart_servers:
        if isinstance(died, ClocksSplit):
            raise died.final() from None
        raise died
    # A shard that died before any checkpoint (while starting, say) restarts the run from
    # scratch: nothing was lost that a checkpoint would have kept.
    scratch = not checkpoint_versions(cfg)
    log.warning("psgd run: %s; restart %d of %d %s", died, restarts + 1, cfg.restart_servers,
                "from scratch (no checkpoint yet)" if scratch else "from the newest checkpoint")
    # Injected faults stopped this attempt; they are not part of the training to continue.
    cfg = dataclasses.replace(cfg, fail_at=(), fail_shard_at=())
    _note(Path(cfg.out), died, 0 if scratch else resume_version(cfg))
    return cfg, not scratch


def _note(out: Path, died: ShardDied, resumed_from: int) -> None:
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
