"""Turn a run's config into the objects that run it: the one place below the faces that reads RunConfig.

Contract: each function takes the run's `RunConfig` (cli, lab and psgd.fit make it; the launcher
forwards it to the processes it starts as flags) and returns objects that know nothing of it:

- `policy(cfg)`: the consistency policy of one shard (psgd/core/consistency.py), with the run's
  budget (`steps` updates in sync, counted in averaging rounds with --local-steps, N - b gradients
  per update with backup workers) and the start barrier that a served shard always has; its
  slots and who is in them from when (--elastic, --max-workers).
- `shard_optimizer(cfg)`: a factory param -> optimizer (psgd/core/optim.py `build`, fused where
  torch has the kernel); with --local-steps it is the outer optimizer (`localsgd.outer_config`:
  SGD at lr 1, the replicas' average, or DiLoCo's Nesterov; the run's optimizer acts in the workers;
  async: each change on arrival, psgd/core/delayed_nesterov.py); with --topk-momentum-correction
  it has no momentum (the workers keep it).
- `remedies(cfg)`: the stale-gradient remedies the shard applies (psgd/ps/remedies.py), DC-ASGD
  before the staleness-aware rate.
- `shard(cfg, index, num_params)`: a `Shard` of those, with its `ShardOptions`.
- `shard_server(cfg, index, host, port, ...)`: that shard served (psgd/ps/server.py).
- `topk(cfg)`: what a worker's pushes send (psgd/core/sparsify.py `TopK`; None: dense);
  `ps_exchange(cfg, addresses)`: a worker's `PSExchange` (psgd/ps/exchange.py);
  `collective_exchange(cfg, rank, env, init_method)`: an all-reduce rank's (psgd/allreduce/collective.py).
- `worker_parts(cfg, rank, device)`: what one worker's loop is given (psgd/train/worker.py
  `train`): the model (seeded), the batches, the loss and the loop's options; `train_worker`
  runs that loop with a given exchange.

A new consistency mode is a rule class registered in psgd/core/rules.py; a new optimizer is a file
in psgd/core and its line in core/sections.py's `OPTIMIZERS`; nothing here changes for either.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psgd.core import elastic, localsgd, optim, rowconfig, sharding, sparsify
from psgd.core.config import RunConfig, eval_interval
from psgd.core.consistency import Policy, make_policy
from psgd.ps import auth
from psgd.ps import remedies as remedies_mod
from psgd.ps.exchange import PSExchange
from psgd.ps.shard import Shard, ShardOptions
from psgd.train.threads import thread_budget


def policy(cfg: RunConfig) -> Policy:
    # With --elastic the shards have one slot per scheduled worker, `members` of them in from the
    # start, and admit the others at their scheduled updates (psgd/core/elastic.py); with
    # --max-workers the extra slots wait for `psgd worker --join`.
    budget = localsgd.rounds(cfg.steps, cfg.local_steps) * (cfg.members - cfg.backup_workers)
    p = make_policy(cfg.mode, cfg.slots, None, cfg.staleness, budget, start_barrier=True,
                    backup=cfg.backup_workers, members=cfg.members)
    for slot in elastic.plan(elastic.parse(cfg.elastic))[cfg.members:] if cfg.elastic else ():
        p.admit(slot.rank, slot.join)
    if cfg.quorum_lr:
        p.quorum_lr = True
    return p


def shard_optimizer(cfg: RunConfig):
    outer = localsgd.outer_config(cfg.optim) if cfg.local_steps > 1 else cfg.optim
    if cfg.local_steps > 1 and cfg.mode == "async":
        # Each worker's change on arrival, momentum once per N arrivals (psgd/core/delayed_nesterov.py).
        from psgd.core.delayed_nesterov import DelayedNesterov  # noqa: PLC0415

        return functools.partial(DelayedNesterov, cfg=outer, workers=cfg.members)
    if cfg.topk_momentum_correction:
        # Deep Gradient Compression: the workers keep the momentum (psgd/core/sparsify.py), the shards do not.
        outer = dataclasses.replace(outer, momentum=0.0)
    return functools.partial(optim.build, cfg=outer, fused=True)


def remedies(cfg: RunConfig) -> tuple:
    out: list[Any] = []
    if cfg.dc_lambda > 0:
        out.append(remedies_mod.DCASGD(cfg.dc_lambda, cfg.skip_nonfinite, cfg.dc_adaptive, cfg.dc_ms_decay))
    if cfg.staleness_lr:
        out.append(remedies_mod.StalenessLR())
    return tuple(out)


def shard_options(cfg: RunConfig, index: int, num_params: int | None = None) -> ShardOptions:
    expected = None
    if num_params is not None:
        lo, hi = sharding.shard_ranges(num_params, cfg.servers)[index]
        expected = hi - lo
    return ShardOptions(num_shards=cfg.servers, mode=cfg.mode, expected=expected, eval_every=eval_interval(cfg),
                        checkpoint_every=cfg.checkpoint_every, checkpoint_dir=str(Path(cfg.out) / "checkpoints"),
                        skip_nonfinite=cfg.skip_nonfinite, fail_at=dict(cfg.fail_shard_at).get(index),
                        link=cfg.link, rpc_timeout=cfg.rpc_timeout, worker_threads=thread_budget(cfg),
                        serves_rows=rowconfig.by_key(cfg))


def shard(cfg: RunConfig, index: int, num_params: int | None = None) -> Shard:
    assert 0 <= index < cfg.servers, f"shard {index} out of range for {cfg.servers} shards"
    return Shard(index, policy(cfg), shard_optimizer(cfg), shard_options(cfg, index, num_params), remedies(cfg))


def shard_server(cfg: RunConfig, index: int, host: str = "127.0.0.1", port: int = 0, *, token: bytes | None = None,
                 num_params: int | None = None, restore: dict | None = None):
    """Shard `index` of the run, restored from `restore` (a checkpoint) when given, served on `host`."""
    from psgd.ps import server  # noqa: PLC0415 - gRPC: only a process that serves imports it

    s = shard(cfg, index, num_params)
    if restore is not None:
        s.restore(restore)  # before anything listens: no worker ever sees the shard uninitialised
    return server.start(s, host, port, token=token, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key,
                        worker_lease=cfg.worker_lease)


def topk(cfg: RunConfig) -> sparsify.TopK | None:
    """What a worker's pushes send (psgd/core/sparsify.py); None: dense pushes (--topk 1, the
    default; the sparse path at fraction 1 is for tests). The warm-up's epochs are counted in
    pushes: a push per global batch of the training set (as --epochs counts them)."""
    if cfg.topk >= 1:
        return None
    per_epoch = 1.0
    if cfg.topk_warmup_epochs > 0:
        from psgd.train import data as data_mod  # noqa: PLC0415 - a worker's import, as in worker_parts

        per_epoch = max(1.0, data_mod.train_size(cfg.data) / cfg.global_batch)
    return sparsify.TopK(cfg.topk, not cfg.no_error_feedback,
                         cfg.optim.momentum if cfg.topk_momentum_correction else 0.0,
                         cfg.topk_warmup_epochs, per_epoch)


def ps_exchange(cfg: RunConfig, addresses: list[str]) -> PSExchange:
    return PSExchange(addresses, cfg.wire_dtype, cfg.rpc_timeout, cfg.link, cfg.overlap, cfg.accumulate, cfg.transport,
                      cfg.local_steps, cfg.optim, cfg.separate_pull, auth.load(cfg.token_file),
                      backup_workers=cfg.backup_workers, topk=topk(cfg),
                      error_feedback=not cfg.no_error_feedback, tls_ca=cfg.tls_ca, joins=joins(cfg))


def joins(cfg: RunConfig) -> dict[int, int]:
    """--elastic: every scheduled joiner's rank -> the update it is in the run from."""
    if not cfg.elastic:
        return {}
    return {slot.rank: slot.join for slot in elastic.plan(elastic.parse(cfg.elastic))[cfg.members:]}


def collective_exchange(cfg: RunConfig, rank: int, env=None, init_method: str = "env://"):
    """The exchange of `psgd worker --mode allreduce` (also under torchrun): the rendezvous and the
    backend read from the environment here, at the edge. Raises UsageError."""
    import os  # noqa: PLC0415

    from psgd.allreduce import collective  # noqa: PLC0415 - torch.distributed: only all-reduce needs it

    rdv = collective.Rendezvous.from_env(rank, cfg.workers, os.environ if env is None else env, init_method)
    backend = collective.choose_backend(cfg.backend, cfg.device, rdv.local_world_size,
                                        collective.usable_cuda_devices())
    diloco = cfg.local_steps > 1 and not localsgd.plain_average(cfg.optim)
    outer = localsgd.outer_config(cfg.optim) if diloco else None
    options = collective.CollectiveOptions(
        optim=cfg.optim, outer=outer, steps=cfg.steps, local_steps=cfg.local_steps, device=cfg.device,
        bucket_mb=cfg.bucket_mb, allreduce_impl=cfg.allreduce_impl, rpc_timeout=cfg.rpc_timeout,
        eval_every=eval_interval(cfg), check_every=cfg.check_every, out=cfg.out)
    return collective.CollectiveExchange(options, rdv, backend)


@dataclass
class WorkerParts:
    """What `worker.train` is given besides its exchange: the model, its batches, the loss, options."""
    model: Any
    batches: Any
    loss: Any
    options: Any


def worker_parts(cfg: RunConfig, rank: int, device) -> WorkerParts:
    from psgd.train import data as data_mod  # noqa: PLC0415 - torch: only a worker needs it
    from psgd.train import losses, models, worker  # noqa: PLC0415

    ds = data_mod.load(cfg.data)
    x, y = ds.x_train.to(device), ds.y_train.to(device)
    plan = data_mod.plan_for(cfg, ds.y_train)
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed).to(device)
    options = worker.LoopOptions(accumulate=cfg.accumulate, delay_ms=dict(cfg.straggler).get(rank, 0),
                                 jitter_ms=cfg.jitter, jitter_tail=cfg.jitter_tail,
                                 jitter_seed=cfg.seed * 7919 + rank,
                                 fail_step=dict(cfg.fail_at).get(rank), leave_at=leave_at(cfg, rank))
    return WorkerParts(model, worker.Batches(x, y, plan, rank), losses.get(cfg.model.loss), options)


def leave_at(cfg: RunConfig, rank: int) -> int | None:
    """The update at which worker `rank` leaves the run by its --elastic schedule (None: it stays)."""
    if not cfg.elastic:
        return None
    return elastic.plan(elastic.parse(cfg.elastic))[rank].leave


def train_worker(cfg: RunConfig, rank: int, exchange, metrics=None, device=None) -> dict:
    """Worker `rank` of the run: its parts (`worker_parts`) through `worker.train` with `exchange`."""
    from psgd.train import worker  # noqa: PLC0415

    device = device if device is not None else worker.worker_device(cfg.device, rank)
    parts = worker_parts(cfg, rank, device)
    return worker.train(exchange, parts.model, parts.batches, parts.loss, rank=rank, options=parts.options,
                        metrics=metrics)
