"""The `psgd` command line: run | server | worker (and the suite / plot / bench commands).

Thin by design: parse flags into a RunConfig (psgd/core/config.py), validate once, call the module
that does the work, and turn known failures into one-line errors (exit 2 for usage errors,
1 for a failed run), never a traceback.

    psgd run --mode sync --workers 4 --servers 2 --model mlp --dataset synthetic --steps 200
    psgd server --port 50051 --shard 0 --num-shards 2 --workers 4 --mode sync
    psgd worker --rank 0 --servers 127.0.0.1:50051,127.0.0.1:50052 --workers 4 --mode sync
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from psgd.core import config as C
from psgd.core.errors import Parser, UsageError

MODES_HELP = """modes:
  sync       Bulk synchronous (BSP): each shard waits for one gradient from every worker,
             applies their mean once; nobody starts step t+1 before all finished step t.
  async      Every gradient is applied the moment it arrives; nobody ever waits, but a
             gradient is computed on parameters about N-1 updates old (stale).
  ssp        Stale synchronous parallel (Ho et al. 2013): applied on arrival like async, but a
             worker more than --staleness steps ahead of the slowest blocks until it catches up.
  allreduce  No servers: workers all-reduce their gradients (torch.distributed, NCCL or gloo,
             or the hand-written ring) and every replica takes the same optimizer step.
"""


def _pair(text: str) -> tuple[int, int]:
    try:
        a, b = text.split("=")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK=NUMBER, got {text!r}") from None


def _servers(text: str) -> int | list[str]:
    """`--servers 2` (how many shards to start) or `--servers h1:p1,h2:p2` (shards to use)."""
    if text.isdigit():
        return int(text)
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT[,HOST:PORT...], got {a!r}")
    return addresses


def add_run_flags(p: argparse.ArgumentParser) -> None:
    d, dd, dm, do = C.RunConfig(), C.DataConfig(), C.ModelConfig(), C.OptimConfig()
    g = p.add_argument_group("run")
    g.add_argument("--mode", default=d.mode, choices=C.MODES, help="consistency mode (see above)")
    g.add_argument("--workers", type=int, default=d.workers, help="number of workers N")
    g.add_argument("--servers", "--num-shards", dest="servers", type=_servers, default=d.servers,
                   help="parameter shards K to start (run), or HOST:PORT,... of running shards (worker)")
    g.add_argument("--staleness", type=int, default=d.staleness, help="SSP bound s (clock lead allowed)")
    g.add_argument("--steps", type=int, default=d.steps,
                   help="budget: run until steps x workers gradients were applied (= steps updates in sync)")
    g.add_argument("--epochs", type=float, default=d.epochs, help="budget in epochs instead of --steps (if > 0)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per worker per micro-batch")
    g.add_argument("--accumulate", type=int, default=d.accumulate, help="micro-batches accumulated per push")
    g.add_argument("--local-steps", type=int, default=d.local_steps, metavar="H",
                   help="local SGD: H optimizer steps on each worker's replica between synchronous averagings "
                        "(sync PS or allreduce; 1 = average every step)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of model init and batch order")
    g.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="snapshot parameters every this many updates, evaluated after the run (0: end only)")
    g.add_argument("--device", default=d.device, choices=C.DEVICES, help="where workers compute")
    g.add_argument("--wire-dtype", default=d.wire_dtype, choices=C.WIRE_DTYPES,
                   help="dtype of gradients and parameters on the wire (servers keep fp32)")
    g.add_argument("--straggler", type=_pair, action="append", default=[], metavar="RANK=MS",
                   help="worker RANK sleeps MS extra per step (repeatable)")
    g.add_argument("--jitter", type=float, default=d.jitter, metavar="MS",
                   help="every worker sleeps an exponential random delay of this mean per step")
    g.add_argument("--skip-nonfinite", action="store_true",
                   help="servers skip and count non-finite gradients instead of rejecting them")
    g.add_argument("--rpc-timeout", type=float, default=d.rpc_timeout, help="deadline of every RPC, seconds")
    g.add_argument("--fail-at", type=_pair, action="append", default=[], metavar="RANK=STEP",
                   help="fault injection: worker RANK kills itself (SIGKILL) at STEP")
    g.add_argument("--allreduce-impl", default=d.allreduce_impl, choices=C.ALLREDUCE_IMPLS,
                   help="allreduce: torch.distributed's all_reduce, or the hand-written ring (psgd/allreduce/ring.py)")
    g.add_argument("--bucket-mb", type=float, default=d.bucket_mb,
                   help="allreduce: gradients are reduced in flat buckets of this many MiB")
    g.add_argument("--backend", default=d.backend, choices=C.BACKENDS,
                   help="allreduce: torch.distributed backend (auto: nccl with one CUDA device per rank, else gloo)")
    g.add_argument("--check-every", type=int, default=d.check_every,
                   help="allreduce: compare a hash of every replica's parameters every this many updates "
                        "(and at the end; 0: end only)")
    g.add_argument("--overlap", action="store_true",
                   help="PS: push each shard's gradient as soon as backward produced it, pull while the batch "
                        "loads and forward runs (psgd/ps/overlap.py)")
    g.add_argument("--link", default=d.link, metavar="BANDWIDTH[,LATENCY]",
                   help="PS: pace every worker's and shard's traffic to an EMULATED link, e.g. 1gbit,200us or "
                        "100mbit,1ms (psgd/core/link.py; loopback is still what carries the bytes)")
    g.add_argument("--transport", default=d.transport, choices=C.TRANSPORTS,
                   help="PS: what carries pushes and pulls: grpc, or tcp (the shards' raw-socket data plane, "
                        "psgd/ps/tcp.py; gRPC still does Init and Info)")
    g.add_argument("--out", default=d.out, help="run folder: metrics.jsonl, summary.json, logs/")
    g = p.add_argument_group("data and model")
    g.add_argument("--dataset", default=dd.dataset, choices=C.DATASETS, help="training data")
    g.add_argument("--data-dir", default=dd.data_dir, help="MNIST IDX files; mnist1d cache (default ~/.cache/psgd)")
    g.add_argument("--num-samples", type=int, default=dd.num_samples, help="samples to generate (80%% train)")
    g.add_argument("--data-seed", type=int, default=dd.data_seed, help="seed of the generated dataset")
    g.add_argument("--shard-data", default=dd.shard_data, choices=C.SHARD_DATA,
                   help="noniid: sort by label, worker r trains on part r only; dirichlet: each class split "
                        "among workers in Dir(alpha) shares (Hsu et al. 2019)")
    g.add_argument("--dirichlet-alpha", type=float, default=dd.dirichlet_alpha, metavar="ALPHA",
                   help="dirichlet label skew: 100 is nearly IID, 0.1 gives most workers a few classes")
    g.add_argument("--val-fraction", type=float, default=dd.val_fraction,
                   help="hold this fraction of the training set out as a validation split (LR tuning)")
    g.add_argument("--model", default=dm.model, choices=C.MODELS, help="model to train")
    g.add_argument("--width", type=int, default=dm.width, help="hidden width (0: model default)")
    g = p.add_argument_group("optimizer (torch.optim.SGD, applied by the servers or every replica)")
    g.add_argument("--lr", type=float, default=do.lr, help="learning rate")
    g.add_argument("--momentum", type=float, default=do.momentum, help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=do.weight_decay, help="L2 weight decay")
    g.add_argument("--warmup", type=int, default=do.warmup, help="linear LR warmup over this many updates")


def config_from_args(a: argparse.Namespace) -> C.RunConfig:
    servers = a.servers if isinstance(a.servers, int) else len(a.servers)
    cfg = C.RunConfig(
        mode=a.mode, workers=a.workers, servers=servers, staleness=a.staleness, steps=a.steps,
        epochs=a.epochs, batch_size=a.batch_size, accumulate=a.accumulate, local_steps=a.local_steps, seed=a.seed,
        eval_every=a.eval_every, device=a.device, wire_dtype=a.wire_dtype,
        straggler=tuple(a.straggler), jitter=a.jitter, skip_nonfinite=a.skip_nonfinite,
        rpc_timeout=a.rpc_timeout, fail_at=tuple(a.fail_at), out=a.out, allreduce_impl=a.allreduce_impl,
        bucket_mb=a.bucket_mb, backend=a.backend, check_every=a.check_every, overlap=a.overlap, link=a.link,
        transport=a.transport,
        data=C.DataConfig(dataset=a.dataset, data_dir=a.data_dir, num_samples=a.num_samples,
                          data_seed=a.data_seed, shard_data=a.shard_data,
                          dirichlet_alpha=a.dirichlet_alpha, val_fraction=a.val_fraction),
        model=C.ModelConfig(model=a.model, width=a.width),
        optim=C.OptimConfig(lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay, warmup=a.warmup),
    )
    try:
        C.validate(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg


def build_parser() -> Parser:
    top = Parser(prog="psgd", description="Parameter-server and all-reduce SGD lab.",
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=MODES_HELP)
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("run", help="start servers and workers, train, evaluate, write OUT/summary.json",
                       description="Train one model with N workers and K parameter shards (or all-reduce).",
                       epilog=MODES_HELP, formatter_class=fmt)
    add_run_flags(p)
    p.add_argument("--quiet", action="store_true", help="print only the summary line")

    p = sub.add_parser("server", help="serve one parameter shard (started by `psgd run`, or by hand)",
                       epilog=MODES_HELP, formatter_class=fmt)
    add_run_flags(p)
    p.add_argument("--shard", type=int, required=True, help="which shard this process serves (0..K-1)")
    p.add_argument("--port", type=int, default=0, help="TCP port (0: any free port, printed as READY host:port)")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (0.0.0.0 for other hosts)")

    p = sub.add_parser("worker", help="train as one worker against running shards (or in an all-reduce group)",
                       epilog=MODES_HELP, formatter_class=fmt)
    add_run_flags(p)
    p.add_argument("--rank", type=int, default=None, help="worker id 0..N-1 (default: $RANK, for torchrun)")
    p.add_argument("--rendezvous", default="env://",
                   help="all-reduce group rendezvous: env:// ($MASTER_ADDR:$MASTER_PORT, torchrun), tcp://H:P or "
                        "file://PATH (psgd run uses a file in the run folder)")

    # These commands own their flags (each module builds its own Parser); the CLI only routes.
    for name, helptext in DELEGATED.items():
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    return top


# command -> one-line help; `psgd NAME ...` calls psgd.NAME.main(argv) (bench: psgd.bench).
DELEGATED = {
    "suite": "run an experiment suite (TOML) and write plots + REPORT.md",
    "plot": "plot convergence curves of runs on one figure",
    "bench": "benchmarks: transport | allreduce | scaling | calibrate",
    "model": "alpha-beta cost model: predict PS vs ring throughput up to 1024 workers",
}
MODULES = {"suite": "psgd.lab.suite", "plot": "psgd.lab.plots", "bench": "psgd.bench",
           "model": "psgd.bench.costmodel_cli"}


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs its own multi-line errors to stderr; ours are the one-line ones.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        # Hand everything after the name over untouched: argparse's REMAINDER would refuse a
        # first argument that looks like a flag (`psgd model --workers 8..1024`).
        args = argparse.Namespace(command=argv[0], rest=argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "server":
            return cmd_server(args)
        if args.command == "worker":
            return cmd_worker(args)
        if args.command in DELEGATED:
            import importlib

            return importlib.import_module(MODULES[args.command]).main(args.rest)
    except UsageError as e:
        print(f"psgd {args.command}: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


def cmd_run(args: argparse.Namespace) -> int:
    from psgd.train import data, launch

    if not isinstance(args.servers, int):
        raise UsageError("psgd run starts its own shards: give --servers a count, not addresses")
    cfg = config_from_args(args)
    try:
        cfg = C.with_epochs_resolved(cfg, data.train_size(cfg.data))
        summary = launch.run(cfg)
    except UsageError:
        raise  # e.g. --backend nccl without a GPU per worker: exit 2 like any usage error
    except (launch.RunFailed, FileNotFoundError, ValueError) as e:
        print(f"psgd run: failed: {e}", file=sys.stderr)
        return 1
    keys = ("mode", "workers", "servers", "global_updates", "wall_time_s", "updates_per_s", "samples_per_s",
            "final_test_accuracy", "final_test_loss")
    line = {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items() if k in keys}
    print(json.dumps(line) if args.quiet else f"{cfg.out}/summary.json: {json.dumps(line)}")
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from pathlib import Path

    from psgd.ps import server
    from psgd.train import data
    from psgd.train.metrics import Metrics

    if not isinstance(args.servers, int):
        raise UsageError("psgd server takes --num-shards K (a count)")
    cfg = config_from_args(args)
    if not 0 <= args.shard < cfg.servers:
        raise UsageError(f"--shard must be in 0..{cfg.servers - 1}, got {args.shard}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if cfg.mode == "allreduce":
        raise UsageError("--mode allreduce has no parameter servers")
    cfg = C.with_epochs_resolved(cfg, data.train_size(cfg.data))
    # Block the stop signals in every thread (gRPC's threads inherit this mask) and take them
    # synchronously below: a clean shutdown always writes the shard's stats and snapshots.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        srv = server.start(cfg, args.shard, args.bind, args.port)
    except OSError as e:
        print(f"psgd server: error: {e}", file=sys.stderr)
        return 1
    print(f"READY {args.bind}:{srv.port}", flush=True)
    print(f"shard {args.shard}/{cfg.servers} ({cfg.mode}) listening on {args.bind}:{srv.port}", file=sys.stderr,
          flush=True)
    signal.sigwait(stop_signals)
    srv.stop()
    out = Path(cfg.out)
    srv.shard.save(out)
    m = Metrics(out / "metrics.jsonl")
    m.write(event="shard_end", **srv.shard.stats())
    m.close()
    # Everything is written and closed: leave without the interpreter's teardown of torch and
    # gRPC (about half a second on 2 cores, on every run's critical path).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from psgd.core.errors import ExchangeError
    from psgd.ps.exchange import PSExchange
    from psgd.train import data, worker
    from psgd.train.metrics import Metrics

    cfg = config_from_args(args)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "-1"))
    if not 0 <= rank < cfg.workers:
        raise UsageError(f"--rank must be in 0..{cfg.workers - 1} (or set $RANK), got {rank}")
    # `psgd run` resolved --epochs already; by hand or under torchrun the worker is the first to know.
    cfg = C.with_epochs_resolved(cfg, data.train_size(cfg.data))
    if cfg.mode == "allreduce":
        from psgd.allreduce.collective import CollectiveError, CollectiveExchange

        exchange, errors = CollectiveExchange.from_env(cfg, rank, init_method=args.rendezvous), (CollectiveError,)
    else:
        if isinstance(args.servers, int):
            raise UsageError("psgd worker needs --servers HOST:PORT,... (the running shards, in shard order)")
        exchange, errors = PSExchange.from_config(cfg, args.servers), (ExchangeError,)
    metrics = Metrics(Path(cfg.out) / "metrics.jsonl")
    code = 0
    try:
        worker.train(cfg, rank, exchange, metrics)
    except errors as e:
        print(f"psgd worker {rank}: error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        metrics.close()
    # Leave without the interpreter's teardown: the metrics (and the all-reduce replica files) are
    # written and closed. After a gloo group has run, C++ destructors at exit sometimes meet one of
    # its threads still joinable and abort the process ("terminate called without an active
    # exception": 2 in 10 hand-written ring runs on a loaded machine); and for every mode the
    # teardown of torch and gRPC costs about half a second on 2 cores, on every run's critical path.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
