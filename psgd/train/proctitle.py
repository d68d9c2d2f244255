"""Processes that say what they are: `psgd zygote OUT`, `psgd shard K/S OUT`, `psgd worker R/N OUT`.

Why: `psgd run` forks every shard and worker from one warm parent (psgd/train/zygote.py), so
without this every process of a run shows in ps, top and py-spy as the zygote's command line
(`python -m psgd.train.zygote OUT 4`), and one cannot tell which pid is worker 1.

Contract:
- `set_title(title)` names this process: its command line (/proc/PID/cmdline, what `ps -f`,
  top's `c` and py-spy show) through setproctitle, a dependency, and the kernel's short name
  (/proc/PID/comm, `ps -o comm`) through prctl(PR_SET_NAME): its first 15 bytes with dashes for
  spaces (`psgd-worker-1/2`: `kernel_name`), because tools split /proc/PID/stat by whitespace.
  Elsewhere than Linux only the command line. It never raises.
- The names (`zygote`, `shard`, `worker`) are the launcher's own (`Child.name`, psgd/train/launch.py):
  `shard K/S` and `worker R/N` with K and R 0-based, S shards and N workers, the words its exit and
  fault messages use (`worker 1/2 (pid 4242) died with signal SIGKILL`), so a message names the
  process `ps` shows. OUT, the run folder, tells two runs' processes apart.
- `name_from_args(args)`: psgd/cli.py's parsed arguments; a `psgd server` or `psgd worker` names
  itself (forked by the zygote, exec'd by `psgd run --cold-start`, or started by hand), and so
  does a `psgd node` under torchrun or srun, by the role its rank gives it (psgd/train/node.py
  `role`: `psgd shard K/S OUT` or `psgd worker R/N OUT`, not `python -u -m psgd node ...` for
  every one); any other command is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

PREFIX = "psgd"
_PR_SET_NAME = 15
BY_HAND_OUT = "results/runs/by-hand"  # psgd/cli.py `by_hand`: an empty --out of a process started by hand


def zygote_title(out: str) -> str:
    return f"{PREFIX} zygote {out}"


def shard_name(k: int, shards: int) -> str:
    """The launcher's name for shard K of S (its messages and `ps` say the same)."""
    return f"shard {k}/{shards}"


def worker_name(r: int | str, workers: int) -> str:
    return f"worker {r}/{workers}"


def title(name: str, out: str) -> str:
    return f"{PREFIX} {name} {out}" if out else f"{PREFIX} {name}"


def set_title(text: str) -> None:
    """Name this process `text` (see the module docstring)."""
    try:
        import setproctitle  # noqa: PLC0415 - a C extension: loaded by the processes that name themselves
    except ImportError:
        setproctitle = None
    if setproctitle is not None:
        try:
            setproctitle.setproctitle(text)  # it sets the kernel's name too, spaces and all: set again below
        except Exception:  # noqa: BLE001 - a name is a courtesy: never the reason a process fails
            pass
    set_kernel_name(text)


def kernel_name(text: str) -> str:
    """The kernel's name for `text`: its first 15 bytes, with a dash for every space. Tools read
    /proc/PID/stat by whitespace, and its second field is this name: Slurm's process tracker
    (proctrack/linuxproc's kill_tree, `"%ld %s %*s %ld"`) read `(psgd worker 1/2)` as parent pid 1,
    so a cancelled job's psgd tasks were no descendants of its step daemon and were never signalled
    (the job stayed COMPLETING; the tasks outlived it)."""
    return "-".join(text.split())[:15].rstrip("-")


def set_kernel_name(text: str) -> bool:
    """prctl(PR_SET_NAME): the kernel's 15-byte name (/proc/PID/comm, `kernel_name`); False where it
    cannot be set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(kernel_name(text).encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def name_from_args(args) -> str | None:
    """psgd/cli.py's parsed arguments: name a `psgd server` or `psgd worker` process (see the module
    docstring); returns the title set, or None (another command, or arguments it cannot read)."""
    try:
        if args.command == "server":
            servers = args.servers if isinstance(args.servers, int) else len(args.servers)
            text = title(shard_name(args.shard, servers), args.out or BY_HAND_OUT)
        elif args.command == "worker":
            rank = args.rank if args.rank is not None else os.environ.get("RANK", "?")  # --join: not known yet
            text = title(worker_name(rank, args.workers), args.out or BY_HAND_OUT)
        elif args.command == "node":
            text = title(node_name(args, os.environ), args.out or BY_HAND_OUT)
        else:
            return None
    except (AttributeError, TypeError, ValueError):
        return None
    set_title(text)
    return text


def node_name(args, environ) -> str:
    """`psgd node`'s name by its rank under torchrun or srun; a UsageError (a ValueError) where the
    variables or flags give none: cmd_node then refuses the process in its own words."""
    from psgd.train import node  # noqa: PLC0415 - stdlib only; the one command that needs it

    env, servers = node.from_environ(environ), args.servers
    me = node.role(env.rank, servers)
    if me.kind == "shard":
        return shard_name(me.index, servers)
    return worker_name(me.index, node.workers_of(env.world_size, servers, args.workers))
