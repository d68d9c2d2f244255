"""A drill's storm: the thread that finds a run's processes by their titles and SIGKILLs them as planned.

Contract:
- `Storm(cfg, episodes, gaps, hold)` (a daemon thread of the launcher's process) carries out the
  episodes of `Fault`s that psgd/train/drill.py `plan` drew, while `launch.run` runs: it finds each
  target by its title (`psgd shard K/S OUT`, psgd/train/proctitle.py) among this process's
  descendants (`titles`, `descendants`: /proc only), SIGKILLs it and notes when (`done`), and after
  each episode waits until a step is written again (the run recovered) before the next one. The
  second fault of a `join` or `restart` episode takes a process that was not alive just before the
  first one's kill (the list is taken before the kill: a quick replacement is still new). It never
  kills anything else. A checkpoint fault kills the shard that psgd/ps/checkpoint.py's drill
  hold (`hold`, the folder `$PSGD_CHECKPOINT_HOLD` names) stopped mid-write. `stop` ends it; its own
  failure is kept in `error`, never raised into the run.
- `steps_written(out)`: every step line of the run so far, in any attempt's metrics file, or seen
  by an earlier look (a restart from scratch clears the folder); `noted()` the restarts seen the
  same way, `forget()` clears both for a new drill.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

from psgd.core.config import RunConfig
from psgd.train import proctitle
from psgd.train.metrics import read_events

__all__ = ["Fault", "POLL_S", "WAIT_S", "descendants", "titles", "name_of", "NOTED", "forget", "noted",
           "steps_written", "Storm"]

POLL_S = 0.02  # how often the drill looks at the run (its own loop; the run never waits on it)
WAIT_S = 300.0  # the longest the drill waits for a moment before it gives up on that fault


@dataclasses.dataclass
class Fault:
    kind: str
    index: int
    moment: str
    target: str = ""
    pid: int = 0
    at: float = 0.0  # time.time() of the kill
    recovery_s: float | None = None
    note: str = ""


def descendants(root: int) -> list[int]:
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{pid}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                found.append(int(k))
                todo.append(int(k))
    return found


def titles(out: str) -> dict[int, str]:
    """pid -> name ('shard 0/2', 'worker 1/3', 'zygote') of this run's processes, by their titles."""
    named = {}
    for pid in descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state == "Z":
            continue
        if cmd == proctitle.zygote_title(out):
            named[pid] = "zygote"
        elif cmd.startswith(f"{proctitle.PREFIX} ") and cmd.endswith(f" {out}"):
            name = cmd[len(proctitle.PREFIX) + 1:-len(out) - 1]
            if name.split(" ")[0] in ("shard", "worker"):
                named[pid] = name
    return named


def name_of(fault: Fault, cfg: RunConfig) -> str:
    if fault.kind == "zygote":
        return "zygote"
    if fault.kind == "shard":
        return proctitle.shard_name(fault.index, cfg.servers)
    return proctitle.worker_name(fault.index, cfg.workers)


NOTED = ("worker_restarted", "zygote_restarted", "restart")
_seen: dict[str, dict] = {}  # the NOTED events seen by any look: a restart from scratch clears the folder


def forget() -> None:
    """Start a drill with nothing seen."""
    _seen.clear()


def noted() -> list[dict]:
    """The NOTED events (restarts of a worker, of the zygote, of the run) seen so far, each once."""
    return [e for e in _seen.values() if e.get("event") in NOTED]


def steps_written(out: Path) -> list[dict]:
    """Every step line written so far, in any attempt's file, or seen by an earlier look."""
    for p in sorted(out.glob("metrics-attempt-*.jsonl")) + [out / "metrics.jsonl"]:
        try:
            found = read_events(p)
        except (OSError, ValueError):
            continue  # a line being written: the next look reads it whole
        for e in found:
            if e.get("event") in NOTED or e.get("event") == "step":
                _seen[json.dumps(e, sort_keys=True)] = e
    return [e for e in _seen.values() if e.get("event") == "step"]


class Storm(threading.Thread):
    """Carries `episodes` out against the run in `cfg.out` (see the module docstring)."""

    def __init__(self, cfg: RunConfig, episodes: list[list[Fault]], gaps: list[int], hold: Path) -> None:
        super().__init__(name="psgd-drill", daemon=True)
        self.cfg, self.out, self.episodes, self.gaps, self.hold = cfg, Path(cfg.out), episodes, gaps, hold
        self.stop = threading.Event()
        self.done: list[Fault] = []
        self.started = time.time()
        self.error: str = ""
        self.before: dict[int, str] = {}  # this run's processes just before the last kill (`_kill`)

    def run(self) -> None:
        try:
            for episode, gap in zip(self.episodes, self.gaps, strict=True):
                before: dict[int, str] = {}
                for fault in episode:
                    if not self._deliver(fault, gap, before):
                        return
                    before = self.before  # taken before the kill: a replacement that is quick is not in it
                if not self._wait(lambda f=episode[-1]: any(e["time"] > f.at for e in steps_written(self.out))):
                    return
        except Exception as e:  # noqa: BLE001 - the drill's own failure is reported, the run goes on
            self.error = f"{type(e).__name__}: {e}"

    def _wait(self, ready) -> bool:
        deadline = time.monotonic() + WAIT_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            if ready():
                return True
            self.stop.wait(POLL_S)
        return False

    def _kill(self, fault: Fault, pid: int, name: str) -> bool:
        # The processes alive just before the kill: the next fault of a `join` or `restart` episode
        # targets a process outside them. Taken after the kill, a replacement already forked and
        # titled (a descheduled storm thread on a loaded machine) counted as old and was never
        # found: the storm waited for a process that never came and the run ended (6 of 10 faults).
        self.before = titles(self.cfg.out)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False  # gone already: look again
        fault.pid, fault.target, fault.at = pid, name, time.time()
        self.done.append(fault)
        return True

    def _deliver(self, fault: Fault, gap: int, before: dict[int, str]) -> bool:
        mark = len(steps_written(self.out))
        if fault.moment == "checkpoint":
            (self.hold / "arm").write_text("")
            held: list[Path] = []

            def writing() -> bool:
                held[:] = list(self.hold.glob("held-*"))
                return bool(held)

            if not self._wait(writing):
                return False
            pid = int(held[0].name.split("-")[1])
            name = titles(self.cfg.out).get(pid, "shard ?")
            fault.index = int(name.split(" ")[1].split("/")[0]) if name != "shard ?" else -1
            torn = list((self.out / "checkpoints").glob(f".shard-{max(fault.index, 0)}-v*.{pid}.tmp"))
            fault.note = f"torn {torn[0].name} ({torn[0].stat().st_size} bytes)" if torn else ""
            ok = self._kill(fault, pid, name)
            held[0].unlink(missing_ok=True)
            return ok
        want = name_of(fault, self.cfg)
        found: list[int] = []

        def present() -> bool:
            found[:] = [p for p, n in titles(self.cfg.out).items()
                        if n == want and (fault.moment not in ("join", "restart") or p not in before)]
            return bool(found)

        while not self.stop.is_set():
            if fault.moment == "step" and not self._wait(lambda: len(steps_written(self.out)) >= mark + gap):
                return False

            if not self._wait(present):
                return False
            if fault.moment == "join" and any(e["time"] > self.done[-1].at and e["rank"] == fault.index
                                              for e in steps_written(self.out)):
                fault.note = "its replacement had stepped already"
            if self._kill(fault, found[0], want):
                return True
        return False
