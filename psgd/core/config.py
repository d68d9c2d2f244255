"""Run configuration: ONE schema, frozen dataclasses, from which everything else is derived.

Contract:
- Each leaf field is declared once, with `opt(default, help, choices=..., metavar=...)`: from that
  one declaration come its flag, config.json and the lab's TOML key (psgd/core/flags.py says how).
  Adding a flag is one field; `validate` gains a line only if the value has a range to check.
- The schema: `RunConfig` (psgd/core/schema.py, the run's own fields and the mode lists) with its
  sections `DataConfig`, `ModelConfig`, `OptimConfig` (psgd/core/sections.py).
- `validate` is the one check at the edge: each failure is a one-line ValueError naming the flag
  (the CLI prints it and exits 2). Its checks, one function per concern, are below (the run's own,
  the wire, all-reduce, faults, local SGD, elastic membership, remedies), next to each section
  (sections.py `check_data`, `check_model`, `check_optim`) and rowconfig.py's `check_rows`.

`to_argv(cfg)` is how `psgd run` hands the exact same configuration to the server and worker
processes it starts, each only its room's settings (psgd/train/roles.py `flags_for`), as you would
start them by hand on other hosts. It re-exports the schema files' names (`config.X` is the one
way in); stdlib only, below every layer.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from psgd.core import devices, elastic, flags, link
from psgd.core.flags import (
    Flag,
    Leaf,
    Pairs,
    _default,
    _default_note,
    _fields,
    _flag,
    _for_argparse,
    is_spec,
    opt,
    parse_pair,
    parse_servers,
    shard_count,
    to_argv,
    to_dict,
)
from psgd.core.rowconfig import check_rows
from psgd.core.schema import (
    ALLREDUCE_IMPLS,
    AUTO,
    BACKENDS,
    EVAL_EVERY_MIN,
    EVALS,
    LOCAL_SGD_MODES,
    MODES,
    PS_MODES,
    STALE_MODES,
    WIRE_DTYPES,
    RunConfig,
    eval_interval,
    updates,
    with_epochs_resolved,
)
from psgd.core.sections import (
    DATASETS,
    LOSSES,
    MODELS,
    OPTIMIZERS,
    OUTERS,
    SHARD_DATA,
    Check,
    DataConfig,
    ModelConfig,
    OptimConfig,
    check_data,
    check_model,
    check_optim,
)

__all__ = [
    "ALLREDUCE_IMPLS", "AUTO", "BACKENDS", "DATASETS", "EVALS", "EVAL_EVERY_MIN", "LOCAL_SGD_MODES", "LOSSES",
    "MODELS", "MODES", "OPTIMIZERS", "OUTERS", "PS_MODES", "SHARD_DATA", "STALE_MODES",
    "WIRE_DTYPES", "DataConfig", "Flag", "Leaf", "ModelConfig", "OptimConfig", "Pairs", "RunConfig",
    "add_flags", "eval_interval", "from_dict", "from_flat", "from_namespace", "is_spec", "leaves", "opt",
    "parse_pair", "parse_servers", "shard_count", "to_argv", "to_dict", "updates", "validate",
    "with_epochs_resolved", "_default", "_default_note", "_fields", "_flag", "_for_argparse",
]


# -- the flag machinery, with RunConfig as the schema by default (psgd/core/flags.py) -------------
def leaves(schema: type = RunConfig) -> tuple[Leaf, ...]:
    """The schema's flag-bearing fields in declaration order, the nested sections' fields in place."""
    return flags.leaves(schema)


def add_flags(parser: argparse.ArgumentParser, schema: type = RunConfig,
              elsewhere: dict[str, str] | None = None) -> None:
    """Add one flag per leaf of the schema, in its section's help group; `elsewhere`: the leaves
    another room reads, hidden and refused (psgd/core/flags.py)."""
    flags.add_flags(parser, schema, elsewhere)


def from_namespace(ns: argparse.Namespace, schema: type = RunConfig) -> Any:
    """Parsed flags -> config (not validated: see `validate`)."""
    return flags.from_namespace(ns, schema)


def from_flat(flat: dict, schema: type = RunConfig) -> Any:
    """Flat leaf names (flags, TOML keys) -> config, the missing ones at their defaults (not validated)."""
    return flags.from_flat(flat, schema)


def from_dict(d: dict, schema: type = RunConfig) -> Any:
    """Inverse of to_dict (reads config.json): nested sections; unknown keys raise ValueError."""
    return flags.from_dict(d, schema)


# -- validate: one check per concern --------------------------------------------------------------
def validate(cfg: RunConfig) -> RunConfig:
    """Raise ValueError with a one-line message naming the flag, else return cfg."""
    checks = [*_check_run(cfg), *_check_wire(cfg), *_check_allreduce(cfg), *_check_faults(cfg),
              *check_data(cfg.data), *_check_local_sgd(cfg), *_check_elastic(cfg), *_check_remedies(cfg),
              *check_model(cfg.model), *check_optim(cfg.optim), *check_rows(cfg)]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return cfg


def _check_run(cfg: RunConfig) -> list[Check]:
    """The run's own sizes, budget and machine."""
    return [
        (cfg.mode in MODES, f"--mode must be one of {', '.join(MODES)}, got {cfg.mode!r}"),
        (cfg.workers >= 1, f"--workers must be >= 1, got {cfg.workers}"),
        (cfg.servers >= 1, f"--servers must be >= 1, got {cfg.servers}"),
        (cfg.staleness >= 0, f"--staleness must be >= 0, got {cfg.staleness}"),
        (0 <= cfg.backup_workers < max(cfg.workers, 1),
         f"--backup-workers must be in 0..N-1 = 0..{cfg.workers - 1} (each update needs at least one of the N "
         f"workers' gradients), got {cfg.backup_workers}"),
        (cfg.backup_workers == 0 or cfg.mode == "sync",
         f"--backup-workers drops the late gradients of a synchronous step: use it with --mode sync (--mode "
         f"{cfg.mode} {'never waits for a step' if cfg.mode != 'allreduce' else 'reduces every gradient'})"),
        (cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}"),
        (cfg.epochs >= 0 and math.isfinite(cfg.epochs), f"--epochs must be >= 0, got {cfg.epochs}"),
        (cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
        (cfg.accumulate >= 1, f"--accumulate must be >= 1, got {cfg.accumulate}"),
        (cfg.eval_every >= 0 or cfg.eval_every == AUTO, f"--eval-every must be >= 0 or auto, got {cfg.eval_every}"),
        (_error(devices.parse_device, cfg.device) is None, _error(devices.parse_device, cfg.device) or ""),
        (cfg.jitter >= 0, f"--jitter must be >= 0 ms, got {cfg.jitter}"),
        (cfg.jitter_tail == "exp" or cfg.jitter > 0, "--jitter-tail shapes --jitter's delays: give --jitter MS too"),
        (cfg.cpu_quota >= 0 and math.isfinite(cfg.cpu_quota), f"--cpu-quota must be >= 0 cores, got {cfg.cpu_quota}"),
        (cfg.rpc_timeout > 0, f"--rpc-timeout must be > 0, got {cfg.rpc_timeout}"),
        (cfg.threads >= 0, f"--threads must be >= 0 (0: share the cores), got {cfg.threads}"),
        (bool(cfg.tls_cert) == bool(cfg.tls_key), "--tls-cert and --tls-key go together (a certificate and its key)"),
    ]


def _check_wire(cfg: RunConfig) -> list[Check]:
    """What crosses the parameter server's wire: its dtype, --topk sparsification, links, hosts."""
    return [
        (cfg.wire_dtype in WIRE_DTYPES, f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}"),
        (0 < cfg.topk <= 1, f"--topk must be a fraction in (0, 1] (1: dense pushes), got {cfg.topk}"),
        (cfg.topk == 1 or cfg.mode in PS_MODES,
         "--topk sparsifies parameter-server pushes: --mode allreduce reduces dense gradients"),
        (cfg.topk == 1 or cfg.local_steps == 1,
         "--topk sparsifies gradients, --local-steps pushes model deltas: use one or the other"),
        (not cfg.no_error_feedback or cfg.topk < 1,
         "--no-error-feedback only applies to sparsified pushes: give --topk a fraction below 1"),
        (not (cfg.topk_momentum_correction or cfg.topk_warmup_epochs) or cfg.topk < 1, "--topk-momentum-correction "
         "and --topk-warmup-epochs only apply to sparsified pushes: give --topk a fraction below 1"),
        (not cfg.topk_momentum_correction or not cfg.no_error_feedback,
         "--topk-momentum-correction accumulates the velocity in the error-feedback residual: drop "
         "--no-error-feedback"),
        (not cfg.topk_momentum_correction or (cfg.optim.optimizer == "sgd" and not cfg.optim.nesterov),
         "--topk-momentum-correction moves SGD's (non-Nesterov) momentum to the workers: use --optimizer sgd"),
        (cfg.topk_warmup_epochs >= 0 and math.isfinite(cfg.topk_warmup_epochs),
         f"--topk-warmup-epochs must be >= 0, got {cfg.topk_warmup_epochs}"),
        (_error(link.parse, cfg.link) is None, _error(link.parse, cfg.link) or ""),
        (cfg.hosts >= 0, f"--hosts must be >= 0 (0: this host's loopback), got {cfg.hosts}"),
        (cfg.hosts == 0 or not cfg.link,
         "--link paces loopback; on a cluster (--hosts) its own links shape the run: give the link to "
         "`psgd cluster up --link` instead"),
        # --transport's names are the transports' own (psgd/ps/transport.py `check`, asked by the faces)
        (bool(cfg.transport), "--transport needs a name (auto: the fastest that reaches the shards)"),
    ]


def _check_allreduce(cfg: RunConfig) -> list[Check]:
    """The all-reduce mode's own settings, and the parameter-server options it has no use for."""
    return [
        (cfg.allreduce_impl in ALLREDUCE_IMPLS, f"--allreduce-impl must be one of {', '.join(ALLREDUCE_IMPLS)}"),
        (cfg.bucket_mb > 0 and math.isfinite(cfg.bucket_mb), f"--bucket-mb must be > 0, got {cfg.bucket_mb}"),
        (cfg.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}"),
        (cfg.check_every >= 0, f"--check-every must be >= 0, got {cfg.check_every}"),
        # servers=1 is the default, so only a count asked for explicitly contradicts the mode.
        (cfg.mode != "allreduce" or cfg.servers == 1,
         f"--servers is a parameter-server option: --mode allreduce has no servers (got --servers {cfg.servers})"),
        (cfg.mode != "allreduce" or cfg.transport == RunConfig.transport,
         "--transport is a parameter-server option: --mode allreduce talks through torch.distributed"),
        (cfg.mode != "allreduce" or not cfg.separate_pull, "--separate-pull is a PS option: allreduce has no pulls"),
        (cfg.mode != "allreduce" or not (cfg.overlap or cfg.link),
         "--overlap and --link are parameter-server options (the worker's gRPC client), not --mode allreduce"),
        (cfg.mode != "allreduce" or cfg.wire_dtype == "fp32",
         "--wire-dtype is a parameter-server option: --mode allreduce reduces fp32 gradients"),
    ]


def _check_faults(cfg: RunConfig) -> list[Check]:
    """Injected faults and the answers to them: stragglers, kills, restarts, checkpoints."""
    return [
        (all(0 <= r < cfg.workers and ms >= 0 for r, ms in cfg.straggler),
         f"--straggler needs RANK=MS with 0 <= RANK < {cfg.workers} and MS >= 0"),
        (all(0 <= r < cfg.workers and s >= -1 for r, s in cfg.fail_at),
         f"--fail-at needs RANK=STEP with 0 <= RANK < {cfg.workers} and STEP >= -1"),
        (all(0 <= k < cfg.servers and v >= 0 for k, v in cfg.fail_shard_at) and
         (cfg.mode != "allreduce" or not cfg.fail_shard_at),
         f"--fail-shard-at needs K=V with 0 <= K < {cfg.servers} and V >= 0 (parameter-server modes)"),
        (cfg.restart_servers >= 0, f"--restart-servers must be >= 0, got {cfg.restart_servers}"),
        (cfg.restart_workers >= 0, f"--restart-workers must be >= 0, got {cfg.restart_workers}"),
        (cfg.restart_workers == 0 or (cfg.mode != "allreduce" and cfg.local_steps == 1),
         "--restart-workers: a parameter-server run without --local-steps (the shards keep each worker's clock; "
         "an all-reduce group cannot take a new rank in)"),
        (cfg.restart_servers == 0 or cfg.checkpoint_every > 0,
         "--restart-servers restarts from checkpoints: give --checkpoint-every K too"),
        (cfg.restart_servers == 0 or cfg.local_steps == 1, "--restart-servers does not work with --local-steps"),
        (cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}"),
        (cfg.mode != "allreduce" or cfg.checkpoint_every == 0,
         "--checkpoint-every is a parameter-server option: the shards write the checkpoints"),
        (cfg.checkpoint_every == 0 or cfg.backup_workers == 0 or cfg.servers == 1,
         "--checkpoint-every with --backup-workers needs one shard: each shard takes its own first N-b "
         "gradients, so their checkpoints of one version disagree on the workers' clocks"),
    ]


def _check_local_sgd(cfg: RunConfig) -> list[Check]:
    """--local-steps H: rounds of H steps, and what does not go with them."""
    return [
        (cfg.local_steps >= 1, f"--local-steps must be >= 1, got {cfg.local_steps}"),
        (cfg.local_steps == 1 or cfg.mode in LOCAL_SGD_MODES,
         "--local-steps is local SGD: use it with --mode sync, allreduce or async (ssp has no rounds)"),
        (cfg.local_steps == 1 or cfg.accumulate == 1, "--local-steps and --accumulate exclude each other"),
        (cfg.local_steps == 1 or not cfg.overlap,
         "--overlap streams every step's gradient; with --local-steps there is one exchange per H steps"),
        (cfg.local_steps > 1 or (cfg.optim.outer == "sgd" and not cfg.optim.outer_lr and not cfg.optim.outer_momentum),
         "--outer, --outer-lr and --outer-momentum set local SGD's outer step: give --local-steps H > 1"),
    ]


def _check_elastic(cfg: RunConfig) -> list[Check]:
    """Who is in a parameter-server job: leases, schedules, slots for joiners."""
    return [
        (cfg.worker_lease >= 0 and math.isfinite(cfg.worker_lease),
         f"--worker-lease must be seconds >= 0, got {cfg.worker_lease}"),
        (cfg.worker_lease == 0 or cfg.mode != "allreduce",
         "--worker-lease is a parameter-server option: an all-reduce group cannot go on without a rank"),
        (cfg.worker_lease == 0 or cfg.mode != "sync" or (cfg.backup_workers == 0 and cfg.restart_workers == 0),
         "--worker-lease in sync shrinks each step's quorum when a worker is lost; --backup-workers and "
         "--restart-workers are the other answers to a slow or dead worker: use one of them"),
        (cfg.worker_lease == 0 or cfg.mode != "sync" or cfg.checkpoint_every == 0,
         "--worker-lease in sync with --checkpoint-every: a checkpoint does not keep the shrunk quorum yet, so a "
         "resumed run would wait for the lost worker; use one or the other"),
        (not cfg.elastic or _error(elastic.parse, cfg.elastic) is None, _error(elastic.parse, cfg.elastic or "0:1")),
        (cfg.max_workers >= 0, f"--max-workers must be >= 0, got {cfg.max_workers}"),
        (cfg.max_workers not in range(1, cfg.workers), f"--max-workers is every worker slot, the --workers "
         f"{cfg.workers} included: give at least {cfg.workers}, got {cfg.max_workers}"),
        (not (cfg.elastic or cfg.max_workers > cfg.workers) or cfg.mode in PS_MODES,
         "--elastic and --max-workers change a parameter-server job's workers: an all-reduce group is fixed"),
        (not (cfg.elastic or cfg.max_workers > cfg.workers) or (cfg.backup_workers == 0 and cfg.local_steps == 1),
         "--elastic and --max-workers: not with --backup-workers (a fixed quorum) or --local-steps (rounds, not "
         "steps)"),
        (not (cfg.elastic and cfg.max_workers), "--elastic sets the slots itself: leave out --max-workers"),
        (not cfg.quorum_lr or cfg.mode == "sync", "--quorum-lr scales a synchronous step with its quorum: use it "
                                                  "with --mode sync"),
    ]


def _check_remedies(cfg: RunConfig) -> list[Check]:
    """The shard's remedies for stale gradients (--staleness-lr, --dc-lambda): async and SSP only."""
    return [
        (cfg.local_steps == 1 or not (cfg.staleness_lr or cfg.dc_lambda),
         "--staleness-lr and --dc-lambda correct stale gradients; with --local-steps a push is a parameter change"),
        (cfg.dc_lambda >= 0 and math.isfinite(cfg.dc_lambda), f"--dc-lambda must be >= 0, got {cfg.dc_lambda}"),
        (not cfg.dc_adaptive or cfg.dc_lambda > 0, "--dc-adaptive scales --dc-lambda: give --dc-lambda > 0"),
        (0 <= cfg.dc_ms_decay < 1, f"--dc-ms-decay must be in [0, 1), got {cfg.dc_ms_decay}"),
        (cfg.mode in STALE_MODES or not (cfg.staleness_lr or cfg.dc_lambda),
         f"--staleness-lr and --dc-lambda correct stale gradients: use them with --mode async or ssp "
         f"(--mode {cfg.mode} has no stale gradients)"),
    ]


def _error(parse: Callable[[str], Any], text: str) -> str | None:
    """parse(text)'s ValueError message, or None when it parses."""
    try:
        parse(text)
    except ValueError as e:
        return str(e)
    return None
