"""Metrics: JSON lines appended by every process to OUT/metrics.jsonl, and OUT/summary.json.

Contract:
- `Metrics(path).write(event=..., **fields)` appends one JSON object per line. Each line is one
  `os.write` on an O_APPEND descriptor, so the lines of concurrent processes never interleave.
  `defer(**fields)` keeps one line, timed then, for the next `flush` (or write, defer, close): the
  worker's step lines, written while the shards answer the next push.
- A torn line (a write cut short by a full disk, the file cut by hand) never takes the run with it:
  `read_events` leaves out a line that is not a JSON object, and a `Metrics` that opens a file
  whose last line has no newline ends it first, so a resumed run's lines start on lines of their own.
- `summarize(out, cfg, evals, final)` builds summary.json from the workers' `worker_end`
  events, the shards' `shard-K.json` stats and the offline evaluation (psgd/train/evaluate.py);
  `final_val_loss` / `final_val_accuracy` are None without a validation split (--val-fraction).
  Field meanings are in docs/architecture.md; `time_breakdown_s` is seconds per worker,
  averaged over workers; `startup_s` runs from the first process's start (`process_start` of
  the launcher's `launch` event, the shards' `shard_end`, the workers' `worker_end`) to the start
  barrier's release, apart from `wall_time_s`, which runs from there to the last worker's end.
  Its record of the run's life (membership, lost and restarted workers, devices, remedies,
  dropped gradients) is psgd/train/runlog.py's.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from psgd.core.config import RunConfig, to_dict
from psgd.train import runlog

_IMPORTED = time.time()


def process_start_time() -> float:
    """When this process started (unix time), from the kernel's record (Linux), so that start-up
    counts the interpreter's and torch's imports too; elsewhere, when this module was imported."""
    try:
        # Field 22 of /proc/self/stat (starttime, clock ticks after boot); the command name in
        # field 2 may hold spaces, so count from its closing parenthesis.
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


class Metrics:
    """Appends JSON lines to `path`; the file is opened at the first write, not before, so that a
    run folder prepared after this object was made (a by-hand or torchrun run's rank 0 clears it
    at start) gets every line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self._pending: dict | None = None  # a deferred line (`defer`), not written yet

    def write(self, **fields) -> None:
        self.flush()
        self._write(fields)

    def defer(self, **fields) -> None:
        """The line of `fields`, timed now, written by the next `flush`, `write`, `defer` or
        `close`: a worker defers its step's line and its exchange flushes it while the shards
        answer the next push (psgd/ps/exchange.py `while_waiting`), off the step's critical path
        (a visible share of a small model's step). Lines keep their order; a worker stopped by
        SIGTERM writes it first (psgd/train/work.py), and only a SIGKILL loses it."""
        self.flush()
        fields.setdefault("time", time.time())
        self._pending = fields

    def flush(self) -> None:
        line = self._pending
        if line is not None:
            # Cleared after the write: a signal handler's flush that runs in between (psgd/train/work.py)
            # writes the line twice, never loses it.
            self._write(line)
            self._pending = None

    def _write(self, fields: dict) -> None:
        fields.setdefault("time", time.time())
        line = (json.dumps(fields, separators=(",", ":")) + "\n").encode()
        first = self.fd is None
        if first:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        # Every writer of the file (workers, shards, the launcher) appends under its lock: a line
        # is one write, and the check below cannot see another process's append half-copied (a
        # line across a page boundary is copied a page at a time, its size ahead of its last
        # byte), which it took for a torn line and ended with a blank one.
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            if first:
                size = os.fstat(self.fd).st_size
                if size and os.pread(self.fd, 1, size - 1) != b"\n":
                    line = b"\n" + line  # a torn last line (its writer killed) ends here, not inside ours
            os.write(self.fd, line)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.flush()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_events(path: str | Path) -> list[dict]:
    """The events of a metrics file, in its order; a torn line (not a JSON object) is left out."""
    p = Path(path)
    if not p.exists():
        return []
    events = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(e, dict):
            events.append(e)
    return events


def hist_stats(hist: Counter) -> dict:
    """mean / p50 / p99 / max of a value -> count histogram."""
    if not hist:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0, "hist": {}}
    values = np.array(sorted(hist), dtype=np.float64)
    counts = np.array([hist[v] for v in sorted(hist)], dtype=np.float64)
    cdf = np.cumsum(counts) / counts.sum()

    def pct(q: float) -> float:
        return float(values[np.searchsorted(cdf, q)])

    return {"mean": float((values * counts).sum() / counts.sum()), "p50": pct(0.5), "p99": pct(0.99),
            "max": int(values.max()), "hist": {str(int(v)): int(hist[v]) for v in sorted(hist)}}


def samples_per_update(cfg: RunConfig) -> int:
    """Training samples behind one parameter update: a global batch in sync / all-reduce (H of
    them with --local-steps H, where one update is one averaging round), one worker's
    (accumulated) batch in async / SSP, where every gradient is its own update."""
    if cfg.mode in ("sync", "allreduce"):
        return cfg.global_batch * cfg.local_steps
    return cfg.batch_size * cfg.accumulate


def summarize(out: Path, cfg: RunConfig, evals: list[dict], params: int, params_sha256: str,
              shard_stats: list[dict], extra: dict | None = None) -> dict:
    """Write OUT/summary.json from the workers' events, the evaluations and the shards' stats; returns it."""
    events = read_events(out / "metrics.jsonl")
    ends = [e for e in events if e.get("event") == "worker_end"]
    if not ends:
        raise RuntimeError(f"no worker_end events in {out / 'metrics.jsonl'}: did any worker finish?")
    start = min(e["train_start"] for e in ends)
    wall = max(e["train_end"] for e in ends) - start + _earlier_training_s(out)
    summary = {**_figures(cfg, events, _with_every_step(out, events, ends), shard_stats, evals, params, start, wall),
               **runlog.life(cfg, events, ends, shard_stats, params, start, wall),
               "params_sha256": params_sha256, "config": to_dict(cfg)}
    summary.update(extra or {})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _earlier_training_s(out: Path) -> float:
    """The training time of a resumed run's earlier attempts (metrics-attempt-N.jsonl): from each
    one's first step line to its last, so that a run resumed k times reports all of its training."""
    total = 0.0
    for path in sorted(out.glob("metrics-attempt-*.jsonl")):
        times = [e["time"] for e in read_events(path) if e.get("event") == "step" and "time" in e]
        total += max(times) - min(times) if times else 0.0
    return total


def _with_every_step(out: Path, events: list[dict], ends: list[dict]) -> list[dict]:
    """The workers' `worker_end`s with `steps` as every counted step line of that rank holds, across
    this attempt and a resumed run's earlier ones, each clock once: a worker killed (its lease ran
    out) or restarted, or a run resumed, keeps the steps its earlier processes made. A rank with no
    step lines keeps its own count; a rank lost before any `worker_end` gets one of its own."""
    clocks: dict[int, set[int]] = {}
    earlier = [read_events(p) for p in sorted(out.glob("metrics-attempt-*.jsonl"))]
    for e in [e for attempt in earlier for e in attempt] + events:
        if e.get("event") == "step" and e.get("counted", True) and "rank" in e and "clock" in e:
            clocks.setdefault(int(e["rank"]), set()).add(int(e["clock"]))
    by_rank = {int(e["rank"]): e for e in ends}
    zero = {k: 0.0 for k in ("compute_s", "push_s", "pull_s", "wait_s", "bytes_pushed", "bytes_pulled")}
    merged = []
    for rank in sorted(set(by_rank) | set(clocks)):
        end = by_rank.get(rank) or {**zero, "rank": rank, "steps": 0}
        merged.append({**end, "steps": max(int(end["steps"]), len(clocks.get(rank, ())))})
    return merged


def _figures(cfg: RunConfig, events: list[dict], ends: list[dict], shard_stats: list[dict], evals: list[dict],
             params: int, start: float, wall: float) -> dict:
    """summary.json's run, its speed, its final losses, staleness, bytes and time split."""
    # Start-up: from the first process of the run (the launcher, or the first server / worker
    # started by hand) to the start barrier's release; none of it is in wall time.
    launched = [e["process_start"] for e in events if "process_start" in e]
    startup = start - min(launched) if launched else None
    worker_steps = sum(e["steps"] for e in ends)
    # Each gradient once: every shard applies every push, so the shards' histograms pooled counted a
    # gradient once per shard (400 for 200 pushed); shard 0's is the run's.
    staleness = Counter({int(k): v for k, v in shard_stats[0]["staleness_hist"].items()} if shard_stats else {})
    if shard_stats:
        global_updates = max(s["version"] for s in shard_stats)
    else:  # all-reduce: every step is one global update (every H-th one with --local-steps H)
        global_updates = min(e["steps"] for e in ends) // cfg.local_steps
    final = evals[-1] if evals else {}
    ended = [e for e in ends if "train_start" in e] or ends  # the time split: the processes that ended
    return {
        "mode": cfg.mode, "workers": cfg.workers, "servers": cfg.servers if cfg.mode != "allreduce" else 0,
        "clock_gap_bound": cfg.staleness if cfg.mode == "ssp" else (0 if cfg.mode in ("sync", "allreduce") else None),
        "model": cfg.model.model, "dataset": cfg.data.dataset, "params": params,
        "global_batch": cfg.global_batch, "global_updates": global_updates, "worker_steps": worker_steps,
        "startup_s": startup, "wall_time_s": wall, "updates_per_s": global_updates / wall if wall > 0 else 0.0,
        "worker_steps_per_s": worker_steps / wall if wall > 0 else 0.0,
        "samples_per_s": worker_steps * cfg.batch_size * cfg.accumulate / wall if wall > 0 else 0.0,
        "final_train_loss": final.get("train_loss"), "final_test_loss": final.get("test_loss"),
        "final_test_accuracy": final.get("test_accuracy"),
        "final_val_loss": final.get("val_loss"), "final_val_accuracy": final.get("val_accuracy"),
        "staleness": hist_stats(staleness),
        "max_clock_gap": max((s["max_clock_gap"] for s in shard_stats), default=0),
        "bytes_pushed": sum(e["bytes_pushed"] for e in ends), "bytes_pulled": sum(e["bytes_pulled"] for e in ends),
        # Per worker step (a local step with --local-steps H: it falls as 1/H, DiLoCo's saving).
        "bytes_per_step": (sum(e["bytes_pushed"] + e["bytes_pulled"] for e in ends)
                           / max(1, sum(e["steps"] for e in ends))),
        "time_breakdown_s": {k: sum(e[f"{k}_s"] for e in ended) / len(ended)
                             for k in ("compute", "push", "pull", "wait")},
        "per_worker_steps": {str(e["rank"]): e["steps"] for e in sorted(ends, key=lambda e: e["rank"])},
        "samples_per_worker": {str(e["rank"]): e["steps"] * cfg.batch_size * cfg.accumulate
                               for e in sorted(ends, key=lambda e: e["rank"])},
    }
