"""`psgd run ... --simulate`: a PS run as a simulated cluster, written to the same run folder as a real run.

    psgd run --mode async --workers 64 --servers 2 --steps 20 --simulate --sim-compute 5ms --link 1gbit,100us
    psgd run --mode sync --workers 3 --servers 2 --steps 40 --simulate      # compute measured here first

`simulate(cfg, sim)` builds the run's real pieces (the seeded model, its data and batch plan, the
loss, K production shards with the run's policy, optimizer and remedies: psgd/train/assemble.py),
runs them on the virtual clock (psgd/sim/cluster.py) and writes what a real run writes:
config.json, metrics.jsonl (step and worker_end lines, the shards' snapshots, all at virtual
times from the run's start), shard-K.json / shard-K.pt, then `psgd.train.finish.finish` evaluates
and writes summary.json, to which it adds `simulated: true` and `time_model` (psgd/sim/timemodel.py
`describe`, with how many events and gradients the simulation took and its real seconds). Every
time in that folder is SIMULATED.

What it refuses (one line, exit 2), because the simulator does not model it yet: --mode
allreduce, --local-steps > 1, --topk < 1, --elastic, --max-workers, --overlap, a CUDA --device,
and the real-process settings (--cpu-quota, --hosts, faults, restarts, leases, checkpoints).
Sync and one-worker async give the real run's parameters bit for bit (tests/test_sim.py): the same
shards in the same order, the same gradients (the worker's thread budget is taken as a real
worker takes it, psgd/train/threads.py `thread_budget`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from psgd.core import link as link_mod
from psgd.core.config import RunConfig
from psgd.core.errors import UsageError
from psgd.sim import timemodel


@dataclass(frozen=True)
class SimConfig:
    """The simulation's own settings (the run's are its RunConfig): where its time model comes from."""
    compute: str = ""   # --sim-compute: "120ms" per step or "40us/sample"; "": the profile's, else measured
    speeds: str = ""    # --sim-speeds: "1,1,0.5" or "lognormal:SIGMA"; "": the profile's, else all 1
    spread: str = ""    # --sim-spread: CV of a step's compute (log-normal, mean 1); "": the profile's, else 0
    apply: str = ""     # --sim-apply: a shard's seconds per byte, "0.25ns"; "": the profile's, else measured
    profile: str = ""   # --sim-profile: a TOML hardware profile (psgd/sim/timemodel.py)


# (field, is it set, why not): what the simulator does not model.
REFUSED = (
    ("mode", lambda v: v == "allreduce", "--mode allreduce is not simulated yet (PS modes only)"),
    ("local_steps", lambda v: v > 1, "--local-steps > 1 is not simulated yet"),
    ("topk", lambda v: v < 1, "--topk < 1 is not simulated yet"),
    ("elastic", bool, "--elastic is not simulated yet"),
    ("max_workers", bool, "--max-workers (joins) is not simulated"),
    ("overlap", bool, "--overlap is not simulated (a step is pull, compute, push)"),
    ("embeddings", lambda v: v != "dense", "--embeddings rows / hybrid (rows by key) is not simulated yet"),
    ("cpu_quota", bool, "--cpu-quota shares real cores: a simulated run has none"),
    ("hosts", bool, "--hosts places real processes: a simulated run has none"),
    ("fail_at", bool, "--fail-at kills real processes: not simulated"),
    ("fail_shard_at", bool, "--fail-shard-at kills real processes: not simulated"),
    ("restart_workers", bool, "--restart-workers restarts real processes: not simulated"),
    ("restart_servers", bool, "--restart-servers restarts real processes: not simulated"),
    ("worker_lease", bool, "--worker-lease is about silent processes: not simulated"),
    ("checkpoint_every", bool, "--checkpoint-every is not simulated"),
)


def check(cfg: RunConfig) -> None:
    """UsageError (exit 2) for a setting the simulator does not model."""
    for name, bad, why in REFUSED:
        if bad(getattr(cfg, name)):
            raise UsageError(f"--simulate: {why}")
    if cfg.device not in ("auto", "cpu"):
        raise UsageError("--simulate computes on this process's CPU: give --device cpu (or leave it auto)")


def time_model(cfg: RunConfig, sim: SimConfig, replica, batches) -> timemodel.TimeModel:
    """The run's time model: flags over the profile over a measurement here (psgd/sim/calibrate.py)."""
    from psgd.sim import calibrate  # noqa: PLC0415 - torch

    try:
        prof = timemodel.load_profile(sim.profile) if sim.profile else {}
        batch = cfg.batch_size * cfg.accumulate
        where = f"profile {sim.profile}"
        if sim.compute or "compute" in prof:
            step_s, text = timemodel.compute_of(sim.compute or prof["compute"], batch)
            source = f"given: --sim-compute {text}" if sim.compute else f"{where}: compute = {text}"
        else:
            step_s = calibrate.compute_s(replica, batches)
            source = (f"measured here: median of {calibrate.REPEATS} forward/backward steps of this model, "
                      "one process, one thread")
        speeds = timemodel.speeds_of(sim.speeds or prof.get("speeds", ""), cfg.workers, cfg.seed)
        spread = timemodel.spread_of(sim.spread or prof.get("spread", ""))
        link = link_mod.parse(cfg.link or prof.get("link", ""))
        if sim.apply or "apply" in prof:
            apply = timemodel.seconds(sim.apply or prof["apply"], "--sim-apply")
            apply_source = f"given: --sim-apply {sim.apply}" if sim.apply else f"{where}: apply = {prof['apply']}"
        else:
            apply = calibrate.apply_s_per_byte(cfg.optim, replica.flat.params.numel(), cfg.servers)
            apply_source = f"measured here: median of {calibrate.REPEATS} optimizer steps of the largest shard, " \
                           "one thread"
        message = timemodel.seconds(prof["message"], "message") if "message" in prof else 0.0
    except ValueError as e:
        raise UsageError(str(e)) from None
    delays = dict(cfg.straggler)
    return timemodel.TimeModel(
        compute_s=step_s, compute_source=source, speeds=speeds, spread=spread,
        delays_s=tuple(delays.get(w, 0) / 1e3 for w in range(cfg.workers)), jitter_s=cfg.jitter / 1e3,
        jitter_tail=cfg.jitter_tail, seed=cfg.seed, bits_per_s=link.bits_per_s if link else math.inf,
        latency_s=link.latency_s if link else 0.0, message_s=message, apply_s_per_byte=apply,
        apply_source=apply_source)


def simulate(cfg: RunConfig, sim: SimConfig = SimConfig(), prepared: bool = False) -> dict:
    """Run `cfg` as a simulated cluster (see the module docstring); returns summary.json's contents.
    `prepared`: the caller made the run folder already (`psgd run` does, before its live line)."""
    import torch  # noqa: PLC0415 - the faces import torch late

    from psgd.train import data, finish, rundir  # noqa: PLC0415
    from psgd.train.metrics import Metrics  # noqa: PLC0415

    check(cfg)
    if cfg.epochs > 0:
        from psgd.core.config import with_epochs_resolved  # noqa: PLC0415

        cfg = with_epochs_resolved(cfg, data.train_size(cfg.data))
    if not prepared:
        cfg = rundir.with_out_resolved(cfg)
        rundir.prepare_out(Path(cfg.out))
    out = Path(cfg.out)
    (out / "config.json").write_text(json.dumps(rundir.config_record(cfg), indent=1))
    threads = torch.get_num_threads()
    real_start = time.perf_counter()
    try:
        base = time.time()
        metrics = Metrics(out / "metrics.jsonl")
        metrics.write(event="launch", by="psgd run --simulate", process_start=base, time=base)
        try:
            cluster, tm = _cluster(cfg, sim, lambda line: metrics.write(**line), base)
            loop_start = time.perf_counter()
            end = cluster.run()
            loop_s = time.perf_counter() - loop_start
        finally:
            metrics.close()
        for k, shard in enumerate(cluster.shards):
            _virtual_snapshots(shard, cluster.version_at[k], base, end)
            shard.save(out)
    finally:
        torch.set_num_threads(threads)
    real_s = time.perf_counter() - real_start
    summary = finish.finish(cfg, on_eval=lambda k, n: None)
    vectors = cluster.peak_in_flight
    summary.update(simulated=True, time_model=dict(
        tm.describe(), events=cluster.clock.events, gradients_computed=cluster.replica.computed, virtual_s=end,
        simulation_real_s=real_s, event_loop_real_s=loop_s, peak_vectors_in_flight=vectors,
        peak_bytes_in_flight=vectors * 4 * cluster.replica.flat.params.numel()))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _cluster(cfg: RunConfig, sim: SimConfig, write, base: float):
    """The run's pieces, built as a real run builds them (psgd/train/assemble.py), on one clock:
    (the Cluster, its TimeModel). Leaves torch on a real worker's thread budget (the caller restores it)."""
    import torch  # noqa: PLC0415

    from psgd.core.sharding import shard_ranges  # noqa: PLC0415
    from psgd.sim.cluster import Cluster  # noqa: PLC0415
    from psgd.sim.workers import Replica, VWorker  # noqa: PLC0415
    from psgd.train import assemble, data, losses, models, threads  # noqa: PLC0415
    from psgd.train.worker import Batches  # noqa: PLC0415

    ds = data.load(cfg.data)
    plan = data.plan_for(cfg, ds.y_train)
    replica = Replica(models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed), losses.get(cfg.model.loss),
                      cfg.accumulate)
    batches = [Batches(ds.x_train, ds.y_train, plan, w) for w in range(cfg.workers)]
    tm = time_model(cfg, sim, replica, batches[0])
    torch.set_num_threads(threads.thread_budget(cfg))  # a real worker's threads: the same kernels, the same bits
    initial = replica.flat.params.clone()
    shards = [assemble.shard(cfg, k, initial.numel()) for k in range(cfg.servers)]
    for shard, (lo, hi) in zip(shards, shard_ranges(initial.numel(), cfg.servers), strict=True):
        shard.init(initial[lo:hi].clone())  # every worker's Init offers these; the first wins
    jitter, spread = tm.jitter_streams(), tm.spread_streams() if tm.spread else [None] * cfg.workers
    workers = [VWorker(w, batches[w], cfg.servers, jitter[w], spread[w]) for w in range(cfg.workers)]
    return Cluster(shards, workers, replica, tm, cfg.wire_dtype, cfg.backup_workers > 0, write, base), tm


def _virtual_snapshots(shard, version_at: dict[int, float], base: float, end: float) -> None:
    """The shard's snapshots stamped with the virtual moment of their update (the shard stamps them
    with this machine's clock), and the final parameters as the last one, as a real shard saves them."""
    snaps = [(v, base + version_at.get(v, end), p) for v, _, p in shard.snapshots]
    version = shard.policy.version
    if not snaps or snaps[-1][0] != version:
        snaps.append((version, base + version_at.get(version, end), shard.param.detach().clone()))
    shard.snapshots = snaps
