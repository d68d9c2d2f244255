"""`psgd server`: the main of one shard process (started by `psgd run`, `psgd node`, or by hand).

`main(argv)` is the process's main (the zygote of `psgd run` calls it); `cmd_server(args)` validates
the flags (one line, exit 2), builds the shard (psgd/train/assemble.py `shard`) and serves it
(psgd/ps/server.py `start`), prints READY host:port, and
serves until every worker left or a stop signal came; then it writes the shard's files
(snapshots, stats, `shard_end` in metrics.jsonl) and leaves without the interpreter's teardown.
With --lost-on-stdin (psgd run with --worker-lease) each `lost RANK` line is a worker the launcher
saw die, declared lost at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from psgd.core import config as C
from psgd.core.errors import UsageError
from psgd.core.shorthelp import add_short_help
from psgd.train import roles, threads  # rundir loads where used: see cmd_server
from psgd.train.roles import by_hand, config_from_args, not_read
from psgd.train.roles import token as token_

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}

# The settings only a shard reads (declared with the other rooms' in psgd/train/roles.py, which
# every process imports first): `psgd worker` refuses them, `psgd run` hands them to shards alone.
OWN = roles.SHARD_OWN

# Broken by hand: the raw formatter that keeps MODES_HELP's columns does not wrap descriptions.
SERVER_DESCRIPTION = """\
Serve one parameter shard: hold its slice of the parameters and its optimizer, apply the
workers' gradients under --mode's policy, answer their pulls. `psgd run` starts K of these
for you; start them by hand to put shards on other hosts (each one prints READY host:port
when it listens). It takes a shard's settings: a worker's (--seed, --transport, ...) are
refused, and go to `psgd worker`."""


def main(argv: list[str]) -> int:
    """`psgd server ARGV`: this process's main (psgd/train/roles.py `room_main`)."""
    return roles.room_main("server", add_parser, cmd_server, argv)


def add_parser(sub, epilog: str) -> None:
    """`psgd server`'s flags and help, as a subcommand of `sub` (psgd/cli.py's, or room_main's own)."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("server", help="serve one parameter shard (started by `psgd run`, or by hand)",
                       description=SERVER_DESCRIPTION, add_help=False,
                       usage="psgd server --shard K [a shard's settings] (-h: one line a flag, --help: in full)",
                       epilog=epilog, formatter_class=fmt)
    add_short_help(p)
    C.add_flags(p, elsewhere=not_read("shard"))
    p.epilog = roles.shards_only(p, epilog)  # a shard refuses --mode allreduce: not in its help either
    p.add_argument("--shard", type=int, required=True, help="which shard this process serves (0..K-1)")
    p.add_argument("--port", type=int, default=0,
                   help="TCP port (default: 0, any free port, printed as READY host:port)")
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; another needs a token, see --token-file)")
    p.add_argument("--insecure", action="store_true",
                   help="serve on a non-loopback --bind without a token: anyone who reaches it may push and pull")
    p.add_argument("--restore", metavar="DIR", default="",
                   help="start from this shard's newest intact checkpoint in DIR (e.g. OUT/checkpoints) "
                        "instead of a worker's Init; damaged ones are skipped with a warning")
    p.add_argument("--restore-upto", type=int, default=None, metavar="VERSION",
                   help="with --restore: the newest checkpoint of at most this version (psgd run --resume "
                        "picks the newest all shards have)")
    p.add_argument("--restore-clocks", default="", metavar="C0,C1,...",
                   help="with --restore: each worker's clock to resume at, at or past the checkpoint's (psgd run "
                        "aligns an async or SSP run's shards so: psgd/train/restart.py)")
    p.add_argument("--lost-on-stdin", action="store_true", help=argparse.SUPPRESS)  # psgd run's: `_read_losses`
    p.add_argument("--params", type=int, default=0,
                   help="parameters of the whole model (default: counted from --model and --dataset); "
                        "Init and pushes of another size are refused")


def cmd_server(args: argparse.Namespace, on_ready=None) -> int:
    """Serve until every worker left or a stop signal came; on the way out write the shard's files.
    `on_ready(port)` (psgd node's Publisher) runs once the shard listens; its NodeError stops it.

    First of all, before torch is even imported, block the stop signals in this thread: every
    thread started later inherits the mask (gRPC's, and torch's intra-op pool, which importing
    torch may start: one thread not blocking SIGTERM would take the launcher's and kill the
    process unsaved). So nothing imported before it may start a thread: rundir (and its metrics:
    numpy, whose import starts its BLAS thread pool) loads where it is used, after the mask
    (tests/test_layers.py holds psgd's CLI to one thread). The wait for them is here, a sigwait in
    this frame. Called in a process that goes on (a test), a refusal gives the mask back."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        cfg, srv = _listen(args, on_ready)
        if srv is None:
            return 1
        # Stop on a signal, or when every worker has left (a run started by hand ends by itself): the
        # watcher turns the latter into a SIGTERM for this thread, so one sigwait serves both.
        main = threading.get_ident()
        threading.Thread(target=lambda: (srv.shard.finished.wait(), signal.pthread_kill(main, signal.SIGTERM)),
                         name="psgd-finished", daemon=True).start()
        signal.sigwait(STOP_SIGNALS)
        _leave(args, cfg, srv)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # reached only when _leave did not os._exit
    return 0


def _config(args: argparse.Namespace) -> C.RunConfig:
    """The shard's validated config, its epochs resolved; a bad flag is a UsageError (exit 2)."""
    from psgd.ps import auth
    from psgd.train import data

    if not isinstance(args.servers, int):
        raise UsageError("psgd server takes --num-shards K (a count)")
    cfg = by_hand(config_from_args(args))
    if not 0 <= args.shard < cfg.servers:
        raise UsageError(f"--shard must be in 0..{cfg.servers - 1}, got {args.shard}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if cfg.mode == "allreduce":
        raise UsageError("--mode allreduce has no parameter servers")
    if token_(cfg) is None and not args.insecure and not auth.is_loopback(args.bind):
        raise UsageError(f"refusing to serve on {args.bind} without a token: anyone who reaches it could push "
                         "gradients and read the parameters; give --token-file FILE (or PSGD_TOKEN), or --insecure")
    if args.params < 0:
        raise UsageError(f"--params must be >= 0, got {args.params}")
    return C.with_epochs_resolved(cfg, data.train_size(cfg.data))


def _restored(args: argparse.Namespace, cfg: C.RunConfig) -> dict | None:
    """--restore's checkpoint of this shard (None without it); by hand, shard 0 prepares the folder."""
    from pathlib import Path

    from psgd.train import rundir

    clocks = getattr(args, "restore_clocks", "")  # psgd node builds its shard's arguments without it
    if clocks and not args.restore:
        raise UsageError("--restore-clocks sets the clocks of a restored shard: give --restore DIR too")
    if not args.restore:
        if args.shard == 0:
            rundir.prepare_by_hand(cfg)  # by hand, shard 0 is the run's first process (workers need it up)
        return None
    from psgd.ps import checkpoint

    found = checkpoint.newest(Path(args.restore), args.shard, upto=args.restore_upto,
                              warn=lambda w: print(f"psgd server: warning: {w}", file=sys.stderr, flush=True))
    if found is None:
        raise UsageError(f"--restore {args.restore}: no intact checkpoint of shard {args.shard}"
                         + (f" at version <= {args.restore_upto}" if args.restore_upto is not None else ""))
    restored, path = found
    print(f"shard {args.shard}: restored version {restored['version']} from {path}", file=sys.stderr, flush=True)
    return _aligned(clocks, restored) if clocks else restored


def _aligned(given: str, restored: dict) -> dict:
    """--restore-clocks: the checkpoint with each worker at the clock given (the pushes between its
    own clock and that one are skipped); a UsageError unless one clock per worker, none behind."""
    own = list(restored["clocks"])
    try:
        clocks = [int(c) for c in given.split(",")]
    except ValueError:
        clocks = []
    if len(clocks) != len(own) or any(c < o for c, o in zip(clocks, own, strict=True)):
        raise UsageError(f"--restore-clocks {given}: give one clock per worker ({len(own)}), none behind the "
                         f"checkpoint's {','.join(map(str, own))}")
    return {**restored, "clocks": clocks}


def _listen(args: argparse.Namespace, on_ready):
    """Build the shard (psgd/train/assemble.py `shard`), restore it, serve it (psgd/ps/server.py
    `start`) and say READY; returns (cfg, server), or (cfg, None) when it could not listen (exit 1)."""
    from psgd.core import rowconfig
    from psgd.ps import server, tls
    from psgd.train import assemble, data, models, rowshard

    cfg = _config(args)
    # The model's size, to check every Init against; the user's own model (or data) is sized by the
    # first Init instead, so a shard never imports the user's code.
    own = C.is_spec(cfg.model.model) or C.is_spec(cfg.data.dataset)
    num_params = args.params or (None if own else models.count(cfg.model, *data.SHAPES[cfg.data.dataset]))
    if rowconfig.by_key(cfg):  # the tables' rows are served apart (psgd/train/rowshard.py)
        num_params = args.params or rowshard.dense_count(cfg)
    restored = _restored(args, cfg)
    threads.set_threads(cfg, role="server")
    if dict(cfg.fail_shard_at).get(args.shard) == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection (--fail-shard-at K=0): die while starting
    try:
        core = assemble.shard(cfg, args.shard, num_params)  # the kernel and its collaborators (psgd/ps/shard.py)
        if restored is not None:
            core.restore(restored)  # before anything listens: no worker ever sees the shard uninitialised
        if rowconfig.by_key(cfg):
            rowshard.start(cfg, args.shard, args.bind, token_(cfg), core, restored)
        srv = server.start(core, args.bind, args.port, token=token_(cfg), tls_cert=cfg.tls_cert, tls_key=cfg.tls_key,
                           worker_lease=cfg.worker_lease)
    except tls.TlsError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:  # a checkpoint of another run
        raise UsageError(f"--restore {args.restore}: {e}") from None
    except OSError as e:
        print(f"psgd server: error: {e}", file=sys.stderr)
        return cfg, None
    print(f"READY {args.bind}:{srv.port}", flush=True)
    if on_ready is not None:
        from psgd.train.node import NodeError

        try:
            on_ready(srv.port)
        except NodeError as e:
            srv.stop(grace=0)
            print(f"psgd node: shard {args.shard}: error: {e}", file=sys.stderr, flush=True)
            return cfg, None
    print(f"shard {args.shard}/{cfg.servers} ({cfg.mode}) listening on {args.bind}:{srv.port}", file=sys.stderr,
          flush=True)
    if getattr(args, "lost_on_stdin", False):  # (psgd node's arguments have none: torchrun starts it)
        threading.Thread(target=_read_losses, args=(srv.shard,), name="psgd-losses", daemon=True).start()
    return cfg, srv


def _leave(args: argparse.Namespace, cfg: C.RunConfig, srv) -> None:
    """Stopped: write the shard's snapshots, stats and `shard_end`, and leave without the
    interpreter's teardown of torch and gRPC (on every run's critical path)."""
    from pathlib import Path

    from psgd.train import rundir
    from psgd.train.metrics import Metrics, process_start_time

    srv.stop()
    out = Path(cfg.out)
    srv.shard.save(out)
    from psgd.train import rowshard

    rowshard.save(out, args.shard, srv.shard.policy.version)  # the rows served beside it, if any
    m = Metrics(out / "metrics.jsonl")
    m.write(event="shard_end", process_start=process_start_time(), **srv.shard.stats())
    m.close()
    if srv.shard.finished.is_set() and args.shard == 0 and not os.environ.get(rundir.LAUNCHED):
        print(f"all {cfg.workers} workers finished; `psgd summarize {out}` writes its summary.json", file=sys.stderr,
              flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _read_losses(shard) -> None:
    """`psgd server --lost-on-stdin` (started so by `psgd run --worker-lease`): each `lost RANK` line
    is a worker whose process the launcher saw die, declared lost at once (the shard's `lose`)
    rather than after a lease of silence. The launcher's end closing (EOF) ends this thread."""
    for line in sys.stdin:
        word, _, rank = line.strip().partition(" ")
        if word != "lost" or not rank.isdigit():
            continue
        try:
            clock = shard.lose(int(rank))
        except ValueError:  # a rank out of range (PolicyError): not a worker of this run
            continue
        if clock is not None:
            print(f"shard {shard.index}: worker {rank} died (psgd run saw it): lost at clock {clock}; the run "
                  "goes on without it", file=sys.stderr, flush=True)
