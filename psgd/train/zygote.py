"""One warm parent per run: torch imported once, then every shard and worker forked from it.

Why: importing torch (with numpy and psgd's modules) is most of a process's start-up, and each of
a run's N + K processes paid it on the same cores (docs/architecture.md, "Processes", has the
measurements). PyTorch's DataLoader workers and multiprocessing's forkserver with preloaded
modules do the same: fork after the import.

Contract (this module is the zygote's process; the launcher's handle on it is psgd/train/warm.py):
- `python -m psgd.train.zygote TAG FD` names itself `psgd zygote TAG` (psgd/train/proctitle.py;
  each fork then names itself `psgd shard K/S OUT` or `psgd worker R/N OUT` as it parses its
  arguments), talks to its launcher over the Unix socket FD, dies with the launcher
  (PR_SET_PDEATHSIG), imports what is safe to import before a fork (`PRELOAD`: torch, numpy,
  protobuf's messages and psgd's training and shard modules; never gRPC), says ready, then serves
  requests one at a time.
- A request forks a child that runs `psgd ARGV` (a shard or a worker: its room's `main`, `ROOMS`;
  anything else what `python -m psgd ARGV` runs) with the request's environment and working
  folder, the three descriptors sent with it as 0, 1 and 2, in a session of its own, dying with the
  zygote. The zygote reaps its children and reports each exit.
- The child leaves the zygote's loop before it runs anything: `serve` returns its request to the
  module's top, which runs it (`run_child`), so a shard's stack is its room's calls and one more.
- Fork safety: before every fork the zygote checks that nothing fork-unsafe exists in it: gRPC not
  imported (its atfork handlers and poller thread: psgd/train/lifeline.py tells that story), CUDA
  not initialised, torch's intra-op pool not started (it never computes). If anything is, it
  refuses with one line naming it, and the launcher fails the run with that line. The zygote has
  no thread of its own: one loop over its socket and a SIGCHLD self-pipe.
- `psgd run --cold-start` keeps the old way (each child `exec`s `python -m psgd ...`), for
  debugging; so does a run on cluster hosts (`--hosts`: each child enters its namespace through
  `ip netns exec`).
- The wire, both sides: length-prefixed JSON (`send`, `recv`), descriptors alongside.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
from typing import NamedTuple

from psgd.train import lifeline, proctitle

# What every child imports anyway (`python -m psgd` then psgd.cli's commands), by name: warming them
# here is a cache, not a dependency of this module on the layers above it.
PRELOAD = ("torch", "numpy", "psgd.cli", "psgd.core.config", "psgd.core.optim", "psgd.train.data",
           "psgd.train.models", "psgd.train.losses", "psgd.train.worker", "psgd.train.metrics",
           # protobuf's messages and the shard's pure parts (protobuf's text_format alone is a
           # noticeable share of a child's CPU), none of which loads gRPC.
           "psgd._proto.parameter_server_pb2", "psgd.ps.wire", "psgd.ps.shard", "psgd.ps.framing",
           "psgd.core.sparsify", "psgd.core.consistency", "psgd.core.link",
           # the rooms' mains and what they read before gRPC (psgd/ps/auth.py holds no gRPC, its
           # gRPC side is psgd/ps/grpc_auth.py)
           "psgd.train.launch", "psgd.train.serve", "psgd.train.work", "psgd.train.evaluate",
           "psgd.train.rundir", "psgd.train.threads",
           "psgd.core.localsgd", "psgd.core.sharding", "psgd.core.staleness", "psgd.ps.pull_streams",
           "psgd.ps.remedies", "psgd.ps.staging", "psgd.ps.transfer")
# The commands whose forks go straight to their room's main (psgd/train/roles.py).
ROOMS = {"server": "psgd.train.serve", "worker": "psgd.train.work"}

# gRPC's C core must never be loaded in a parent that forks (the messages, parameter_server_pb2, are
# protobuf's alone; the stubs, parameter_server_pb2_grpc, import grpc).
UNSAFE_MODULES = ("grpc", "psgd._proto.parameter_server_pb2_grpc")
READY_TIMEOUT_S = 120.0


# -- the wire: length-prefixed JSON, descriptors alongside ------------------------------------------
def send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    data = json.dumps(msg).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = b""
    while len(buf) < n:
        data, got, _, _ = socket.recv_fds(sock, n - len(buf), 8)
        if not data:
            raise EOFError("the other side closed the socket")
        fds.extend(got)
        buf += data
    return buf


def recv(sock: socket.socket) -> tuple[dict, list[int]]:
    fds: list[int] = []
    (size,) = struct.unpack("!I", _recv_exact(sock, 4, fds))
    return json.loads(_recv_exact(sock, size, fds)), fds


# -- the zygote's side ---------------------------------------------------------------------------------
class Request(NamedTuple):
    """What a forked child is to run: the request, its descriptors, and what of the zygote it closes."""
    req: dict
    fds: list[int]
    sock: socket.socket
    wake: tuple[int, ...]
    zygote_pid: int


def unsafe_to_fork() -> str | None:
    """Why this process must not fork now, or None (see the module docstring)."""
    loaded = [m for m in UNSAFE_MODULES if m in sys.modules]
    if loaded:
        return (f"{loaded[0]} is loaded in the zygote: a fork would copy gRPC's state (its atfork handlers "
                "abort children)")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the zygote: a forked child cannot use it"
    return None


def run_child(child: Request) -> None:
    """In the forked child: become `psgd ARGV` and never return. First of all, die with the zygote:
    it may be killed between the fork and this line, so the pid to compare is the one it had before
    the fork (asked for after, getppid() would name whoever adopted this orphan)."""
    code = 1
    try:
        _become(child)
        argv = child.req["argv"]
        room = ROOMS.get(argv[0]) if argv else None
        if room is not None:  # a shard or a worker: straight to its room's main, not through psgd/cli.py
            raise SystemExit(importlib.import_module(room).main(argv[1:]))
        # Anything else: what `python -m psgd ARGV` runs (psgd/__main__.py, which raises SystemExit
        # with the code), through the process's entry point rather than an import of the CLI here.
        runpy.run_module("psgd", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a traceback in the child's log, as `python -m psgd` would print
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _become(child: Request) -> None:
    """The child's process state: its lifeline, descriptors, session, folder, environment, argv."""
    os.environ[lifeline.LAUNCHER_PID] = str(child.zygote_pid)
    lifeline.die_with_launcher()
    gc.enable()  # the zygote's objects stay frozen: the child's collections never walk them
    child.sock.close()
    for fd in child.wake:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    for target, fd in enumerate(child.fds):
        os.dup2(fd, target)
    for fd in child.fds:
        if fd > 2:
            os.close(fd)
    os.chdir(child.req["cwd"])
    os.environ.clear()
    os.environ.update(child.req["env"], **{lifeline.LAUNCHER_PID: str(child.zygote_pid)})  # its parent now
    sys.argv = ["psgd", *child.req["argv"]]


def serve(sock: socket.socket) -> Request | None:
    """The zygote's loop (see the module docstring). Returns None when the launcher closes the
    socket, or, in a forked child, the request that child is to run (`run_child`).

    The garbage collector is off while it loads and everything loaded is frozen before each fork
    (gc.freeze, as the gc module's documentation advises for fork without exec): a child's first
    full collection would otherwise walk every object the zygote made, torch's and protobuf's
    descriptors, and copy each page it touches."""
    gc.disable()
    for name in PRELOAD:
        importlib.import_module(name)
    refusal = unsafe_to_fork()
    send(sock, {"error": refusal} if refusal else {"ready": True})
    if refusal:
        return None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the pipe
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(sock)
                continue
            try:
                req, fds = recv(sock)
            except (EOFError, OSError):
                return None  # the launcher is done (or gone): the zygote ends, any child left dies with it
            child = _fork(Request(req, fds, sock, (wake_r, wake_w), os.getpid()))
            if child is not None:
                sel.close()  # its epoll descriptor is the zygote's, not the child's
                return child


def _fork(request: Request) -> Request | None:
    """Fork for `request`, unless something fork-unsafe is loaded (refused in one line): the child
    gets the request back, the zygote None."""
    refusal = unsafe_to_fork()
    if refusal:
        for fd in request.fds:
            os.close(fd)
        send(request.sock, {"error": refusal})
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # what the zygote made since the last fork too (its requests: a few objects)
    pid = os.fork()
    if pid == 0:
        return request
    for fd in request.fds:
        os.close(fd)
    send(request.sock, {"started": pid})
    _reap(request.sock)
    return None


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(sock, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def main() -> Request | None:
    """The zygote process: None when its launcher is done, or in a forked child the request to run."""
    lifeline.die_with_launcher()  # the launcher's child: die with it; its forks die with this process
    proctitle.set_title(proctitle.zygote_title(sys.argv[1]))  # `psgd zygote OUT`; each fork names itself
    return serve(socket.socket(fileno=int(sys.argv[2])))


if __name__ == "__main__":
    forked = main()
    if forked is not None:
        run_child(forked)  # never returns: the child's stack starts here
    os._exit(0)
