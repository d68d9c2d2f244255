"""The launcher's handle on its warm parent (psgd/train/zygote.py): start it, ask it to fork, wait.

Contract:
- `Zygote.start(tag, env, reloads=R, on_reload=f)` starts `python -m psgd.train.zygote TAG FD`
  (TAG, the run folder, names it in `ps`), connected by a Unix socket pair; it loads while the
  launcher prepares. A zygote that dies while it loads (before it said ready: nothing was forked
  yet, so nothing else is lost) is started again, at most R times in all, `on_reload(how)` told
  each time (`psgd run` passes its restart budget); past them, or with R = 0, the first spawn
  fails with one line naming the zygote and its exit (ZygoteError).
- `Zygote.spawn(argv, env, stdin, stdout, stderr)` asks it to fork a child that runs `psgd ARGV`
  with that environment and those three descriptors as 0, 1 and 2 (sent over the socket,
  SCM_RIGHTS); returns a `Forked`, which answers what the launcher asks of a subprocess.Popen:
  `pid`, `poll`, `wait`, `returncode` (negative: the signal), `send_signal`, `kill`. A refusal (the
  zygote found something fork-unsafe loaded) is a ZygoteError with its one line.
- The zygote reaps its children and reports each exit; `Zygote.wait_any()` blocks until the next
  report (the launcher's wait for "any child exited", as os.waitid is for its own children).
- Once the zygote is gone (its socket closed) every child it had is gone too (PR_SET_PDEATHSIG):
  each still running reads as killed. One thread uses a handle.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

from psgd.train import zygote as wire
from psgd.train.zygote import READY_TIMEOUT_S


class ZygoteError(RuntimeError):
    """The zygote refused, or is gone; the message is one line."""


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
    """The launcher's handle on its warm parent (see the module docstring)."""

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
        while not self._ready:
            if not _readable(self.sock, READY_TIMEOUT_S):
                self.close()
                raise ZygoteError(f"the zygote did not load within {READY_TIMEOUT_S:.0f}s")
            try:
                msg, _ = wire.recv(self.sock)
            except (EOFError, OSError):
                self._reload()
                continue
            if "error" in msg:
                raise ZygoteError(msg["error"])
            assert msg.get("ready"), msg
            self._ready = True

    def _reload(self) -> None:
        """The zygote died while loading: nothing was forked from it yet, so a new one loses nothing."""
        self.proc.wait()
        how = _how(self.proc.returncode)
        if self.reloads_left <= 0:
            raise ZygoteError(f"the zygote (pid {self.proc.pid}) {how} while loading") from None
        self.reloads_left -= 1
        self.reloaded.append(how)
        self.sock.close()
        if self.on_reload is not None:
            self.on_reload(how)
        self.proc, self.sock = _launch(self.tag, self.env)

    def spawn(self, argv: list[str], env: dict, stdin: int, stdout: int, stderr: int) -> Forked:
        """Fork `psgd ARGV` (see the module docstring); ZygoteError with the zygote's reason if it refused."""
        self._await_ready()
        try:
            wire.send(self.sock, {"argv": argv, "env": env, "cwd": os.getcwd()}, [stdin, stdout, stderr])
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
                return wire.recv(self.sock)
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
        if self.torn:
            self._next()
            return
        first = True
        while not self.gone:
            if not _readable(self.sock, timeout if (block and first) else 0):
                return
            first = False
            self._note(self._next()[0])
        self._next()  # gone: marks the children

    def wait_any(self) -> None:
        """Block until some child has exited that the last wait_any did not report (one read
        earlier by a poll counts: no exit is missed), then the launcher polls its children. It
        blocks in its own frame (a poll on the socket), so that a stack of the launcher taken
        mid-run ends here."""
        while self._unseen == 0:
            if (self.gone or self.torn) and all(c.returncode is not None for c in self.children.values()):
                return  # nothing left to report
            if self.torn:
                self._next()  # probes every child
                time.sleep(0.02)
                return  # the launcher polls its children, as after a report
            if not self.gone:
                waiting = select.poll()
                waiting.register(self.sock, select.POLLIN)
                waiting.poll()
            self._note(self._next()[0])
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


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    waiting = select.poll()
    waiting.register(sock, select.POLLIN)
    return bool(waiting.poll(None if timeout is None else max(0, int(timeout * 1000))))
