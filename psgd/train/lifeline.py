"""A child of `psgd run` dies with its launcher, however the launcher dies.

Contract: the launcher puts its pid in the children's environment (`env_for_children`); each
child calls `die_with_launcher()` first thing, which asks Linux to SIGKILL it when its parent
dies (PR_SET_PDEATHSIG) and exits at once if the launcher is already gone (it died between
starting this process and the request: the kernel would never send the signal). Processes not
started by `psgd run` (by hand, torchrun) are left alone. Elsewhere than Linux there is no
PR_SET_PDEATHSIG: the launcher's own cleanup (SIGTERM, then SIGKILL, on every exit path) is all.

Why the child asks for it itself rather than the launcher in a `preexec_fn` between fork and
exec: a `preexec_fn` makes Python fork() for real (not vfork), and fork runs every library's
atfork handlers in the child. gRPC's, in a launcher process that has used gRPC (a test process,
the suite), restart gRPC's poller thread in the child, which then finds its epoll descriptor
closed by close_fds and aborts the child before it reaches exec (grpc/grpc#43157; seen here as
a worker "died with signal SIGABRT" about once in two full test runs).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID = "PSGD_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def env_for_children() -> dict[str, str]:
    return {LAUNCHER_PID: str(os.getpid())}


def die_with_launcher() -> None:
    """In a child of `psgd run`: die with the launcher (see the module docstring); else nothing."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(launcher):
        os._exit(1)  # the launcher died before the request: no signal will ever come
