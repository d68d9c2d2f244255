"""Measure what the time model was not given: a step's compute and a shard's apply, on this machine.

`--simulate` without `--sim-compute` (or a profile's `compute`) times the model at hand: one
process, one thread, the run's own batches, a warm-up step first, then the median of `repeats`
forward / backward passes. Without `--sim-apply` (or a profile's `apply`) it times the run's
optimizer step (psgd/core/optim.py `build`, as a shard builds it) on a tensor of the largest
shard's length and divides by its fp32 bytes. Both are said in summary.json's `time_model`
("measured here ..."). A measurement varies from run to run: give the measured numbers back as
flags (`--sim-compute`, `--sim-apply`) to make a run's clock, and with it async's event order,
repeat bit for bit.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from psgd.core import optim, sharding
from psgd.sim.workers import Replica
from psgd.train.worker import Batches

REPEATS = 15


def one_thread():
    """A context: torch on one intra-op thread inside it (the model's device, one core)."""
    class _One:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(1)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)
    return _One()


def compute_s(replica: Replica, batches: Batches, repeats: int = REPEATS) -> float:
    """The median seconds of one step's forward and backward (one thread), its gradient discarded."""
    params = replica.flat.params.clone()
    times = []
    with one_thread():
        replica.gradient(params, batches, 0)  # warm-up: allocator, kernels, lazy init
        for clock in range(repeats):
            t0 = time.perf_counter()
            replica.gradient(params, batches, clock)
            times.append(time.perf_counter() - t0)
    replica.computed -= repeats + 1  # the calibration's gradients are not the run's
    replica.flat.params.copy_(params)
    return statistics.median(times)


def apply_s_per_byte(optim_cfg, num_params: int, shards: int, repeats: int = REPEATS) -> float:
    """The median seconds per fp32 byte of one optimizer step of the largest shard (one thread)."""
    lo, hi = max(sharding.shard_ranges(num_params, shards), key=lambda r: r[1] - r[0])
    param = torch.zeros(hi - lo)
    param.grad = torch.full_like(param, 1e-3)
    opt = optim.build(param, optim_cfg, fused=True)
    times = []
    with one_thread():
        opt.step()
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / (4 * (hi - lo))


def step_law(lines: list[dict], workers: int) -> dict:
    """A real run's time law from its step lines (metrics.jsonl), for a simulation of that run.

    A step's own time is its compute + push + pull (its `wait_s`, the policy holding its pull, is
    the simulation's to produce). On this machine that time is mostly the processes sharing cores,
    not the wire, and it varies from step to step (a descheduled process pays milliseconds): SSP's
    bound binds on that variation. So the law puts it into the model's compute: the message is the
    run's floor (the smallest push + pull of any step, over its two messages), and a step's compute
    is its own time less that floor, each worker's mean giving its speed, the spread (a log-normal
    CV) the per-step variation about the worker's mean, pooled. Clock 0 is left out: it holds the
    process's warm-up. Returns compute_s (the mean over workers), speeds, spread (CV) and message_s;
    a worker with no step line past clock 0 (async: the others spent the budget first) gets speed 1.
    ValueError when no worker has one."""
    own: dict[int, list[float]] = {w: [] for w in range(workers)}
    floor = math.inf
    for e in lines:
        if e.get("event") == "step" and e.get("clock", 0) > 0 and e.get("rank") in own:
            own[e["rank"]].append(float(e["compute_s"]) + float(e["push_s"]) + float(e["pull_s"]))
            floor = min(floor, (float(e["push_s"]) + float(e["pull_s"])) / 2)
    own = {w: v for w, v in own.items() if v}
    if not own:
        raise ValueError("step_law: no worker has a step line past clock 0")
    comp = {w: [max(x - 2 * floor, 1e-9) for x in v] for w, v in own.items()}
    means = {w: statistics.fmean(v) for w, v in comp.items()}
    mean = statistics.fmean(means.values())
    ratios = [x / means[w] for w, v in comp.items() for x in v]
    return {"compute_s": mean, "speeds": tuple(mean / means[w] if w in means else 1.0 for w in range(workers)),
            "spread": statistics.stdev(ratios) if len(ratios) > 1 else 0.0, "message_s": floor}
