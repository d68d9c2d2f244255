"""summary.json's record of a run's life: who was in it when, what it lost and restarted, what it ran on.

Contract: `life(cfg, events, ends, shard_stats, params, start, wall)` is the part of summary.json
(psgd/train/metrics.py `summarize`) that records what happened during the run rather than how fast
it went, from the events of OUT/metrics.jsonl (`ends`: the workers' `worker_end`), the shards'
stats (shard-K.json) and the run's wall clock: `membership` (shard 0's log of joins, departures and
losses, the run cut into segments at each change), `lost_workers`, restarts, `devices_of` (each
rank's device and versions), checkpoints, `remedies` (what --staleness-lr / --dc-lambda did) and
backup workers' dropped gradients. Pure functions of those values; nothing is read or written here.
"""

from __future__ import annotations

from collections import Counter

from psgd.core.config import RunConfig

__all__ = ["life", "lost_workers", "DEVICE_FIELDS", "devices_of", "remedies", "membership"]


def life(cfg: RunConfig, events: list[dict], ends: list[dict], shard_stats: list[dict], params: int,
                   start: float, wall: float) -> dict:
    """summary.json's record of the run's life: membership, devices, faults and restarts, checkpoints,
    remedies, backup workers' dropped gradients."""
    return {
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
    }


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


def _itemsize(dtype: str) -> int:
    from psgd.core import codec  # noqa: PLC0415 - codec imports torch, which `psgd run` defers

    return codec.itemsize(dtype)
