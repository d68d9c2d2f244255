"""Local SGD (`--local-steps H`): every worker trains its own replica, and the replicas are
averaged every H steps (Stich 2019, "Local SGD converges fast and communicates little"; Lin et
al. 2020, "Don't use large mini-batches, use local SGD").

Contract:
- A worker's step is one local optimizer step on its own replica: the run's optimizer
  (`psgd.core.optim.build`: SGD or AdamW) over the model's flat buffer with the run's lr,
  momentum, weight decay and linear warmup (counted in the worker's own steps). Its momentum buffer is the worker's own
  and survives the averagings (it is never averaged or reset).
- Every H local steps the replicas are averaged, synchronously: `--mode allreduce` all-reduces
  the parameters (SUM, then / N); `--mode sync` pushes the delta w_pulled - w_local to the
  shards, which apply w <- w - mean(delta) (psgd/ps/shard.py), and the workers pull the average.
  One averaging round is one update of the global model: the shards' version and the
  all-reduce version count rounds, and so do `--eval-every` and `--check-every`.
- Budget: `--steps T` still counts each worker's local steps (gradients computed), so the
  samples seen are those of T steps of plain data-parallel SGD. The run averages
  `rounds(T, H) = max(1, T // H)` times: T is rounded DOWN to a multiple of H, and up to H when
  T < H (a run ends on an averaged model). A PS shard's budget is rounds x N pushes.
- The outer step (`outer_config`): the round's update is the outer optimizer's step on the mean
  of the workers' parameter changes, delta = w_round_start - w_local: `--outer sgd` at lr 1 (the
  default) is w - mean(delta), the replicas' average (what it always was, bit for bit);
  `--outer nesterov` is DiLoCo (Douillard et al. 2023, Algorithm 1: "outer gradient" delta, outer
  SGD with Nesterov momentum, lr 0.7, momentum 0.9 by default), with any inner optimizer
  (`--optimizer adamw` as the paper). The shard steps it (sync PS); in all-reduce every replica
  all-reduces delta and steps the same outer optimizer on its copy of the global parameters.
  Async rounds (`--mode async --local-steps H`): each worker's change is applied on arrival as
  its 1/N share, with the momentum updated once every N arrivals (Liu et al. 2024's delayed
  Nesterov: psgd/core/delayed_nesterov.py).
- H = 1 is plain synchronous data-parallel SGD, and takes the exchanges' ordinary paths
  (gradients, not parameters, are averaged): bit for bit what it was before this option.

Run it:
    psgd run --mode allreduce --local-steps 4 --workers 4 --model mlp --dataset mnist1d --steps 400
    psgd run --mode sync --local-steps 4 --workers 4 --servers 2 --model mlp --dataset mnist1d --steps 400
"""

from __future__ import annotations

from psgd.core.config import OptimConfig


def outer_config(optim: OptimConfig) -> OptimConfig:
    """The outer optimizer of a local-SGD run (see the module docstring): plain SGD, no weight decay
    or warmup, lr and momentum from the --outer flags or the outer's own defaults."""
    nesterov = optim.outer == "nesterov"
    lr = optim.outer_lr or (0.7 if nesterov else 1.0)
    momentum = optim.outer_momentum or (0.9 if nesterov else 0.0)
    return OptimConfig(optimizer="sgd", lr=lr, momentum=momentum, weight_decay=0.0, warmup=0, nesterov=nesterov)


def plain_average(optim: OptimConfig) -> bool:
    """Whether the outer step is w - mean(delta) itself (lr 1, no momentum): then all-reduce
    averages the parameters directly, as it always did."""
    outer = outer_config(optim)
    return outer.lr == 1.0 and outer.momentum == 0.0


def rounds(steps: int, local_steps: int) -> int:
    """Averaging rounds of a run of `steps` local steps per worker (see the module docstring)."""
    assert steps >= 1 and local_steps >= 1, f"steps {steps} and local_steps {local_steps} must be >= 1"
    return max(1, steps // local_steps)
