"""`psgd worker`: the main of one worker process (started by `psgd run`, `psgd node`, or by hand).

`cmd_worker(args)` validates the flags (one line, exit 2), joins a running job when asked
(`--join`: `join`, a slot from the shards), builds the exchange (the PS client, or the all-reduce
group) and trains (its parts from psgd/train/assemble.py `worker_parts`, the loop of psgd/train/worker.py), then
leaves without the interpreter's teardown. Exit 0, 1 (the exchange failed), 2 (the user's
model, data or loss is wrong) or 130 (interrupted).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from psgd.core import config as C
from psgd.core.errors import UsageError
from psgd.core.shorthelp import add_short_help
from psgd.train import roles
from psgd.train.roles import by_hand, config_from_args, not_read, token, worker_device_of

# The settings only a worker reads (declared with the other rooms' in psgd/train/roles.py):
# `psgd server` refuses them, `psgd run` hands them to workers alone.
OWN = roles.WORKER_OWN

WORKER_DESCRIPTION = """\
Train as worker --rank against running shards (--servers HOST:PORT,...), or as one member
of an all-reduce group (--mode allreduce, e.g. under torchrun). `psgd run` starts N of
these for you; start them by hand to put workers on other hosts. It takes a worker's
settings: a shard's (--staleness, --checkpoint-every, ...) are refused, and go to
`psgd server`; the settings both read must agree."""


def main(argv: list[str]) -> int:
    """`psgd worker ARGV`: this process's main (psgd/train/roles.py `room_main`)."""
    return roles.room_main("worker", add_parser, cmd_worker, argv)


def add_parser(sub, epilog: str) -> None:
    """`psgd worker`'s flags and help, as a subcommand of `sub` (psgd/cli.py's, or room_main's own)."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("worker", help="train as one worker against running shards (or in an all-reduce group)",
                       description=WORKER_DESCRIPTION, add_help=False,
                       usage="psgd worker --rank R --servers HOST:PORT,... [a worker's settings] (-h, --help)",
                       epilog=epilog, formatter_class=fmt)
    add_short_help(p)
    C.add_flags(p, elsewhere=not_read("worker"))
    p.add_argument("--rank", type=int, default=None, help="worker id 0..N-1 (default: $RANK, for torchrun)")
    p.add_argument("--join", default="", metavar="HOST:PORT,...",
                   help="join a running job's shards (in shard order) as a new worker: the shards give it a free "
                        "slot (started with --max-workers or --elastic) and its first step; --rank is not needed")
    p.add_argument("--servers-on-stdin", action="store_true",
                   help="read the shards' HOST:PORT,... from the first line of stdin once loaded (psgd run starts its "
                        "workers side by side with the shards this way; --servers then gives their count K)")
    p.add_argument("--rendezvous", default="env://",
                   help="all-reduce group rendezvous (default: env://, $MASTER_ADDR:$MASTER_PORT as torchrun sets "
                        "them), tcp://H:P or file://PATH (psgd run uses a file in the run folder)")


def join(cfg: C.RunConfig, where: str) -> tuple[C.RunConfig, list[str], int]:
    """`psgd worker --join`: take a slot in the running job at `where` (psgd/ps/client.py `join_job`);
    returns the config as that job's (its slot count, shards and mode), the shards, and the slot."""
    from psgd.core.errors import ExchangeError
    from psgd.ps import auth
    from psgd.ps.client import join_job
    from psgd.ps.transport import make_transport
    from psgd.train import assemble, data, models

    if cfg.mode == "allreduce":
        raise UsageError("--join adds a worker to a parameter-server job: an all-reduce group is fixed")
    try:
        addresses = C.parse_servers(where)
    except ValueError as e:
        raise UsageError(f"--join: {e}") from None
    if isinstance(addresses, int):
        raise UsageError(f"--join wants the running shards' HOST:PORT,..., got {where!r}")
    # A join holds nothing and waits for nothing: a job that is not there (finished, its shards gone)
    # is said in seconds, not after the run's long RPC deadline.
    transport = make_transport("grpc", addresses, min(cfg.rpc_timeout, 10.0), None, auth.load(cfg.token_file),
                               cfg.tls_ca)
    try:
        infos = transport.info(list(range(len(addresses))))
        first = infos[0]
        if first.num_shards != len(addresses):
            raise UsageError(f"--join: {addresses[0]} is shard {first.shard} of {first.num_shards}: give all "
                             f"{first.num_shards} shards, in order")
        if first.mode != cfg.mode:
            raise UsageError(f"--join: the running job is --mode {first.mode}, this worker says --mode {cfg.mode}")
        cfg = dataclasses.replace(cfg, servers=len(addresses), workers=first.num_workers, max_workers=0, elastic="")
        cfg = C.with_epochs_resolved(cfg, data.train_size(cfg.data))
        model = assemble.worker_parts(cfg, 0, "cpu").model  # the seeded model: its size, and an Init if none came
        rank, clock = join_job(transport, models.FlatParams(model).params)
    except ExchangeError as e:
        raise UsageError(f"--join: {e}") from None
    finally:
        transport.close()
    print(f"psgd worker: joined as worker {rank} of {cfg.workers} slots, first clock {clock}", file=sys.stderr,
          flush=True)
    return cfg, addresses, rank


def cmd_worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from psgd.train import assemble, data, rundir, threads, worker
    from psgd.train.metrics import Metrics
    from psgd.train.userspec import SpecError

    cfg = by_hand(config_from_args(args))
    token(cfg)  # a bad token file is a usage error here, before anything starts
    if getattr(args, "join", ""):  # (psgd node's arguments have no --join: a torchrun job is fixed)
        cfg, args.servers, args.rank = join(cfg, args.join)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "-1"))
    if not 0 <= rank < cfg.workers:
        raise UsageError(f"--rank must be in 0..{cfg.workers - 1} (or set $RANK), got {rank}")
    device = worker_device_of(cfg, rank)
    # `psgd run` resolved --epochs already; by hand or under torchrun the worker is the first to know.
    cfg = C.with_epochs_resolved(cfg, data.train_size(cfg.data))
    threads.set_threads(cfg)
    exchange, errors = _exchange(args, cfg, rank)
    metrics = Metrics(Path(cfg.out) / "metrics.jsonl")
    # The launcher stops a run's workers with SIGTERM (a shard died, say). The step line a worker
    # defers is written while its next push is answered (psgd/train/metrics.py `defer`): dying
    # before that would drop a step it finished, and a restart's `reached` would count one short.
    signal.signal(signal.SIGTERM, lambda *_: _die_written(metrics))
    code = 0
    try:
        parts = assemble.worker_parts(cfg, rank, device)  # the loop is called from here: a short stack in it
        if cfg.embeddings != "dense":  # the tables by row, beside the dense exchange (psgd/train/rowexchange.py)
            from psgd.train import rowexchange

            exchange, parts = rowexchange.attach(cfg, exchange, parts, rank)
        worker.train(exchange, parts.model, parts.batches, parts.loss, rank=rank, options=parts.options,
                     metrics=metrics)
    except errors as e:
        print(f"psgd worker {rank}: error: {e}", file=sys.stderr)
        code = 1
    except SpecError as e:  # the user's model / data / loss, built before the worker connects
        print(f"psgd worker: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    finally:
        metrics.close()
    if code == 0 and rank == 0 and cfg.mode == "allreduce" and not os.environ.get(rundir.LAUNCHED):
        print(f"done; `psgd summarize {cfg.out}` writes its summary.json", file=sys.stderr, flush=True)
    # Leave without the interpreter's teardown: the metrics (and the all-reduce replica files) are
    # written and closed. After a gloo group has run, C++ destructors at exit sometimes meet one of
    # its threads still joinable and abort the process ("terminate called without an active
    # exception": 2 in 10 hand-written ring runs on a loaded machine); and for every mode the
    # teardown of torch and gRPC costs about half a second on 2 cores, on every run's critical path.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exchange(args: argparse.Namespace, cfg: C.RunConfig, rank: int):
    """The worker's exchange and the errors that mean it failed: the all-reduce group, or the PS
    client to the shards at --servers (or read from stdin, --servers-on-stdin)."""
    from psgd.core.errors import ExchangeError
    from psgd.train import assemble, rundir

    if cfg.mode == "allreduce":
        from psgd.allreduce.collective import CollectiveError

        if rank == 0:
            rundir.prepare_by_hand(cfg)  # under torchrun rank 0 prepares; the others write after the barrier

        exchange = assemble.collective_exchange(cfg, rank, init_method=args.rendezvous)
        errors = (CollectiveError,)
    else:
        addresses = args.servers
        if args.servers_on_stdin:
            # torch and the rest are imported by now; the shards may still be starting.
            try:
                addresses = C.parse_servers(sys.stdin.readline().strip() or "0")
            except ValueError as e:
                raise UsageError(f"--servers-on-stdin: {e}") from None
            if isinstance(addresses, int) or len(addresses) != cfg.servers:
                raise UsageError(f"--servers-on-stdin: expected {cfg.servers} HOST:PORT on stdin, got {addresses!r}")
        if isinstance(addresses, int):
            raise UsageError("psgd worker needs --servers HOST:PORT,... (the running shards, in shard order)")
        exchange, errors = assemble.ps_exchange(cfg, addresses), (ExchangeError,)
        if rank == 0:
            rundir.record_worker_settings(cfg, OWN)  # by hand: shard 0's config.json lacks a worker's settings
    return exchange, errors


def _die_written(metrics) -> None:
    """SIGTERM: write the deferred line, then die of the signal as before (the launcher reads it)."""
    metrics.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
