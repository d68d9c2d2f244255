"""The stacks a reader follows: mid-run, the launcher's main thread and a shard's together hold at
most 12 psgd frames (issue 53; 13 + 9 before), forked from the warm parent and with --cold-start.

What py-spy shows of a process's Python stack, taken here with faulthandler inside the processes
themselves (py-spy needs ptrace, which a test cannot count on): a sitecustomize on PYTHONPATH arms
`faulthandler.register(SIGUSR1, all_threads=True)` in every process of the run (again after each
fork, into a file per pid), the test signals the launcher and the shard once the launcher waits
for its children and the shard serves, and counts the main thread's frames in psgd's files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import psgd
from tests.helpers import ENV

PSGD = str(Path(psgd.__file__).resolve().parent)
BUDGET = 12  # the launcher's and a shard's psgd frames together
SITE = """
import faulthandler, os, signal, threading
_DIR = os.environ.get("PSGD_TEST_STACKS")


def _arm():
    f = open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a")
    f.write(f"main 0x{threading.main_thread().ident:016x}\\n")
    f.flush()
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    _arm.file = f  # kept open: faulthandler writes to its descriptor


if _DIR:
    _arm()
    os.register_at_fork(after_in_child=_arm)
"""


def main_thread_psgd_frames(dump: str) -> list[str] | None:
    """The psgd functions on the main thread's stack in the last faulthandler dump of `dump`; None
    until that stack is written whole (down to runpy's frame, the bottom of `python -m`'s main thread,
    or to faulthandler's mark that it stopped at 100 frames)."""
    main = re.findall(r"^main (0x[0-9a-f]+)$", dump, re.M)[-1]
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.rsplit("--- sample", 1)[-1]):
        # faulthandler writes at most 100 frames, then "  ...": a cold child deep in importing torch.
        whole = "_run_module_as_main" in block or re.search(r"^  \.\.\.$", block, re.M)
        if block.startswith(("Current thread " + main, "Thread " + main)) and whole:
            frames = re.findall(r'File "([^"]+)", line \d+ in (\S+)', block)
            return [f"{Path(f).name}:{name}" for f, name in frames if f.startswith(PSGD)]
    return None


def sample(stacks: Path, pid: int) -> list[str]:
    """Signal `pid` and return its main thread's psgd frames once its dump is written."""
    path = stacks / f"{pid}.txt"
    with open(path, "a") as f:
        f.write("--- sample\n")
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while (frames := main_thread_psgd_frames(path.read_text())) is None and time.monotonic() < deadline:
        time.sleep(0.02)  # written by the process's own signal handler: nothing here to wait on
    return frames or []


def pid_of(title: str, out: Path) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cmd.startswith(title) and str(out) in cmd:
            return int(pid)
    return None


@pytest.mark.parametrize("cold", [False, True], ids=["forked", "cold-start"])
def test_the_launcher_and_a_shard_hold_at_most_12_psgd_frames_mid_run(tmp_path, cold):
    stacks, site, out = tmp_path / "stacks", tmp_path / "site", tmp_path / "run"
    stacks.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    env = dict(ENV, PSGD_TEST_STACKS=str(stacks), PYTHONPATH=os.pathsep.join(filter(None, [
        str(site), str(Path(PSGD).parent), ENV.get("PYTHONPATH", "")])))
    argv = [sys.executable, "-m", "psgd", "run", "--mode", "sync", "--workers", "1", "--servers", "1",
            "--steps", "1000000", "--eval-every", "0", "--quiet", "--out", str(out)]
    argv += ["--cold-start"] if cold else []
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 120, ([], [])
        while time.monotonic() < deadline:  # until the launcher waits on its children and the shard serves
            # A worker starts once the shard listens: before that a cold shard may still be importing,
            # its handler not yet armed (a signal then waits until it is).
            shard, worker = pid_of("psgd shard 0/1", out), pid_of("psgd worker 0/1", out)
            if shard is not None and worker is not None and (stacks / f"{shard}.txt").exists():
                seen = sample(stacks, launcher.pid), sample(stacks, shard)
                if any(f.endswith(":wait_any" if not cold else ":wait_workers") for f in seen[0]) and \
                        any(f.endswith(":cmd_server") for f in seen[1]):
                    break
            time.sleep(0.2)
        launcher_frames, shard_frames = seen
        assert launcher_frames and shard_frames, "the run never reached its steady state"
        assert len(launcher_frames) + len(shard_frames) <= BUDGET, (launcher_frames, shard_frames)
    finally:
        launcher.send_signal(signal.SIGINT)  # the launcher stops every child (exit 130)
        launcher.communicate(timeout=120)
