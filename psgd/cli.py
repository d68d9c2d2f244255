"""The `psgd` command line: run | server | worker (and the suite / plot / trace / bench / model commands).

Thin by design: parse flags into a RunConfig (psgd/core/config.py), validate once, call the module
that does the work, and turn known failures into one-line errors (exit 2 for usage errors,
1 for a failed run), never a traceback.

    psgd run --mode sync --workers 4 --servers 2 --model mlp --dataset synthetic --steps 200
    psgd server --port 50051 --shard 0 --num-shards 2 --workers 4 --mode sync
    psgd worker --rank 0 --servers 127.0.0.1:50051,127.0.0.1:50052 --workers 4 --mode sync
    psgd summarize results/runs/by-hand
    torchrun --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1 \
        -m psgd node --servers 1 --mode sync      # ranks 0..K-1 serve, the rest train (psgd/train/node.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from psgd.core import config as C
from psgd.core.errors import Parser, UsageError
from psgd.core.shorthelp import add_short_help
from psgd.sim import flags as sim_flags
from psgd.train import serve, work
from psgd.train.roles import MODES_HELP, by_hand, check_data, config_from_args, not_read, shards_only, worker_device_of  # noqa: F401 - re-exported
from psgd.train.roles import token as _token  # noqa: F401 - re-exported
from psgd.train.serve import STOP_SIGNALS, cmd_server  # noqa: F401 - each process's main lives in its room
from psgd.train.work import cmd_worker
from psgd.train.work import join as _join  # noqa: F401 - re-exported

SUMMARIZE_DESCRIPTION = """\
Evaluate the parameter snapshots of a finished run and write OUT/summary.json (throughput,
accuracy, staleness, time split, start-up apart). `psgd run` does this itself; run it after a
run started by hand (psgd server / psgd worker) or by torchrun, once its processes ended.
Running it again gives the same files."""

NODE_DESCRIPTION = """\
One process of a parameter-server run started by torchrun (or Slurm / Kubernetes through
torchrun): ranks 0..K-1 serve shards 0..K-1, ranks K.. train as workers 0..N-1
(N = WORLD_SIZE - K unless --workers says). The shards publish their addresses in
torchrun's rendezvous store; the workers read them there. Give every node the same flags;
afterwards `psgd summarize OUT`. See psgd/train/node.py."""



def build_parser() -> Parser:
    top = Parser(prog="psgd", description="Parameter-server and all-reduce SGD lab.",
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=MODES_HELP)
    top.add_argument("--version", action=_Version, help="print psgd's version and exit")
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    fmt = argparse.RawDescriptionHelpFormatter

    _add_run(sub)

    p = sub.add_parser("certs", help="make a lab CA and a shard certificate for --tls-cert / --tls-ca",
                       description="Write DIR/ca.pem, DIR/ca-key.pem, DIR/server.pem and DIR/server-key.pem: a "
                                   "lab CA and one certificate valid for every shard host. Shards: --tls-cert "
                                   "DIR/server.pem --tls-key DIR/server-key.pem; workers: --tls-ca DIR/ca.pem.",
                       formatter_class=fmt)
    p.add_argument("dir", metavar="DIR", help="folder to write the four PEM files into")
    p.add_argument("--hosts", required=True,
                   help="comma-separated addresses (or names) the shards are reached at, e.g. 127.0.0.1,198.18.0.2")

    p = sub.add_parser("summarize", help="evaluate a finished run folder and write OUT/summary.json",
                       description=SUMMARIZE_DESCRIPTION, formatter_class=fmt)
    p.add_argument("out", metavar="OUT", help="the run folder (holds config.json and metrics.jsonl)")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    p.add_argument("--tensorboard", metavar="DIR", default="",
                   help="also write the run's curves as TensorBoard event files into DIR/<run folder name> "
                        "(psgd/train/tboard.py)")
    p.add_argument("--of-run", metavar="CONFIG_JSON", default="", help=argparse.SUPPRESS)  # finish.in_fork's child

    serve.add_parser(sub, MODES_HELP)
    work.add_parser(sub, MODES_HELP)

    _add_node(sub)

    # These commands own their flags (each module builds its own Parser); the CLI only routes.
    for name, helptext in DELEGATED.items():
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    return top


class _Version(argparse.Action):
    """`psgd --version`: `psgd 0.1.0`, the installed distribution's (psgd.version()), read only when asked."""
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import psgd  # noqa: PLC0415

        print(f"psgd {psgd.version()}")  # on stdout, as argparse's own version action prints
        parser.exit()


def _add_run(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("run", help="start servers and workers, train, evaluate, write OUT/summary.json",
                       description="Train one model with N workers and K parameter shards (or all-reduce).",
                       usage="psgd run [--mode M --workers N --servers K ...] (-h: one line a flag, --help: in full)",
                       add_help=False, epilog=MODES_HELP, formatter_class=fmt)
    add_short_help(p)
    C.add_flags(p)
    sim_flags.add_flags(p)  # --simulate and its time model (psgd/sim/)
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    p.add_argument("--resume", metavar="OUT", default="",
                   help="continue the stopped run in OUT from its shards' checkpoints (--checkpoint-every), "
                        "with its own config.json (give no other flags)")
    p.add_argument("--tensorboard", metavar="DIR", default="",
                   help="while it trains, write its curves (training loss per update, evaluations, step times, "
                        "staleness, throughput) as TensorBoard event files into DIR/<run folder name> (pip install "
                        "'psgd[tensorboard]')")
    p.add_argument("--live-eval", action="store_true",
                   help="with --tensorboard and --checkpoint-every: evaluate the checkpoints while it trains, in a "
                        "process of its own at low priority (it takes CPU from the run: off by default)")
    p.add_argument("--cold-start", action="store_true",
                   help="start every shard and worker as a fresh `python -m psgd` process instead of forking "
                        "them from the run's warm parent, which imports torch once (psgd/train/zygote.py); "
                        "for debugging: the same results, slower start-up")


def _add_node(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("node", help="one process of a PS run under torchrun: a shard or a worker, by $RANK",
                       description=NODE_DESCRIPTION, usage="psgd node [--servers K] [a run's settings] "
                                                          "(-h: one line a flag, --help: in full)",
                       add_help=False, epilog=MODES_HELP, formatter_class=fmt)
    add_short_help(p)
    C.add_flags(p)
    p.epilog = shards_only(p, MODES_HELP)  # it refuses --mode allreduce: not in its help either
    for action in p._actions:  # N is WORLD_SIZE - K unless given: the schema's default (2) does not apply
        if action.dest == "workers":
            action.default, action.help = None, "number of workers N (default: WORLD_SIZE - K)"
    p.add_argument("--bind", default="127.0.0.1",
                   help="shard ranks listen on this address, port 0 (default: 127.0.0.1; another needs a token, "
                        "see --token-file)")
    p.add_argument("--advertise", default="", metavar="ADDR",
                   help="the address workers reach a shard at, published in torchrun's store (default: --bind; "
                        "needed with --bind 0.0.0.0)")
    p.add_argument("--insecure", action="store_true",
                   help="serve on a non-loopback --bind without a token: anyone who reaches it may push and pull")
    p.add_argument("--shards-timeout", type=float, default=300.0, metavar="S",
                   help="how long a worker waits for torchrun's store and the shards' addresses in it "
                        "(default: 300)")


# command -> one-line help; `psgd NAME ...` calls psgd.NAME.main(argv) (bench: psgd.bench).
DELEGATED = {
    "suite": "run an experiment suite (TOML) and write plots + REPORT.md",
    "plot": "plot runs on one figure: convergence curves, staleness, where the time went",
    "trace": "per-worker timeline of one run: wait / pull / compute / push of every step",
    "bench": "benchmarks: transport | allreduce | scaling | scale | roundtrip | calibrate | peers | cluster | "
             "startup | utilisation | transformer | drill",
    "model": "alpha-beta cost model: predict PS vs ring throughput up to 1024 workers",
    "doctor": "what this host offers (torch, CUDA, GPUs); --gpu checks psgd on its GPUs (make gpu-check)",
    "cluster": "hosts as network namespaces with kernel-shaped links: up | status | exec | down (needs root)",
    "drill": "a run under a seeded storm of SIGKILLs (--chaos SEED:COUNT): shards, workers, the zygote",
}
MODULES = {"suite": "psgd.lab.suite", "plot": "psgd.lab.plots", "bench": "psgd.bench",
           "model": "psgd.bench.costmodel_cli", "trace": "psgd.lab.trace",
           "doctor": "psgd.lab.doctor", "cluster": "psgd.cluster.command", "drill": "psgd.train.drill"}


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs its own multi-line errors to stderr; ours are the one-line ones.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    _show_warnings()
    from psgd.train import lifeline

    lifeline.die_with_launcher()  # a child of psgd run: first thing, before the imports that take time
    from psgd.train import cpulimit

    cpulimit.enter_from_env()  # psgd run --cpu-quota: into this device's CPU quota before any work
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        # Hand everything after the name over untouched: argparse's REMAINDER would refuse a
        # first argument that looks like a flag (`psgd model --workers 8..1024`).
        args = argparse.Namespace(command=argv[0], rest=argv[1:])
    else:
        args = parser.parse_args(argv)
        from psgd.train import proctitle

        proctitle.name_from_args(args)  # `psgd shard K/S OUT`, `psgd worker R/N OUT` in ps (else nothing)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "server":
            return cmd_server(args)
        if args.command == "worker":
            return cmd_worker(args)
        if args.command == "node":
            return cmd_node(args)
        if args.command == "summarize":
            return cmd_summarize(args)
        if args.command == "certs":
            from psgd.ps import tls  # grpc and cryptography: only for this command

            return tls.cmd_certs(args.dir, args.hosts)
        if args.command in DELEGATED:
            import importlib

            return importlib.import_module(MODULES[args.command]).main(args.rest)
    except UsageError as e:
        print(f"psgd {args.command}: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


class _Stderr(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:  # sys.stderr as it is now: a test's capture too
        print(self.format(record), file=sys.stderr, flush=True)


def _show_warnings() -> None:
    """The library's warnings (psgd's logger: a worker restarted, a run restarted from a checkpoint)
    as the command's own lines, the message alone on stderr; INFO and DEBUG stay for a program that
    asks (psgd/__init__.py). Once per process, however often main runs."""
    logger = logging.getLogger("psgd")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr(logging.WARNING))


def cmd_run(args: argparse.Namespace) -> int:
    """`psgd run`: the pre-flight (psgd/train/preflight.py, shared with psgd.fit), the live line,
    the run (psgd/train/launch.py), the summary line. Ctrl-C in any phase (start-up, training,
    evaluation, the summary) is one line and exit 130, like any interrupted command: the launcher
    has stopped every child by then (on its way out of the phase it was in), so nothing is left to say."""
    from psgd.train import launch, preflight, progress, tboard  # no torch: the launcher imports it after training
    from psgd.train.supervise import INTERRUPTED, Interrupted, RunFailed

    try:
        cfg, sim = _run_config(args), sim_flags.sim_config(args)
        if sim is not None:
            from psgd.sim import run as sim_run

            sim_run.check(cfg)  # what it does not model: one line, exit 2, before any folder
            if args.live_eval:
                raise UsageError("--live-eval evaluates a real run's checkpoints while it trains: not with --simulate")
        cfg = preflight.prepare(cfg, tensorboard=bool(args.tensorboard), resume=bool(args.resume),
                                live_eval=args.live_eval)
        if sim is not None:  # the job as a simulated cluster in this process (psgd/sim/)
            return sim_flags.run_simulated(cfg, sim, lambda s, out: print(f"SIMULATED: {summary_line(s, out)}"))
        with progress.live(Path(cfg.out), cfg.budget, f"psgd run {cfg.mode}", enabled=not args.quiet):
            tb = tboard.run_dir(Path(args.tensorboard), Path(cfg.out)) if args.tensorboard else None
            summary = launch.run(cfg, resume=bool(args.resume), cold_start=args.cold_start, tensorboard=tb,
                                 prepared=True, live_eval=args.live_eval)
    except (KeyboardInterrupt, Interrupted):
        print(f"psgd run: failed: {INTERRUPTED}", file=sys.stderr, flush=True)
        return 130
    except UsageError:
        raise  # e.g. --backend nccl without a GPU per worker: exit 2 like any usage error
    except (RunFailed, FileNotFoundError, ValueError) as e:
        print(f"psgd run: failed: {e}", file=sys.stderr)
        return 1
    print_summary(summary, cfg.out, args.quiet)
    return 0


def _run_config(args: argparse.Namespace) -> C.RunConfig:
    """`psgd run`'s flags as a RunConfig; with --resume OUT (and no other flag) that run's own."""
    from psgd.train import restart

    if not isinstance(args.servers, int):
        raise UsageError("psgd run starts its own shards: give --servers a count, not addresses")
    cfg = config_from_args(args)
    if args.resume:
        if C.to_dict(cfg) != C.to_dict(C.RunConfig()):
            raise UsageError("--resume OUT continues the run with its own OUT/config.json: give no other flags")
        cfg = restart.resumable(Path(args.resume))
    return cfg


def print_summary(summary: dict, out: str, quiet: bool) -> None:
    """The one-line summary of a run, in README's words (summary.json has every figure, exactly):
    `sync, 4 workers: 12,345 samples/s, 1,087 gradients/s, mean staleness 0.00, start-up 0.5 s,
    training 1.4 s, test accuracy 0.875 -> OUT/summary.json`. Samples/s and gradients/s compare
    the modes on equal terms (a sync update is N gradients, an async one is one); staleness is the
    price async pays for them (all-reduce has none: left out). `quiet` prints the same line. A
    training loss that rose at the end (summary.json's `loss_rose`) adds its warning on stderr."""
    print(summary_line(summary, out))
    if summary.get("loss_rose"):
        from psgd.train.divergence import Rise  # noqa: PLC0415

        print(Rise(**summary["loss_rose"]).message(), file=sys.stderr)


def summary_line(summary: dict, out: str) -> str:
    parts = [f"{summary.get('samples_per_s') or 0:,.0f} samples/s",
             f"{summary.get('worker_steps_per_s') or 0:,.0f} gradients/s"]
    staleness = (summary.get("staleness") or {}).get("mean")
    if staleness is not None:
        parts.append(f"mean staleness {staleness:.2f}")
    parts += [f"start-up {summary.get('startup_s') or 0:.1f} s", f"training {summary.get('wall_time_s') or 0:.1f} s"]
    if summary.get("final_test_accuracy") is not None:
        parts.append(f"test accuracy {summary['final_test_accuracy']:.3f}")
    elif summary.get("final_test_loss") is not None:   # a regression --loss: psgd has no accuracy to report
        loss = ((summary.get("config") or {}).get("model") or {}).get("loss") or "cross_entropy"
        parts.append(f"test loss {summary['final_test_loss']:.4g} ({loss})")
    workers = summary.get("workers")
    return f"{summary.get('mode')}, {workers} worker{'s' if workers != 1 else ''}: {', '.join(parts)} -> " \
           f"{Path(out) / 'summary.json'}"


def cmd_summarize(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.tensorboard:
        from psgd.train import tboard

        tboard.require()

    from psgd.train import data, finish, rundir
    from psgd.train.supervise import RunFailed

    out = Path(args.out)
    if args.of_run:  # psgd run's evaluation, forked by its warm parent (finish.in_fork): its config, no output
        return _finish_of_run(out, C.from_dict(json.loads(args.of_run)))
    if not (out / rundir.MARKER).exists() or not (out / "config.json").is_file():
        raise UsageError(f"{out} is not a psgd run folder (no {rundir.MARKER} and config.json in it)")
    try:
        cfg = C.from_dict(json.loads((out / "config.json").read_text()))
    except (ValueError, TypeError) as e:
        raise UsageError(f"{out}/config.json: {e}") from None
    cfg = dataclasses.replace(cfg, out=str(out))  # the folder may have moved since the run
    try:
        summary = finish.finish(cfg, data.load(cfg.data))
    except (RunFailed, FileNotFoundError) as e:
        print(f"psgd summarize: failed: {e}", file=sys.stderr)
        return 1
    if args.tensorboard:
        from psgd.train import tboard

        tboard.write(out, tboard.run_dir(Path(args.tensorboard), out))
    print_summary(summary, str(out), args.quiet)
    return 0


def _finish_of_run(out, cfg: C.RunConfig) -> int:
    """`finish.finish` for psgd run: `evaluating K N` lines on stdout, its failure as one line."""
    from psgd.train import finish
    from psgd.train.supervise import RunFailed

    def said(k: int, n: int) -> None:
        print(f"{finish.EVAL_LINE} {k} {n}", flush=True)

    finish.inject_fault()  # $PSGD_FINISH_FAULT, tests' and drills': this child's warm parent goes
    try:
        finish.finish(cfg, on_eval=said)
    except (RunFailed, FileNotFoundError) as e:
        print(f"psgd summarize: failed: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """Under torchrun: serve shard RANK (RANK < K) or train as worker RANK - K (psgd/train/node.py).
    The role comes from the environment alone, before torch loads: a shard must block its stop
    signals first (cmd_server)."""
    from psgd.train import node

    # c10d's C++ side logs each failed connection to torchrun's store with a stack trace; ours is
    # the one-line error (TORCH_CPP_LOG_LEVEL=INFO shows theirs). Read when torch loads, i.e. later.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    env = node.from_environ(os.environ)
    if not isinstance(args.servers, int):
        raise UsageError("psgd node starts its own shards on ranks 0..K-1: give --servers a count, not addresses")
    if args.mode == "allreduce":
        raise UsageError("--mode allreduce has no shards: under torchrun run `psgd worker --mode allreduce`")
    args.workers = node.workers_of(env.world_size, args.servers, args.workers)
    cfg = config_from_args(args)  # every rank refuses bad flags alike, before any of them listens
    if not args.shards_timeout > 0:
        raise UsageError(f"--shards-timeout must be > 0 seconds, got {args.shards_timeout}")
    advertise = args.advertise or args.bind
    if advertise in ("0.0.0.0", "::"):
        raise UsageError(f"--bind {args.bind} listens on every address: give --advertise ADDR, the one workers "
                         "reach this host at")
    me = node.role(env.rank, cfg.servers)
    if me.kind == "shard":
        args.shard, args.port, args.restore, args.restore_upto, args.params = me.index, 0, "", None, 0
        publisher = node.Publisher(env, me.index, advertise, args.shards_timeout)
        return cmd_server(args, on_ready=publisher.publish)
    try:
        addresses = node.wait_for_shards(node.connect(env, args.shards_timeout), cfg.servers, args.shards_timeout)
    except node.NodeError as e:
        print(f"psgd node: worker {me.index}: error: {e}", file=sys.stderr)
        return 1
    args.rank, args.servers, args.servers_on_stdin, args.rendezvous = me.index, addresses, False, "env://"
    return cmd_worker(args)


