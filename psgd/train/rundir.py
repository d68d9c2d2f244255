"""The run folder (--out): psgd's alone, prepared once per fresh start, and its first lines.

Contract:
- A MARKER file says the folder is psgd's. A new or empty folder is taken, an earlier run's folder
  has psgd's own files (OWN_FILES, OWN_GLOBS) replaced, and anything else (a file, a folder of
  other files) is refused with one line, exit 2: psgd never deletes what it did not write.
- No --out: `with_out_resolved` makes a new results/runs/<mode>-<time>, and results/runs/latest a
  link to it.
- `fresh(cfg)`: a fresh start's folder, prepared once: emptied of the last run's files, config.json
  written; a restart from scratch (psgd/train/restart.py) keeps its record and the run's earlier
  records of restarts (`CARRIED` events: of the run, of workers, of the warm parent), so that
  summary.json counts every restart of any number of attempts. The pre-flight does it
  for `psgd run` and `psgd.fit` (psgd/train/preflight.py), before the live line reads the folder;
  `launch.run` does it for each later fresh attempt and for callers that did not.
- Runs started by hand or by torchrun: the first process (`psgd server --shard 0`, or all-reduce
  rank 0) prepares the folder with `prepare_by_hand` (children of `psgd run` find $PSGD_LAUNCHED
  set and leave it to the launcher); worker 0 adds its settings to config.json
  (`record_worker_settings`).
- A run folder is locked while a run writes it: `lock(out)` takes an exclusive flock on OUT/LOCK
  (never removed, so that every run locks the same file) before any of its files is touched, and
  holds it until `unlock(out)` (launch.run's end) or the process's death (the kernel drops it). A
  second run into the folder is refused with one line naming the holder's pid, exit 2. Only the
  launcher holds it: its children are exec'd or forked by an exec'd zygote, which do not inherit it.
- `write_launch(out, by)`: the run's first line, when it started (summary.json's startup_s counts
  from it); `event(out, **fields)`: one line of the launcher's own in metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import json
import os
import time
from pathlib import Path

from psgd.core.config import RunConfig, leaves, to_dict
from psgd.core.errors import UsageError
from psgd.train.metrics import Metrics, process_start_time, read_events

MARKER = ".psgd-run"  # in every folder psgd made for a run: the proof that its files are psgd's
# The events of a run's life that a later attempt carries forward (a resume moves metrics.jsonl
# aside, a restart from scratch empties the folder): every restart, however many attempts ago.
CARRIED = ("restart", "worker_restarted", "zygote_restarted")
LOCK = ".psgd-lock"   # flock'ed by the run writing the folder; holds its pid
_HELD: dict[Path, int] = {}  # the folders this process holds: their lock files' descriptors
RUNS = Path("results/runs")
# Everything psgd writes into a run folder, and nothing else: what a rerun removes, so that no file
# of the last run (a trace of other steps, a checkpoint of other parameters) sits beside the new
# one's. The run's own files, the suite's provenance.json, `psgd trace RUN`'s default PNG and CSV,
# a checkpoint's temporary file left by a killed shard (psgd/ps/checkpoint.py).
OWN_FILES = ("metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "config.json", "final_params.pt", "rendezvous",
             "restart.json", "cluster.json", "provenance.json", "trace.png", "trace.csv")
OWN_GLOBS = ("shard-*.json", "shard-*.pt", "replica-*.json", "replica-*.pt", "logs/server-*.log",
             "logs/worker-*.log", "checkpoints/shard-*.ckpt", "checkpoints/.shard-*.tmp", "metrics-attempt-*.jsonl")
LAUNCHED = "PSGD_LAUNCHED"  # set in psgd run's children: the launcher prepared the run folder


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
    lock(out)  # before any file of another run's is removed
    for name in OWN_FILES:
        if name not in keep:
            (out / name).unlink(missing_ok=True)
    for pattern in OWN_GLOBS:
        for p in out.glob(pattern):
            p.unlink()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("psgd run folder\n")


def lock(out: Path) -> None:
    """Hold the run folder `out` for this process (see the module docstring); UsageError naming the
    holder's pid when another run holds it. Taking it again in the same process is a no-op."""
    key = out.resolve()
    if key in _HELD:
        return
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UsageError(f"--out {out} is being written by another run (pid {holder}): wait for it to end, "
                         "or give another folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = fd


def unlock(out: Path) -> None:
    """Let the run folder `out` go (a no-op when this process does not hold it)."""
    fd = _HELD.pop(out.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock; the file stays for the next run


def fresh(cfg: RunConfig) -> RunConfig:
    """A fresh start of `psgd run`: its folder resolved and prepared, config.json written. A restart
    from scratch (psgd/train/launch.py `run`) keeps the record of why, across the folder's fresh start."""
    cfg = with_out_resolved(cfg)
    out = Path(cfg.out)
    pending = json.loads((out / "restart.json").read_text()) if (out / "restart.json").exists() else None
    earlier = carried(out) if pending is not None else []  # a new run in an old folder carries nothing
    prepare_out(out)
    (out / "config.json").write_text(json.dumps(config_record(cfg), indent=1))
    if pending is not None:
        m = Metrics(out / "metrics.jsonl")
        for e in [*earlier, dict(event="restart", **pending)]:
            m.write(**e)
        m.close()
    return cfg


def carried(out: Path) -> list[dict]:
    """The CARRIED events of OUT/metrics.jsonl (none without one), as they were written (times kept)."""
    metrics = out / "metrics.jsonl"
    return [e for e in read_events(metrics) if e.get("event") in CARRIED] if metrics.exists() else []


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
    write_launch(out, "hand")


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


_LAUNCHED_BEFORE: list[float] = []  # when each run of this process began (the suite makes many)


def write_launch(out: Path, by: str) -> None:
    """The run's first line: when it started (summary.json's startup_s counts from it). The first
    run of a process started with the process (its imports are start-up); a later run of the same
    process (the suite's) starts when it is launched, not when the suite did."""
    began = time.time() if _LAUNCHED_BEFORE else process_start_time()
    _LAUNCHED_BEFORE.append(began)
    event(out, event="launch", by=by, process_start=began)


def event(out: Path | str, **fields) -> None:
    """One line of the launcher's own in OUT/metrics.jsonl (a launch, a restart, a worker lost)."""
    m = Metrics(Path(out) / "metrics.jsonl")
    m.write(**fields)
    m.close()
