"""What every process of a run does with its flags first: `psgd server`, `psgd worker`, `psgd node`.

- `config_from_args(args)`: the flags of `psgd.core.config.add_flags` -> a validated RunConfig; a
  bad value is a UsageError (one line, exit 2).
- `by_hand(cfg)`: a process started by hand writes into one shared folder (results/runs/by-hand)
  when --out is empty, since a fresh folder per process (what `psgd run` makes) would split the run.
- `token(cfg)`: the run's shared secret (--token-file or PSGD_TOKEN; psgd/ps/auth.py).
- `worker_device_of(cfg, rank)`: a worker's torch.device on this host.
- `check_data(cfg)`: a dataset read from files has them where --data-dir says (psgd run, psgd drill).
- Settings per room, declared here since every process imports this module first: a shard reads
  `SHARD_OWN` (also `serve.OWN`) and the shared settings, a worker `WORKER_OWN` (`work.OWN`) and
  the shared ones, and `psgd run` alone reads `RUN_OWN`. `not_read(room)` is what `psgd server` /
  `psgd worker` hide and refuse; `flags_for(cfg, room)` the flags `psgd run` hands that room's
  processes. `psgd node`, which may be either, takes them all.

- `room_main(command, add_parser, cmd, argv)`: a room's process main (`psgd server`, `psgd worker`).

Imports nothing heavy at module level: psgd/cli.py imports it on every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from psgd.core import config as C
from psgd.core import rules
from psgd.core.errors import UsageError

# `psgd run -h`'s epilog: each registered mode's own lines (psgd/core/rules.py), then all-reduce.
ALLREDUCE_HELP = ("  allreduce  No servers: workers all-reduce their gradients (torch.distributed, NCCL or gloo,\n"
                  "             or the hand-written ring) and every replica takes the same optimizer step.\n")
MODES_HELP = "modes:\n" + "".join(
    f"  {name:<10} " + rule.help.replace("\n", "\n" + " " * 13) + "\n" for name, rule in rules.RULES.items()) + (
    ALLREDUCE_HELP)


def shards_only(parser, epilog: str) -> str:
    """`psgd server` and `psgd node` serve shards and refuse --mode allreduce (one line, exit 2):
    their help lists the parameter-server modes alone. Sets the parser's --mode metavar; returns
    `epilog` (the modes) without all-reduce's lines."""
    for action in parser._actions:
        if action.dest == "mode":
            action.metavar = "{" + ",".join(m for m in action.choices if m != "allreduce") + "}"
    return epilog.replace(ALLREDUCE_HELP, "")


# The settings only a shard reads: the policy's (SSP's bound), the remedies it applies to arriving
# gradients, its checkpoints, its side of TLS and leases, its own fault injection. `psgd worker`
# refuses them and `psgd run` hands them to its shards alone; a worker never
# reads them (tests/test_rooms.py traces both rooms' reads in a run).
SHARD_OWN = frozenset({
    "staleness",                                                 # ssp: may_read's bound
    "staleness_lr", "dc_lambda", "dc_adaptive", "dc_ms_decay",   # remedies: a gradient's step on arrival
    "skip_nonfinite", "quorum_lr",
    "checkpoint_every", "fail_shard_at",
    "tls_cert", "tls_key", "worker_lease",
})

# The settings only a worker reads: its data and batches, its device, what and how it sends (wire
# dtype, top-k, transport, overlap), its delays and faults, the all-reduce group's. `psgd server`
# refuses them and `psgd run` hands them to its workers alone; a shard never
# reads them (tests/test_rooms.py traces both rooms' reads in a run).
WORKER_OWN = frozenset({
    "seed", "data_dir", "data_seed", "shard_data", "dirichlet_alpha", "loss", "device",
    "wire_dtype", "topk_warmup_epochs", "no_error_feedback", "transport", "separate_pull",
    "straggler", "jitter", "jitter_tail", "fail_at",
    "allreduce_impl", "bucket_mb", "backend", "check_every", "tls_ca",
})

# What only `psgd run` (the launcher) reads: its processes' CPU quotas and hosts, its restarts.
RUN_OWN = frozenset({"cpu_quota", "hosts", "cluster", "restart_workers", "restart_servers"})


def not_read(room: str) -> dict[str, str]:
    """Setting -> whose it is, for the settings a `room` ("shard" or "worker") process never reads."""
    theirs = {"shard": (WORKER_OWN, "a worker's setting, not a shard's: give it to psgd worker"),
              "worker": (SHARD_OWN, "a shard's setting, not a worker's: give it to psgd server")}[room]
    out = dict.fromkeys(theirs[0], theirs[1])
    out.update(dict.fromkeys(RUN_OWN, "psgd run's setting: a process started by hand does not read it"))
    return out


def flags_for(cfg: C.RunConfig, room: str) -> list[str]:
    """The flags that give a `room` process its settings of cfg (`psgd run` starting its children)."""
    return C.to_argv(cfg, skip=frozenset(not_read(room)))


def config_from_args(a: argparse.Namespace) -> C.RunConfig:
    """The flags of `C.add_flags` -> a validated RunConfig; a bad value is a UsageError (exit 2)."""
    try:
        cfg = C.validate(C.from_namespace(a))
    except ValueError as e:
        raise UsageError(str(e)) from None
    named = getattr(a, "transport", "auto")  # the flag, not cfg: a shard does not read a worker's setting
    if named != "auto":  # the transports name themselves: their registry (and its wires) when one is named
        from psgd.ps import transport

        why = transport.check(named, getattr(a, "hosts", 0), bool(getattr(a, "tls_ca", "")))
        if why:
            raise UsageError(why)
    return cfg


def token(cfg: C.RunConfig) -> bytes | None:
    """The run's shared secret (--token-file or PSGD_TOKEN; psgd/ps/auth.py); a bad file is a usage error."""
    from psgd.ps import auth

    try:
        return auth.load(cfg.token_file)
    except auth.TokenError as e:
        raise UsageError(str(e)) from None


def by_hand(cfg: C.RunConfig) -> C.RunConfig:
    """`psgd server` / `psgd worker` started by hand: every process of the run writes to one folder,
    so an empty --out cannot be a fresh one per process (as `psgd run` makes it)."""
    return cfg if cfg.out else dataclasses.replace(cfg, out="results/runs/by-hand")


def worker_device_of(cfg: C.RunConfig, rank: int):
    """This worker's torch.device: --device on this host, spread by $LOCAL_RANK (torchrun, psgd run's
    all-reduce) or else the rank; a device the host lacks is a UsageError (exit 2)."""
    from psgd.core.devices import DeviceError
    from psgd.train.worker import worker_device

    local = os.environ.get("LOCAL_RANK", "")
    try:
        return worker_device(cfg.device, rank, int(local) if local.isdigit() else None)
    except DeviceError as e:
        raise UsageError(str(e)) from None


def check_data(cfg: C.RunConfig) -> None:
    """A dataset read from files (--dataset mnist) has them where --data-dir says (default
    ~/.cache/psgd), or the run is refused with one line saying where to put them, exit 2: not as
    every shard's and worker's failure once they have started (psgd/train/data.py `missing_files`)."""
    if C.is_spec(cfg.data.dataset) or cfg.data.dataset != "mnist":
        return  # the others are generated, cached or shipped (importing data.py costs torch's second)
    from psgd.train import data

    problem = data.missing_files(cfg.data)
    if problem:
        raise UsageError(problem)


def room_main(command: str, add_parser, cmd, argv: list[str]) -> int:
    """`psgd COMMAND ARGV` as one room's process main, what psgd/cli.py `main` does for it: the
    zygote's forks call it directly (psgd/train/zygote.py `run_child`), so `psgd run` reaches a
    serving shard through three processes (the launcher, the zygote, this room), and a shard's stack
    is the zygote module's top, `run_child`, the room's `main`, this and `cmd`. Dies with its
    launcher, enters --cpu-quota's cgroup before any work, parses the room's flags
    (`add_parser(subparsers, MODES_HELP)`), names the process, runs `cmd(args)`; a UsageError is one
    line and exit 2."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # gRPC's C core logs multi-line errors of its own
    from psgd.core.errors import Parser
    from psgd.train import cpulimit, lifeline, proctitle

    lifeline.die_with_launcher()
    cpulimit.enter_from_env()
    top = Parser(prog="psgd")
    add_parser(top.add_subparsers(dest="command", required=True, parser_class=Parser), MODES_HELP)
    args = top.parse_args([command, *argv])
    proctitle.name_from_args(args)
    try:
        return cmd(args)
    except UsageError as e:
        print(f"psgd {command}: error: {e}", file=sys.stderr)
        return 2
