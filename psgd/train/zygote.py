"""One warm parent per run: torch imported once, then every shard and worker forked from it.

Why: importing torch (with numpy and psgd's modules) costs about a second of CPU, and each of a
run's N + K processes paid it on the same cores: a 4-worker, 2-shard run spent 3.7-4.1 s starting
against 1.2-2.2 s for one `python -c "import torch, grpc, numpy"`. PyTorch's DataLoader workers
and multiprocessing's forkserver with preloaded modules do the same: fork after the import.

Contract:
- `Zygote.start(tag)` (the launcher, `psgd run`) starts `python -m psgd.train.zygote TAG` (TAG,
  the run folder), which names itself `psgd zygote TAG` (psgd/train/proctitle.py; each fork then
  names itself `psgd shard K/S OUT` or `psgd worker R/N OUT` as it parses its arguments), connected by a
  Unix socket pair. The zygote dies with its launcher (PR_SET_PDEATHSIG), imports what is safe
  to import before a fork (`PRELOAD`: torch, numpy, protobuf's messages and psgd's training and
  shard modules; never gRPC),
  says ready, then serves requests one at a time.
- `Zygote.spawn(argv, env, stdin, stdout, stderr)` asks it to fork a child that runs `psgd ARGV`
  (a shard or a worker: its room's `main`, `ROOMS`; anything else psgd/cli.py `main`) with that
  environment, those three descriptors as 0, 1 and 2 (sent over the
  socket, SCM_RIGHTS), in a session of its own, dying with the zygote; returns a `Forked`, which
  answers what the launcher asks of a `subprocess.Popen`: `pid`, `poll`, `wait`, `returncode`
  (negative: the signal), `send_signal`, `kill`.
- `Zygote.start(tag, env, reloads=R, on_reload=f)`: a zygote that dies while it loads (before it
  said ready: nothing was forked yet, so nothing else is lost) is started again, at most R times
  in all, `on_reload(how)` told each time (`psgd run` passes its restart budget, psgd/train/launch.py);
  past them, or with R = 0, the first spawn fails with one line naming the zygote and its exit.
- The zygote reaps its children and reports each exit to the launcher; `Zygote.wait_any()` blocks
  until the next report (the launcher's wait for "any child exited", as os.waitid is for its own).
- Fork safety: before every fork the zygote checks that nothing fork-unsafe exists in it: gRPC not
  imported (its atfork handlers and poller thread: psgd/train/lifeline.py tells that story), CUDA
  not initialised, torch's intra-op pool not started (it never computes). If anything is, it
  refuses with one line naming it, and the launcher fails the run with that line. The zygote has
  no thread of its own: one loop over its socket and a SIGCHLD self-pipe.
- `psgd run --cold-start` keeps the old way (each child `exec`s `python -m psgd ...`), for
  debugging; so does a run on cluster hosts (`--hosts`: each child enters its namespace through
  `ip netns exec`).
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
import subprocess
import sys
import time

from psgd.train import lifeline, proctitle

# What every child imports anyway (`python -m psgd` then psgd.cli's commands), by name: warming them
# here is a cache, not a dependency of this module on the layers above it.
PRELOAD = ("torch", "numpy", "psgd.cli", "psgd.core.config", "psgd.core.optim", "psgd.train.data",
           "psgd.train.models", "psgd.train.losses", "psgd.train.worker", "psgd.train.metrics",
           # protobuf's messages and the shard's pure parts: about 0.1 s of CPU in every shard and
           # worker (protobuf's text_format alone is 65 ms), and none of them loads gRPC.
           "psgd._proto.parameter_server_pb2", "psgd.ps.wire", "psgd.ps.shard", "psgd.ps.framing",
           "psgd.core.sparsify", "psgd.core.consistency", "psgd.core.link",
           # the rooms' mains and what they read before gRPC (psgd/ps/auth.py holds no gRPC, its
           # gRPC side is psgd/ps/grpc_auth.py): about 20 ms of CPU more per child otherwise
           "psgd.train.launch", "psgd.train.serve", "psgd.train.work", "psgd.train.evaluate",
           "psgd.core.localsgd", "psgd.core.sharding", "psgd.core.staleness", "psgd.ps.pull_streams",
           "psgd.ps.remedies", "psgd.ps.staging", "psgd.ps.transfer")
# The commands whose forks go straight to their room's main (psgd/train/roles.py `room_main`).
ROOMS = {"server": "psgd.train.serve", "worker": "psgd.train.work"}

# gRPC's C core must never be loaded in a parent that forks (the messages, parameter_server_pb2, are
# protobuf's alone; the stubs, parameter_server_pb2_grpc, import grpc).
UNSAFE_MODULES = ("grpc", "psgd._proto.parameter_server_pb2_grpc")
READY_TIMEOUT_S = 120.0


class ZygoteError(RuntimeError):
    """The zygote refused, or is gone; the message is one line."""


# -- the wire: length-prefixed JSON, descriptors alongside ------------------------------------------
def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
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


def _recv(sock: socket.socket) -> tuple[dict, list[int]]:
    fds: list[int] = []
    (size,) = struct.unpack("!I", _recv_exact(sock, 4, fds))
    return json.loads(_recv_exact(sock, size, fds)), fds


# -- the launcher's side -------------------------------------------------------------------------------
class Forked:
    """A child forked by the zygote, as the launcher sees it (the part of Popen it uses)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None
        self.stdin = self.stdout = None  # the launcher's ends of the pipes, set by the caller

    def poll(self) -> int | None:
        if self.zygote.torn:
            self._probe()
        else:
            self.zygote.pump(block=False)
        return self.returncode

    def _probe(self) -> None:
        """With the report stream torn (see `Zygote.torn`), ask the kernel instead: a pid that is gone
        has exited (and been reaped by the zygote); its status is no longer known, so -SIGTERM."""
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -signal.SIGTERM

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            if self.zygote.torn:
                self._probe()
                if self.returncode is None:
                    time.sleep(0.02)  # polling the kernel: the stream that would tell us is gone
            else:
                self.zygote.pump(block=True, timeout=left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # exited meanwhile: its report is on the way

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's handle on its warm parent (see the module docstring); one thread uses it."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, tag: str = "", env: dict | None = None,
                 reloads: int = 0, on_reload=None) -> None:
        self.proc, self.sock = proc, sock
        self.tag, self.env = tag, env
        self.reloads_left, self.on_reload = reloads, on_reload  # see `start`
        self.reloaded: list[str] = []  # how each zygote that died while loading ended
        self.children: dict[int, Forked] = {}
        self._ready = False
        self._unseen = 0      # exit reports read (by a poll, a wait, a spawn) since the last wait_any
        # A read interrupted inside a frame (Ctrl-C in the launcher's wait) leaves the stream at an
        # unknown offset: from then on children are waited for by asking the kernel (`Forked._probe`).
        self.torn = False
        self.gone = False     # the zygote's socket closed: it died, and its children with it

    @classmethod
    def start(cls, tag: str, env: dict | None = None, reloads: int = 0, on_reload=None) -> Zygote:
        return cls(*_launch(tag, env), tag, env, reloads, on_reload)

    def _await_ready(self) -> None:
        if self._ready:
            return
        while True:
            ready, _ = select_one(self.sock, READY_TIMEOUT_S)
            if not ready:
                self.close()
                raise ZygoteError(f"the zygote did not load within {READY_TIMEOUT_S:.0f}s")
            try:
                msg, _ = _recv(self.sock)
                break
            except (EOFError, OSError):
                self.proc.wait()
                how = _how(self.proc.returncode)
                if self.reloads_left <= 0:
                    raise ZygoteError(f"the zygote (pid {self.proc.pid}) {how} while loading") from None
                # Killed while it loaded: nothing was forked from it yet, so a new one loses nothing.
                self.reloads_left -= 1
                self.reloaded.append(how)
                self.sock.close()
                if self.on_reload is not None:
                    self.on_reload(how)
                self.proc, self.sock = _launch(self.tag, self.env)
        if "error" in msg:
            raise ZygoteError(msg["error"])
        assert msg.get("ready"), msg
        self._ready = True

    def spawn(self, argv: list[str], env: dict, stdin: int, stdout: int, stderr: int) -> Forked:
        """Fork `psgd ARGV` (see the module docstring); ZygoteError with the zygote's reason if it refused."""
        self._await_ready()
        try:
            _send(self.sock, {"argv": argv, "env": env, "cwd": os.getcwd()}, [stdin, stdout, stderr])
        except OSError:
            self.gone = True
        while True:
            msg, _ = self._next()
            if "gone" in msg:
                raise ZygoteError(f"the zygote is gone (exit code {self.proc.poll()})")
            if "error" in msg:
                raise ZygoteError(msg["error"])
            if "started" in msg:
                child = Forked(self, msg["started"])
                self.children[child.pid] = child
                return child
            self._note(msg)

    def _next(self) -> tuple[dict, list[int]]:
        """The next report. Once the zygote is gone, every child it had is gone too (PR_SET_PDEATHSIG
        kills them): each still running is marked killed, so the launcher sees exits, not an error."""
        if not self.gone and not self.torn:
            try:
                return _recv(self.sock)
            except (EOFError, OSError):
                self.gone = True
            except BaseException:
                self.torn = True  # (KeyboardInterrupt) perhaps mid-frame: never read this stream again
                raise
        if self.torn:
            for child in self.children.values():
                child._probe()
            return {}, []
        for child in self.children.values():
            if child.returncode is None:
                child.returncode = -signal.SIGKILL
                self._unseen += 1
        return {"gone": True}, []

    def _note(self, msg: dict) -> None:
        if "exited" in msg and msg["exited"] in self.children:
            self.children[msg["exited"]].returncode = msg["status"]
            self._unseen += 1

    def pump(self, block: bool, timeout: float | None = None) -> None:
        """Read the exit reports that have arrived (block: wait up to `timeout` for one)."""
        first = True
        if self.torn:
            self._next()
            return
        while not self.gone:
            ready, _ = select_one(self.sock, timeout if (block and first) else 0)
            if not ready:
                return
            first = False
            self._note(self._next()[0])
        self._next()  # gone: marks the children

    def wait_any(self) -> None:
        """Block until some child has exited that the last wait_any did not report (one read
        earlier by a poll counts: no exit is missed), then the launcher polls its children."""
        while self._unseen == 0:
            if (self.gone or self.torn) and all(c.returncode is not None for c in self.children.values()):
                return  # nothing left to report
            if self.torn:
                self._next()  # probes every child
                time.sleep(0.02)
                return  # the launcher polls its children, as after a report
            msg, _ = self._next()
            self._note(msg)
        self._unseen = 0

    def close(self) -> None:
        """End the zygote (its children, if any are left, die with it: PR_SET_PDEATHSIG)."""
        try:
            self.sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()


def _launch(tag: str, env: dict | None) -> tuple[subprocess.Popen, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "psgd.train.zygote", tag, str(theirs.fileno())],
                                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    finally:
        theirs.close()
    return proc, ours


def _how(rc: int) -> str:
    return f"died with signal {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"


def select_one(sock: socket.socket, timeout: float | None) -> tuple[bool, None]:
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        return bool(sel.select(timeout)), None


# -- the zygote's side ---------------------------------------------------------------------------------
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


def _child(req: dict, fds: list[int], sock: socket.socket, wake: tuple[int, ...], zygote_pid: int) -> None:
    """In the forked child: become `psgd ARGV` and never return. First of all, die with the zygote:
    it may be killed between the fork and this line, so the pid to compare is the one it had before
    the fork (asked for after, getppid() would name whoever adopted this orphan)."""
    code = 1
    try:
        os.environ[lifeline.LAUNCHER_PID] = str(zygote_pid)
        lifeline.die_with_launcher()
        gc.enable()  # the zygote's objects stay frozen: the child's collections never walk them
        sock.close()
        for fd in wake:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"], **{lifeline.LAUNCHER_PID: str(zygote_pid)})  # the zygote is its parent now
        sys.argv = ["psgd", *req["argv"]]
        room = ROOMS.get(req["argv"][0]) if req["argv"] else None
        if room is not None:  # a shard or a worker: straight to its room's main, not through psgd/cli.py
            raise SystemExit(importlib.import_module(room).main(req["argv"][1:]))
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


def serve(sock: socket.socket) -> None:
    """The zygote's loop (see the module docstring). Returns when the launcher closes the socket.

    The garbage collector is off while it loads and everything loaded is frozen before each fork
    (gc.freeze, as the gc module's documentation advises for fork without exec): a child's first
    full collection would otherwise walk every object the zygote made, torch's and protobuf's
    descriptors, and copy each page it touches. Measured: a forked child's `import grpc` took
    114 ms of CPU and 73k page faults with them unfrozen, 28 ms and 17k frozen."""
    gc.disable()
    for name in PRELOAD:
        importlib.import_module(name)
    refusal = unsafe_to_fork()
    _send(sock, {"error": refusal} if refusal else {"ready": True})
    if refusal:
        return
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
                req, fds = _recv(sock)
            except (EOFError, OSError):
                return  # the launcher is done (or gone): the zygote ends, any child left dies with it
            refusal = unsafe_to_fork()
            if refusal:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"error": refusal})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            zygote_pid = os.getpid()
            gc.freeze()  # what the zygote made since the last fork too (its requests: a few objects)
            pid = os.fork()
            if pid == 0:
                sel.close()  # its epoll descriptor is the zygote's, not the child's
                _child(req, fds, sock, (wake_r, wake_w), zygote_pid)
            for fd in fds:
                os.close(fd)
            _send(sock, {"started": pid})
            _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def main() -> None:
    lifeline.die_with_launcher()  # the launcher's child: die with it; its forks die with this process
    proctitle.set_title(proctitle.zygote_title(sys.argv[1]))  # `psgd zygote OUT`; each fork names itself
    sock = socket.socket(fileno=int(sys.argv[2]))
    serve(sock)


if __name__ == "__main__":
    main()
    os._exit(0)

