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
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from psgd.core.config import RunConfig, to_dict

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
        (~45 us of a 1.8 ms step of the 256-wide MLP). Lines keep their order; a worker stopped by
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
        if self.fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            size = os.fstat(self.fd).st_size
            if size and os.pread(self.fd, 1, size - 1) != b"\n":
                os.write(self.fd, b"\n")  # a torn last line ends here, not inside this process's first line
        fields.setdefault("time", time.time())
        os.write(self.fd, (json.dumps(fields, separators=(",", ":")) + "\n").encode())

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


def lost_workers(events: list[dict], shard_stats: list[dict]) -> list[dict]:
    """Workers the run went on without (--worker-lease): each with the clock at which a shard
    declared it lost (the smallest over shards; None if none did before the end) and how its
    process ended when the launcher saw it die (None in a run by hand)."""
    clock: dict[int, int] = {}
    for s in shard_stats:
        for w, c in s.get("lost_workers", {}).items():
            clock[int(w)] = min(c, clock.get(int(w), c))
    how = {e["rank"]: e["how"] for e in events if e.get("event") == "worker_lost"}
    return [{"worker": w, "clock": clock.get(w), "how": how.get(w)} for w in sorted(clock.keys() | how.keys())]


DEVICE_FIELDS = ("device", "device_name", "torch_version", "cuda_version")


def devices_of(ends: list[dict]) -> dict:
    """summary.json's `worker_devices` (rank -> device, its name, torch and CUDA versions: workers on
    several hosts may differ) and rank 0's `torch_version` / `cuda_version` (None on a CPU-only build)."""
    ends = sorted(ends, key=lambda e: e["rank"])
    first = ends[0]
    return {"worker_devices": {str(e["rank"]): {k: e.get(k) for k in DEVICE_FIELDS} for e in ends},
            "torch_version": first.get("torch_version"), "cuda_version": first.get("cuda_version")}


def remedies(cfg: RunConfig, shard_stats: list[dict], params: int) -> dict | None:
    """What --staleness-lr / --dc-lambda did, from the shards' counts; None when neither is on.

    mean_step_scale: the mean over applied gradients of 1 / max(1, tau) (1 without
    --staleness-lr); dc_relative_correction: the mean of |lambda g g (w_now - w_then)| / |g|;
    dc_memory_peak_bytes: the w_then snapshots held at once, summed over shards (their bound is
    N x the parameters x the wire dtype's bytes); bytes on the wire: none extra.
    """
    if not (cfg.staleness_lr or cfg.dc_lambda > 0):
        return None
    counts = [s["remedy"] for s in shard_stats if "remedy" in s]
    n = sum(c["gradients"] for c in counts)
    out = {"staleness_lr": cfg.staleness_lr, "dc_lambda": cfg.dc_lambda, "gradients": n,
           "mean_step_scale": sum(c["step_scale_sum"] for c in counts) / n if n else None}
    if cfg.dc_lambda > 0:
        out.update(dc_relative_correction=sum(c["dc_relative_sum"] for c in counts) / n if n else None,
                   dc_memory_peak_bytes=sum(c["dc_then_peak_bytes"] for c in counts),
                   dc_memory_bound_bytes=cfg.workers * params * _itemsize(cfg.wire_dtype))
    return out


def membership(cfg: RunConfig, events: list[dict], shard_stats: list[dict], start: float, end: float) -> dict:
    """Who was in the run when: shard 0's log of joins, departures and losses, and the run cut at
    each change into segments with their workers and samples/s (from the step events' times); and
    for each joiner the seconds from its admission to its first step done (its first gradient
    applied: a step event is written once the push was answered)."""
    changes = shard_stats[0].get("membership", []) if shard_stats else []
    at_start = shard_stats[0].get("members_at_start", cfg.workers) if shard_stats else cfg.workers
    steps = [e for e in events if e.get("event") == "step"]
    # One cut per update that changed the membership (the joins of one step boundary together).
    by_update: dict[int, list[dict]] = {}
    for c in changes:
        by_update.setdefault(c["update"], []).append(c)
    bounds, members = [(start, at_start)], at_start
    for update in sorted(by_update):
        group = by_update[update]
        members += sum(1 if c["event"] == "joined" else -1 for c in group)
        bounds.append((max(start, min(c.get("time", start) for c in group)), members))
    segments = []
    for (a, n), (b, _) in zip(bounds, [*bounds[1:], (end, 0)], strict=True):
        done = sum(1 for e in steps if a <= e["time"] < b)
        segments.append({"from_s": a - start, "workers": n,
                         "samples_per_s": done * cfg.batch_size * cfg.accumulate / (b - a) if b > a else None})
    first_steps = []
    for c in changes:
        if c["event"] == "joined":
            mine = [e["time"] for e in steps if e["rank"] == c["worker"]]
            first_steps.append({"worker": c["worker"], "update": c["update"],
                                "first_step_s": min(mine) - c["time"] if mine and "time" in c else None})
    return {"schedule": cfg.elastic, "slots": cfg.slots, "at_start": at_start, "changes": changes,
            "segments": segments if changes else [], "joiners": first_steps}


def summarize(out: Path, cfg: RunConfig, evals: list[dict], params: int, params_sha256: str,
              shard_stats: list[dict], extra: dict | None = None) -> dict:
    events = read_events(out / "metrics.jsonl")
    ends = [e for e in events if e.get("event") == "worker_end"]
    if not ends:
        raise RuntimeError(f"no worker_end events in {out / 'metrics.jsonl'}: did any worker finish?")
    start = min(e["train_start"] for e in ends)
    wall = max(e["train_end"] for e in ends) - start
    # Start-up: from the first process of the run (the launcher, or the first server / worker
    # started by hand) to the start barrier's release; none of it is in wall time.
    launched = [e["process_start"] for e in events if "process_start" in e]
    startup = start - min(launched) if launched else None
    worker_steps = sum(e["steps"] for e in ends)
    staleness: Counter = Counter()
    for s in shard_stats:
        staleness.update({int(k): v for k, v in s["staleness_hist"].items()})
    if shard_stats:
        global_updates = max(s["version"] for s in shard_stats)
    else:  # all-reduce: every step is one global update (every H-th one with --local-steps H)
        global_updates = min(e["steps"] for e in ends) // cfg.local_steps
    final = evals[-1] if evals else {}
    n = len(ends)
    summary = {
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
        "time_breakdown_s": {k: sum(e[f"{k}_s"] for e in ends) / n for k in ("compute", "push", "pull", "wait")},
        "per_worker_steps": {str(e["rank"]): e["steps"] for e in sorted(ends, key=lambda e: e["rank"])},
        "samples_per_worker": {str(e["rank"]): e["steps"] * cfg.batch_size * cfg.accumulate
                               for e in sorted(ends, key=lambda e: e["rank"])},
        # Who was in the run when (--elastic, --max-workers and joins, departures, losses): shard 0's log.
        "membership": membership(cfg, events, shard_stats, start, start + wall),
        **devices_of(ends),
        "skipped_nonfinite": sum(s.get("skipped_nonfinite", 0) for s in shard_stats),
        "lost_workers": lost_workers(events, shard_stats),
        "restarted_workers": [{"worker": e["rank"], "how": e["how"]} for e in events
                              if e.get("event") == "worker_restarted"],
        "restarts": [{k: v for k, v in e.items() if k != "event"} for e in events if e.get("event") == "restart"],
        "resumed_from": next((s["restored_from"] for s in shard_stats if s.get("restored_from") is not None), None),
        "checkpoints": {"written": sum(s.get("checkpoints", 0) for s in shard_stats),
                        "seconds": sum(s.get("checkpoint_s", 0.0) for s in shard_stats)},
        "remedies": remedies(cfg, shard_stats, params),
        # Backup workers (sync): late gradients taken and never applied, summed over the shards
        # (each shard drops its own slice: with K shards one whole late gradient counts K times).
        "backup_workers": cfg.backup_workers,
        "dropped_gradients": sum(s.get("dropped_gradients", 0) for s in shard_stats),
        "dropped_per_worker": dict(sorted(sum((Counter(s.get("dropped_per_worker", {})) for s in shard_stats),
                                              Counter()).items(), key=lambda kv: int(kv[0]))),
        "params_sha256": params_sha256,
        "config": to_dict(cfg),
    }
    summary.update(extra or {})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _itemsize(dtype: str) -> int:
    from psgd.core import codec  # noqa: PLC0415 - codec imports torch, which `psgd run` defers

    return codec.itemsize(dtype)
